"""`subprocess.run([sys.executable, ...])` for the tests, from a warm interpreter.

Most of what a multi-process test pays for is `accel launch`'s own start-up: a fresh interpreter importing torch and
torch._dynamo (about 3 CPU seconds on the 2-core CI machine) before it forks its workers. `run` hands the command to
a zygote: one interpreter per pytest process that imported torch and torch._dynamo once and forks a child per
command. The child makes itself what `python ARGS` started with ENV in CWD would be (environment, working directory,
`sys.path` from PYTHONPATH, `sys.argv`, stdin, stdout and stderr on their own files, fresh random seeds), runs the
module or script as `__main__`, and exits as the interpreter does (non-daemon threads joined, `atexit` handlers run,
streams flushed). accel is not imported in the zygote: every child imports it under its own environment. A command
whose script imports transformers, run without accel's Accelerate shim, gets a zygote that imported transformers'
modeling code too (what each worker imports first thing: about 2.5 CPU seconds per process); its Hugging Face cache
folder is then the one under the zygote's HOME (the tests that use it build their models from configs).

The variables read while torch is imported or the interpreter starts (TORCH*, OMP_*, PYTHON*, ...; HF_* and
TRANSFORMERS_* where transformers is preloaded) are the zygote's own: a command whose values differ gets a zygote of
its own, started with them. The child sets its own PYTHONPATH, TMPDIR (tempfile looks again) and OMP_NUM_THREADS
(torch.set_num_threads), so those never ask for another zygote. A pytest process keeps four at most: a fifth set of
variables runs fresh the first time and, from its second command on, replaces the zygote used least recently (a
zygote costs what a fresh interpreter does; the files of a pytest worker run one after another, each with its own
variables mostly). A zygote runs one command at a time:
a second thread's command meanwhile, or one with an interpreter option other than `-m`/`-c` (`-X`, `-W`, ...) or a
sitecustomize on its PYTHONPATH, runs in a fresh interpreter. `ACCEL_TEST_FRESH_PYTHON=1` turns the zygotes off
for a whole run.

A one-process `accel launch` execs `python SCRIPT`, which would import torch again: under `run`, the launcher's child
forks a spare of itself before the launcher runs, and the exec hands its command to the spare instead
(`_exec_into_a_spare`); the launcher then ends as the spare does.

`Popen` is the same for the tests that own a process's life (signals, Ctrl-C, a launch that runs while the test
watches its files): the zygote's child is the process, in a session of its own when asked, and its pid takes the
signals; its end comes back through the zygote.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

FRESH_ENV = "ACCEL_TEST_FRESH_PYTHON"
# variables read while torch (and what the zygote imports) is imported, or by the interpreter at start-up
_IMPORT_TIME = ("TORCH", "PYTORCH", "OMP_", "MKL", "KMP_", "CUDA", "NCCL", "GLOO", "LD_", "PYTHON", "TMPDIR", "NUMPY",
                "OPENBLAS", "GOTO", "TRITON", "LANG", "LC_", "HF_", "TRANSFORMERS_", "XDG_")
# read at import, set again in each child (tempfile looks again; torch.set_num_threads): the zygote starts without them
_SET_IN_CHILD = ("TMPDIR", "OMP_NUM_THREADS")
# set again in each child: its own PYTHONPATH, buffering and bytecode flags, temporary folder and thread count
_HANDLED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", *_SET_IN_CHILD)
_TRANSFORMERS_TIME = ("HF_", "TRANSFORMERS_")  # read when transformers is imported: only its zygotes' own
_PRELOAD = ("torch", "torch._dynamo", "torch.distributed.run",
            "torch.distributed.elastic.agent.server.local_elastic_agent")
# with the real Accelerate, which transformers' modeling code imports: never where accel's shim must be `accelerate`
_PRELOAD_TRANSFORMERS = ("transformers", "transformers.modeling_utils", "transformers.models.llama.modeling_llama")
_IMPORTS_TRANSFORMERS = re.compile(r"^\s*(import|from) transformers\b", re.MULTILINE)

_MAX_ZYGOTES = 4
# the running zygotes of this process: their import-time variables -> Popen, the least recently used first
_zygotes: dict = {}
_busy: set = set()  # the zygotes running a command for a thread of this process now
_asked: dict = {}  # import-time variables -> the commands that asked for them
_lock = threading.Lock()
_SET_BY_IMPORT: dict = {}  # in a zygote: the variables its imports put in os.environ
_stopped_at_exit: list = []  # _stop_zygotes once registered with atexit


def run(cmd: list, *, env: dict | None = None, cwd=None, timeout: float | None = None, input: str | None = None,
        check: bool = False) -> subprocess.CompletedProcess:
    """As `subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, input=input, capture_output=True, text=True)`."""
    cmd = [str(part) for part in cmd]
    env = dict(os.environ if env is None else env)
    cwd = str(cwd) if cwd is not None else os.getcwd()
    with _lock:
        zygote = _zygote_for(cmd, env)
        if zygote is not None:
            _busy.add(zygote)
    if zygote is None:
        proc = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, input=input, capture_output=True, text=True)
    else:
        try:
            proc = _run_forked(zygote, cmd, env, cwd, timeout, input)
        finally:
            _busy.discard(zygote)
    if check and proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, proc.stdout, proc.stderr)
    return proc


class Popen:
    """As `subprocess.Popen(cmd, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text, start_new_session=...)`,
    for the tests that own a process's life (they signal it, read its output as it comes, wait for its files): from a
    zygote where `run` would take one. stdout and stderr: `subprocess.PIPE` (`stderr=STDOUT` too), DEVNULL or a file
    opened for writing; anything else runs fresh. stdin is /dev/null. A pipe is a named one the child opens; this
    process holds a writing end of it too until the child's end is seen, so that a read never sees the end of the
    output before the child has opened it. The zygote is this command's until then (`poll`, `wait`, `communicate`)."""

    def __init__(self, cmd: list, *, cwd=None, env: dict | None = None, stdout=None, stderr=None, text: bool = False,
                 start_new_session: bool = False) -> None:
        self.args = [str(part) for part in cmd]
        env = dict(os.environ if env is None else env)
        cwd = str(cwd) if cwd is not None else os.getcwd()
        self._code: int | None = None
        self.stdout = self.stderr = None
        self._zygote = self._proc = None
        self._text = text
        self._held: list[int] = []  # this process's writing ends of the pipes, closed once the child ended
        self._folder = tempfile.mkdtemp(prefix="accel-warm-")
        paths = [os.path.join(self._folder, name) if stream == subprocess.PIPE else _written_to(stream)
                 for name, stream in (("stdout", stdout), ("stderr", stderr))]
        if stderr == subprocess.STDOUT:
            paths[1] = paths[0]
        if None not in paths:
            with _lock:
                self._zygote = _zygote_for(self.args, env)
                if self._zygote is not None:
                    _busy.add(self._zygote)
        if self._zygote is None:
            self._proc = subprocess.Popen(self.args, cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=text,
                                          start_new_session=start_new_session)
            self.pid, self.stdout, self.stderr = self._proc.pid, self._proc.stdout, self._proc.stderr
            return
        for name, stream, path in (("stdout", stdout, paths[0]), ("stderr", stderr, paths[1])):
            if stream == subprocess.PIPE:
                os.mkfifo(path, 0o600)
                read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a reader first: the writers' opens do not wait
                self._held.append(os.open(path, os.O_WRONLY))
                os.set_blocking(read, True)
                setattr(self, name, open(read, "r" if text else "rb"))
        self.pid = _send(self._zygote, {"argv": self.args[1:], "env": env, "cwd": cwd, "stdin": os.devnull,
                                        "stdout": paths[0], "stderr": paths[1], "session": start_new_session})

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else self._code

    def poll(self) -> int | None:
        if self.returncode is None:
            self._see_end(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._see_end(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple:
        """The rest of the piped output once the child ended (read meanwhile: a pipe's buffer never fills)."""
        if self._proc is not None:
            return self._proc.communicate(timeout=timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        streams = [stream for stream in (self.stdout, self.stderr) if stream is not None]
        data: dict = {stream: b"" for stream in streams}
        reading = list(streams)
        while reading:
            watched = reading + ([self._zygote.stdout] if self.returncode is None else [])
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(watched, [], [], wait)
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for stream in ready:
                if stream is self._zygote.stdout:
                    self._see_end(0)
                    continue
                chunk = os.read(stream.fileno(), 65536)
                if chunk:
                    data[stream] += chunk
                else:
                    reading.remove(stream)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = []
        for stream in (self.stdout, self.stderr):
            if stream is None:
                out.append(None)
                continue
            stream.close()
            out.append(data[stream].decode(errors="replace") if self._text else data[stream])
        return out[0], out[1]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _see_end(self, timeout: float | None) -> None:
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
            return
        ready, _, _ = select.select([self._zygote.stdout], [], [], timeout)
        if ready:
            line = self._zygote.stdout.readline()
            if not line:
                raise RuntimeError("warm_python: the zygote ended while running " + " ".join(self.args))
            self._code = json.loads(line)["code"]
            _busy.discard(self._zygote)
            self._release()

    def _release(self) -> None:
        for fd in self._held:  # the child's own ends are closed: the pipes end once what it left behind ends
            os.close(fd)
        self._held.clear()

    def __del__(self) -> None:
        if hasattr(self, "_held"):
            self._release()
            shutil.rmtree(self._folder, ignore_errors=True)


def _written_to(stream) -> str | None:
    """The path a zygote's child opens for `stream` (DEVNULL, or a file opened for writing), else None."""
    if stream == subprocess.DEVNULL:
        return os.devnull
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) and "w" in getattr(stream, "mode", "") else None


def _import_time(env: dict, transformers: bool) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME) and k not in _HANDLED
                        and (transformers or not k.startswith(_TRANSFORMERS_TIME))))


def _zygote_for(cmd: list, env: dict):
    if os.environ.get(FRESH_ENV, "0") not in ("", "0") or not sys.platform.startswith("linux"):
        return None
    if len(cmd) < 2 or cmd[0] != sys.executable or (cmd[1].startswith("-") and cmd[1] not in ("-m", "-c")):
        return None
    if any(os.path.exists(os.path.join(entry, name)) for entry in env.get("PYTHONPATH", "").split(os.pathsep)
           if entry for name in ("sitecustomize.py", "usercustomize.py")):
        return None  # what the interpreter runs at start-up, before any import
    transformers = _wants_transformers(cmd, env)
    key = (_import_time(env, transformers), transformers)
    _asked[key] = _asked.get(key, 0) + 1
    zygote = _zygotes.pop(key, None)
    if zygote is not None and zygote.poll() is None:
        _zygotes[key] = zygote  # now the most recently used
        return None if zygote in _busy else zygote  # one command at a time each: another thread's runs fresh
    # a zygote costs what a fresh interpreter does: one is replaced only for variables asked for a second time
    if len(_zygotes) >= _MAX_ZYGOTES and (_asked[key] < 2 or not _stop_least_recently_used()):
        return None
    _zygotes[key] = zygote = _start_zygote(dict(key[0]), key[1])
    return zygote


def _stop_least_recently_used() -> bool:
    """Make room for a zygote of other import-time variables (a test file's own, mostly: the files of a pytest worker
    run one after another); False when every zygote is running a command."""
    for key, proc in _zygotes.items():
        if proc not in _busy:
            del _zygotes[key]
            _stop([proc])
            return True
    return False


def _wants_transformers(cmd: list, env: dict) -> bool:
    """The script imports transformers, and `accelerate` means the same in its workers as in the zygote."""
    if "--accelerate_shim" in cmd or env.get("PYTHONPATH"):
        return False
    script = next((Path(part) for part in cmd[1:] if part.endswith(".py")), None)
    try:
        return script is not None and bool(_IMPORTS_TRANSFORMERS.search(script.read_text()))
    except OSError:
        return False


def _start_zygote(import_time: dict, transformers: bool):
    env = {k: v for k, v in os.environ.items() if not (k.startswith(_IMPORT_TIME) and k not in _HANDLED)}
    for name in _SET_IN_CHILD:  # torch's defaults here; each child's own are set in the child
        env.pop(name, None)
    env.update(import_time)
    flags = ["--zygote", *(["--transformers"] if transformers else [])]
    # its own stderr carries only what importing torch and transformers prints (each child writes to its own files)
    # unbuffered (bufsize=0): `select` on the replies must see every byte, none held in a reader's buffer
    proc = subprocess.Popen([sys.executable, "-u", __file__, *flags], env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=os.getcwd(), bufsize=0)
    if not proc.stdout.readline():
        raise RuntimeError("warm_python: the zygote did not start")
    if not _stopped_at_exit:
        _stopped_at_exit.append(atexit.register(_stop_zygotes))
    return proc


def _stop_zygotes() -> None:
    _stop(list(_zygotes.values()))
    _zygotes.clear()


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.stdin.close()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def _send(zygote, request: dict) -> int:
    """Hand a command to the zygote; the pid of the child that runs it."""
    zygote.stdin.write((json.dumps(request) + "\n").encode())
    zygote.stdin.flush()
    return json.loads(zygote.stdout.readline())["pid"]


def _run_forked(zygote, cmd, env, cwd, timeout, input) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="accel-warm-") as folder:
        paths = {name: os.path.join(folder, name) for name in ("stdin", "stdout", "stderr")}
        Path(paths["stdin"]).write_text(input or "")
        pid = _send(zygote, {"argv": cmd[1:], "env": env, "cwd": cwd, "spare": True, **paths})
        deadline = None if timeout is None else time.monotonic() + timeout
        timed_out = False
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([zygote.stdout], [], [], wait)
            if ready:
                break
            timed_out = True
            os.kill(pid, signal.SIGKILL)
            deadline = None
        line = zygote.stdout.readline()
        if not line:
            raise RuntimeError("warm_python: the zygote ended while running " + " ".join(cmd))
        code = json.loads(line)["code"]
        out = Path(paths["stdout"]).read_text(errors="replace")
        err = Path(paths["stderr"]).read_text(errors="replace")
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, out, err)
    return subprocess.CompletedProcess(cmd, code, out, err)


# -- the zygote -------------------------------------------------------------------------------------------------

def _serve(transformers: bool) -> None:
    import gc
    import importlib

    before = dict(os.environ)
    gc.disable()  # imports make few cycles: the collections they would trigger (0.6 CPU-s, measured) find nothing
    for name in (*_PRELOAD, *(_PRELOAD_TRANSFORMERS if transformers else ())):
        importlib.import_module(name)
    _SET_BY_IMPORT.update({k: v for k, v in os.environ.items() if before.get(k) != v})
    gc.collect()
    gc.freeze()  # what every child inherits: its own collections never walk it
    gc.enable()
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    replies.write(b"ready\n")
    replies.flush()
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(request)
            finally:
                os._exit(code)
        replies.write((json.dumps({"pid": pid}) + "\n").encode())
        replies.flush()
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        replies.write((json.dumps({"code": code}) + "\n").encode())
        replies.flush()


def _child(request: dict) -> int:
    """In the forked child: become `python ARGV` in CWD with ENV and run it; returns the exit code. Without "stdout"
    in the request, the standard streams are those this process has (a spare's: the launcher's)."""
    import io
    import random
    import runpy
    import threading

    signal.signal(signal.SIGINT, signal.default_int_handler)
    if request.get("session"):
        os.setsid()
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        if "stdout" not in request:
            break
        if fd == 2 and request["stderr"] == request["stdout"]:  # stderr=STDOUT: one file, one offset
            os.dup2(1, 2)
            continue
        opened = os.open(request[name], mode | (os.O_CREAT | os.O_TRUNC if fd else 0), 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    env = request["env"]
    unbuffered = env.get("PYTHONUNBUFFERED", "") != ""
    sys.stdin = io.TextIOWrapper(open(0, "rb", closefd=False), encoding="utf-8", errors="strict")
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = io.TextIOWrapper(open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False), encoding="utf-8",
                                  errors="backslashreplace" if fd == 2 else "strict",
                                  line_buffering=fd == 2 or not unbuffered, write_through=unbuffered)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    os.chdir(request["cwd"])
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ.clear()
    os.environ.update(env)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    argv = request["argv"]
    first = os.path.dirname(os.path.realpath(argv[0])) if argv[0] not in ("-m", "-c") else os.getcwd()
    sys.path[:] = [first, *entries, *(p for p in sys.path[1:] if p not in own and p not in entries)]
    sys.path_importer_cache.clear()
    import importlib

    importlib.invalidate_caches()
    sys.dont_write_bytecode = env.get("PYTHONDONTWRITEBYTECODE", "") != ""
    tempfile.tempdir = None  # found again from this TMPDIR at first use
    for name, value in _SET_BY_IMPORT.items():  # what the preloaded modules set, as they would in this environment
        if name not in env:
            os.environ[name] = value
    if "TORCHINDUCTOR_CACHE_DIR" in _SET_BY_IMPORT and "TORCHINDUCTOR_CACHE_DIR" not in env:
        from torch._inductor.runtime import cache_dir_utils  # under this TMPDIR (torch._dynamo sets it on import)

        del os.environ["TORCHINDUCTOR_CACHE_DIR"]
        cache_dir_utils.cache_dir()
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # OpenMP read the zygote's (none) when torch was imported
        sys.modules["torch"].set_num_threads(int(threads))
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if request.get("spare") and argv[:2] == ["-m", "accel.cli.main"] and "launch" in argv:
        _exec_into_a_spare()
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException as exc:  # noqa: BLE001 - printed as the interpreter prints it
        sys.excepthook(type(exc), exc, exc.__traceback__)
        code = 128 + signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    threading._shutdown()  # type: ignore[attr-defined]  # what the interpreter does at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    return code


def _exec_into_a_spare() -> None:
    """A one-process `accel launch` replaces itself with `python SCRIPT` (os.execvpe): a fresh interpreter that imports
    torch again. Here a spare of this process is forked first (the zygote's modules and this command's set-up, before
    the launcher runs), and the launcher's exec of a plain `python` command hands the command to it instead: the spare
    becomes it as `_child` makes a command (its environment, sys.path, argv, seeds), on the launcher's own streams and
    folder, and the launcher ends as the spare ends, as if replaced (its exit handlers do not run). The spare dies with
    the launcher (PR_SET_PDEATHSIG) and leaves quietly when it gets no command. Only for `run`: a signal to the
    launcher's pid would not reach the spare (`Popen`'s commands exec for real)."""
    import ctypes

    read, write = os.pipe()
    launcher = os.getpid()
    spare = os.fork()
    if spare == 0:
        os.close(write)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != launcher:
            os._exit(0)
        data = b"".join(iter(lambda: os.read(read, 1 << 16), b""))
        os.close(read)
        code = 0
        try:
            if data:
                command = json.loads(data)
                code = _child({"argv": command["argv"], "env": command["env"], "cwd": os.getcwd()})
        finally:
            os._exit(code)
    os.close(read)
    real_execvpe = os.execvpe

    def execvpe(file, args, env):
        args = [str(arg) for arg in args]
        plain = (len(args) > 1 and file == args[0] == sys.executable
                 and (not args[1].startswith("-") or args[1] in ("-m", "-c")))
        if not plain or os.getpid() != launcher:  # another command, or a process the launcher forked: a real exec
            real_execvpe(file, args, env)
        payload = json.dumps({"argv": args[1:], "env": dict(env)}).encode()
        while payload:
            payload = payload[os.write(write, payload):]
        os.close(write)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the spare is the process now: it decides
            signal.signal(signum, signal.SIG_IGN)
        _, status = os.waitpid(spare, 0)
        if os.WIFSIGNALED(status):
            signum = os.WTERMSIG(status)
            if signum not in (signal.SIGKILL, signal.SIGSTOP):
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        os._exit(os.waitstatus_to_exitcode(status))

    os.execvpe = execvpe


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


if __name__ == "__main__" and sys.argv[1:2] == ["--zygote"]:
    _serve(transformers="--transformers" in sys.argv)
