"""`accel launch` on CPU forks its workers from the launcher (accel/cli/forked_workers.py) instead of starting fresh
interpreters: a worker must not be able to tell. The same probe runs forked and with ACCEL_FRESH_WORKERS=1; what it
sees of its interpreter (__name__, argv, sys.path[0], signal handlers, thread count, stdout) is
equal, its atexit handlers run and its non-daemon threads are joined in both, and the forked ranks draw different
`random` numbers, as fresh ones do."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
from _launch import SCRIPTS, accel_launch

from accel.cli import forked_workers

pytestmark = pytest.mark.multiproc


def _run(env: dict, out, fresh: bool) -> dict[int, dict]:
    out.mkdir()
    env = {**env, "ACCEL_FRESH_WORKERS": "1" if fresh else "0"}
    proc = accel_launch(env, "--cpu", "--num_processes", 2, SCRIPTS / "worker_semantics.py", out)
    assert proc.stdout.count(" done") == 2, proc.stdout
    for rank in (0, 1):
        assert (out / f"exit{rank}.txt").read_text() == "ran"
        assert (out / f"thread{rank}.txt").read_text() == "joined"
    return {rank: json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)}


def test_a_forked_worker_sees_what_a_fresh_interpreter_sees(isolated_env, tmp_path):
    forked, fresh = _run(isolated_env, tmp_path / "forked", False), _run(isolated_env, tmp_path / "fresh", True)
    for rank in (0, 1):
        a, b = dict(forked[rank]), dict(fresh[rank])
        assert a.pop("random") != b.pop("random")
        assert a.pop("argv") == [str(tmp_path / "forked")] and b.pop("argv") == [str(tmp_path / "fresh")]
        assert a == b, (a, b)
        assert a["name"] == "__main__" and a["sigterm_default"] and a["torch_threads"] == 1
    assert forked[0]["random"] != forked[1]["random"]  # not the launcher's generator state, copied


def test_python_target_and_the_popen_stand_in():
    exe = sys.executable
    assert forked_workers.python_target((exe, "-u", "a.py", "x")) == ("path", "a.py", ["x"])
    assert forked_workers.python_target((exe, "-u", "-m", "pkg.mod", "--y")) == ("module", "pkg.mod", ["--y"])
    assert forked_workers.python_target(("numactl", "--cpunodebind=0", exe, "-u", "a.py")) is None
    assert forked_workers.python_target(("/bin/echo", "hi")) is None
    child = subprocess.Popen([exe, "-c", "import time; time.sleep(30)"])
    try:  # ForkedProcess only waits for a pid: a real child stands in for a forked one
        proc = forked_workers.ForkedProcess(child.pid, ("sleep",))
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == -signal.SIGTERM and proc.ended_at is not None
        failure = type("Failure", (), {"pid": child.pid})()
        assert forked_workers.by_end({3: failure}) == [3]
    finally:
        child.kill()


SESSION_PROBE = """
import atexit, os, sys
from accel.cli import forked_workers

atexit.register(lambda: print("the parent's exit handler", flush=True))


def run():
    atexit.register(lambda: print("the child's exit handler", flush=True))
    print("child", os.getsid(0) == os.getpid(), os.environ.get("ONLY_IN_CHILD"), flush=True)
    return 3


child = forked_workers.fork_session(run, {**os.environ, "ONLY_IN_CHILD": "yes"}, ("probe",))
print("code", child.wait(30), flush=True)
"""


def test_fork_session_exits_as_an_interpreter_does(tmp_path):
    """A child of `fork_session` (fault tolerance's group launchers): its own session and environment, its exit code,
    its own exit handlers run at its end, the parent's not."""
    done = subprocess.run([sys.executable, "-c", SESSION_PROBE], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["child True yes", "the child's exit handler", "code 3",
                                        "the parent's exit handler"], done.stdout + done.stderr
