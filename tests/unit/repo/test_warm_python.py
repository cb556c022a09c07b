"""The tests' warm interpreter (tests/multiproc/warm_python.py) answers as a fresh `python` does: the same output,
exit codes, environment, working directory, sys.path and end-of-interpreter work."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest
import warm_python

PROBE = r"""
import atexit, json, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined", flush=True))).start()
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("WARM_PROBE"),
                  "path0": sys.path[0], "extra": os.environ.get("PYTHONPATH", "") in sys.path,
                  "stdin": sys.stdin.read(), "main": __name__}))
print("to stderr", file=sys.stderr)
"""


def _both(cmd, **kwargs):
    fresh = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    warm = warm_python.run(cmd, **kwargs)
    return fresh, warm


def test_a_script_sees_what_a_fresh_interpreter_sees(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    extra = tmp_path / "extra"
    extra.mkdir()
    env = {**os.environ, "WARM_PROBE": "yes", "PYTHONPATH": str(extra)}
    fresh, warm = _both([sys.executable, str(script), "a", "b"], env=env, cwd=tmp_path, input="typed", timeout=60)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert '"var": "yes"' in warm.stdout and '"extra": true' in warm.stdout
    assert "thread joined\natexit ran" in warm.stdout


@pytest.mark.parametrize("code,expected", [("raise SystemExit(3)", 3), ("raise SystemExit('bad')", 1),
                                           ("raise ValueError('boom')", 1), ("import sys; sys.exit()", 0)])
def test_exit_codes_and_tracebacks_are_a_fresh_interpreters(code, expected, tmp_path):
    fresh, warm = _both([sys.executable, "-c", code], cwd=tmp_path, timeout=60)
    assert warm.returncode == fresh.returncode == expected
    assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]


def test_module_mode_puts_the_working_directory_first(tmp_path):
    (tmp_path / "probe_mod.py").write_text(PROBE)
    fresh, warm = _both([sys.executable, "-m", "probe_mod", "x"], cwd=tmp_path, timeout=60)
    assert warm.stdout == fresh.stdout and warm.returncode == 0


def test_a_command_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; time.sleep(30)"], cwd=tmp_path, timeout=1)
    assert warm_python.run([sys.executable, "-c", "print(1)"], cwd=tmp_path, timeout=30).stdout == "1\n"


def test_a_fifth_set_of_import_time_variables_replaces_the_least_recently_used_zygote(monkeypatch):
    """Four zygotes at most; a fifth set of import-time variables runs fresh the first time, and warm from its
    second command on (the least recently used zygote is stopped). A zygote busy with another thread's command is
    neither used nor stopped: that command runs fresh."""
    started, stopped = [], []

    class Fake:
        def poll(self):
            return None

    def start(import_time, transformers):
        started.append(import_time["TORCH_WARM_PROBE"])
        return Fake()

    monkeypatch.setattr(warm_python, "_zygotes", {})
    monkeypatch.setattr(warm_python, "_busy", set())
    monkeypatch.setattr(warm_python, "_asked", {})
    monkeypatch.setattr(warm_python, "_start_zygote", start)
    monkeypatch.setattr(warm_python, "_stop", lambda procs: stopped.extend(procs))
    monkeypatch.delenv(warm_python.FRESH_ENV, raising=False)
    cmd = [sys.executable, "-c", "pass"]

    def zygote(n):
        return warm_python._zygote_for(cmd, {"TORCH_WARM_PROBE": str(n)})

    first = [zygote(n) for n in range(4)]
    assert zygote(0) is first[0]  # 0 is now the most recently used: 1 goes first
    assert zygote(4) is None and not stopped  # asked once: fresh
    fifth = zygote(4)
    assert fifth is not None and stopped == [first[1]] and started == ["0", "1", "2", "3", "4"]
    warm_python._busy.update({first[2], first[3], first[0], fifth})
    assert zygote(5) is None and zygote(5) is None and len(stopped) == 1  # every zygote is busy: fresh
    assert zygote(3) is None  # its own zygote is busy (another thread's command): fresh


def test_the_temporary_folder_and_thread_count_are_each_commands_own(tmp_path):
    """TMPDIR and OMP_NUM_THREADS are set in the child (one zygote serves every value): tempfile and torch see the
    command's, as in a fresh interpreter, and so does the inductor cache folder torch._dynamo's import sets."""
    code = ("import os, tempfile, torch._dynamo; print(tempfile.gettempdir(), torch.get_num_threads(), "
            "os.environ.get('TORCHINDUCTOR_CACHE_DIR'))")
    for threads in ("1", None):
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "TORCHINDUCTOR_CACHE_DIR")}
        env["TMPDIR"] = str(tmp_path)
        if threads:
            env["OMP_NUM_THREADS"] = threads
        fresh, warm = _both([sys.executable, "-c", code], env=env, timeout=60)
        assert (warm.returncode, warm.stdout) == (0, fresh.stdout), warm.stderr
        assert warm.stdout.startswith(str(tmp_path))


POPEN_PROBE = r"""
import os, signal, sys, time
print("out", os.getsid(0) == os.getpid(), flush=True)
print("err", file=sys.stderr, flush=True)
if sys.argv[1:] == ["wait"]:
    time.sleep(60)
sys.exit(4)
"""


@pytest.mark.parametrize("session", [False, True])
def test_popen_answers_as_a_fresh_popen(tmp_path, session):
    """Output through pipes (stderr apart and into stdout), a file, the exit code, its own session when asked."""
    script = tmp_path / "probe.py"
    script.write_text(POPEN_PROBE)
    cmd = [sys.executable, str(script)]
    for streams in ({"stdout": subprocess.PIPE, "stderr": subprocess.PIPE},
                    {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}):
        fresh = subprocess.Popen(cmd, cwd=tmp_path, text=True, start_new_session=session, **streams)
        warm = warm_python.Popen(cmd, cwd=tmp_path, text=True, start_new_session=session, **streams)
        assert warm._zygote is not None  # served warm
        assert warm.communicate(timeout=60) == fresh.communicate(timeout=60)
        assert warm.returncode == fresh.returncode == 4
    with open(tmp_path / "out.txt", "w") as out:
        warm = warm_python.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.DEVNULL)
    assert warm.wait(timeout=60) == 4
    assert (tmp_path / "out.txt").read_text() == "out False\n"


def test_popen_is_signalled_and_waited_for_as_a_fresh_one(tmp_path):
    """Its output read as it comes, a timeout while it runs, a signal to its pid, the exit status of that signal."""
    script = tmp_path / "probe.py"
    script.write_text(POPEN_PROBE)
    warm = warm_python.Popen([sys.executable, str(script), "wait"], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    assert warm._zygote is not None
    assert select.select([warm.stdout], [], [], 60)[0]
    assert warm.stdout.readline() == "out True\n"  # its own session
    with pytest.raises(subprocess.TimeoutExpired):
        warm.wait(timeout=0.5)
    assert warm.poll() is None
    warm.send_signal(signal.SIGTERM)
    assert warm.communicate(timeout=30) == ("", None)
    assert warm.returncode == -signal.SIGTERM
    assert warm._zygote not in warm_python._busy  # free for the next command


def test_popen_output_larger_than_a_pipe_is_not_a_deadlock(tmp_path):
    cmd = [sys.executable, "-c", "import sys; sys.stdout.write('x' * 1_000_000); sys.stderr.write('y' * 300_000)"]
    warm = warm_python.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert warm._zygote is not None
    assert warm.communicate(timeout=60) == (b"x" * 1_000_000, b"y" * 300_000)
    assert warm.returncode == 0


LAUNCHED = r"""
import json, os, sys
import accel.cli.main  # noqa: F401 - not imported by a fresh `python SCRIPT`: in the spare neither
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "config": "ACCEL_LAUNCH_CONFIG" in
                  os.environ, "threads": os.environ.get("OMP_NUM_THREADS"), "main": __name__}), flush=True)
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "kill":
    os.kill(os.getpid(), 9)
if how == "raise":
    raise ValueError("boom")
sys.exit(int(how))
"""


@pytest.mark.parametrize("how", ["0", "7", "raise", "kill"])
def test_a_one_process_launch_runs_its_script_as_the_exec_would(tmp_path, how):
    """`accel launch` on one process execs `python SCRIPT`; from a warm launcher the script runs in a spare forked
    before the launcher ran, with the same output, exit code (a signal's too), arguments, folder and variables."""
    script = tmp_path / "launched.py"
    script.write_text(LAUNCHED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    env["HOME"] = str(tmp_path)
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--cpu", str(script), how]
    fresh, warm = _both(cmd, env=env, cwd=tmp_path, timeout=120)
    assert warm.returncode == fresh.returncode == {"0": 0, "7": 7, "raise": 1, "kill": -9}[how], warm.stderr
    assert warm.stdout == fresh.stdout and '"config": true' in warm.stdout
    assert warm.stderr.splitlines()[-1:] == fresh.stderr.splitlines()[-1:]
