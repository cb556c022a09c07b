"""Preemption without starting workers: the flags and keys, torchrun's signal list, the launcher's handler (request,
second signal, grace period, nobody listening), the exit code and `scontrol requeue`, and the worker's flag."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from accel.cli import launch
from accel.cli import preemption as preempt
from accel.cli.main import build_parser
from accel.config import ConfigError, config_from_dict
from accel.runtime import preemption



def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("accel launch: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("import sys\nsys.exit(0)\n")
    return path


# -- flags and config keys -----------------------------------------------------------------------------------

def test_flags_reach_the_config_and_keys_are_checked():
    args = build_parser().parse_args(["launch", "--preemption_signal", "sigusr1", "--grace_period", "90",
                                      "--requeue", "t.py"])
    overrides = launch.flag_overrides(args)
    assert overrides["preemption_signal"] == "sigusr1" and overrides["grace_period"] == 90
    assert overrides["requeue"] is True
    cfg = config_from_dict(overrides, "test")
    assert (cfg.preemption_signal, cfg.grace_period, cfg.requeue) == ("SIGUSR1", 90.0, True)
    defaults = config_from_dict({}, "test")
    assert (defaults.preemption_signal, defaults.grace_period, defaults.requeue) == (None, 300.0, False)
    with pytest.raises(ConfigError, match=r"key 'grace_period': bad value 0; allowed: a finite number of seconds "
                                          r"from 1 to 31536000"):
        config_from_dict({"grace_period": 0}, "test")
    with pytest.raises(ConfigError, match=r"key 'requeue': bad value 'yes'; allowed: true or false"):
        config_from_dict({"requeue": "yes"}, "test")


def test_bad_values_are_one_line_errors(run_accel, script):
    assert_one_line_error(run_accel("launch", "--cpu", "--preemption_signal", "SIGKILL", script),
                          "key 'preemption_signal': bad value 'SIGKILL'", "allowed: one of SIGTERM, SIGUSR1, SIGUSR2")
    assert_one_line_error(run_accel("launch", "--cpu", "--grace_period", "-5", script),
                          "key 'grace_period': bad value -5", "allowed: a finite number of seconds from 1 to 31536000")
    assert_one_line_error(run_accel("launch", "--cpu", "--grace_period", "soon", script),
                          "--grace_period", "'soon'", "allowed: a finite number of seconds from 1 to 31536000")


def test_torchrun_keeps_the_signals_we_do_not_take():
    assert preempt.torchrun_flags(None) == ["--signals_to_handle", "SIGINT,SIGHUP,SIGQUIT"]
    assert preempt.torchrun_flags("SIGUSR1") == ["--signals_to_handle", "SIGINT,SIGHUP,SIGQUIT"]
    assert preempt.torchrun_flags("SIGTERM", preemptible=False) == []  # --hostfile's launchers: as before
    assert preempt.handled_signals("SIGUSR2") == [signal.SIGTERM, signal.SIGUSR2]
    assert preempt.handled_signals("SIGTERM") == [signal.SIGTERM]


@pytest.fixture(autouse=True)
def default_signal_handlers():
    """Each test starts from the default handlers (an earlier test in this process may have run torchrun's agent,
    which leaves its own SIGTERM handler installed) and leaves the previous ones as they were."""
    names = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    before = {sig: signal.signal(sig, signal.SIG_DFL) for sig in names}
    yield
    for sig, handler in before.items():
        signal.signal(sig, handler)


# -- the launcher's handler ------------------------------------------------------------------------------------

def _watch(tmp_path, **kwargs) -> preempt.PreemptionWatch:
    watch = preempt.PreemptionWatch(tmp_path, kwargs.pop("signal_name", None), kwargs.pop("grace", 60.0), **kwargs)
    assert watch.worker_env() == {preemption.DIR_ENV: str(tmp_path / "preemption")}
    return watch


def test_without_a_listening_worker_the_first_signal_stops_as_before(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    watch = _watch(tmp_path)
    with watch.around_agent(), pytest.raises(SignalException) as raised:
        signal.raise_signal(signal.SIGTERM)
    assert raised.value.sigval == signal.SIGTERM
    assert not preemption.request_path(watch.folder).exists()
    assert watch.stopped_message() == "accel launch: stopped by signal 15 (SIGTERM); the workers were stopped"
    assert watch.stopped_code() == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_the_first_signal_asks_and_a_second_one_stops(tmp_path, capsys):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    watch = _watch(tmp_path, signal_name="SIGUSR2")
    preemption.listening_path(watch.folder, 1).touch()
    with watch.around_agent():
        signal.raise_signal(signal.SIGUSR2)  # a request: returns
        assert preemption.request_path(watch.folder).read_text() == "SIGUSR2\n"
        assert "got SIGUSR2: asked the workers to save and stop" in capsys.readouterr().err
        with pytest.raises(SignalException) as raised:
            signal.raise_signal(signal.SIGTERM)
    assert raised.value.sigval == signal.SIGTERM  # torchrun stops the workers with SIGTERM whatever we got
    assert watch.stopped_message() == "accel launch: stopped by a second signal (SIGTERM); the workers were stopped"
    assert watch.stopped_code() == 143
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_the_grace_period_running_out_stops(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import SignalException

    watch = _watch(tmp_path, grace=0.3)
    preemption.listening_path(watch.folder, 0).touch()
    with watch.around_agent(), pytest.raises(SignalException):
        signal.raise_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the timer's signal interrupts this loop
            time.sleep(0.05)
    assert watch.expired
    assert watch.stopped_message() == ("accel launch: the workers did not stop within the grace period (0.3 s) after "
                                       "SIGTERM; they were stopped")
    assert watch.stopped_code() == 143


def test_exit_code_and_requeue_after_the_workers_stopped(tmp_path, monkeypatch, capsys):
    watch = _watch(tmp_path, requeue=True)
    assert watch.finish({}) == 0  # no request: a normal end
    watch.requested_by = signal.SIGTERM
    assert watch.finish({}) == 0  # the workers ended without seeing it (training was over)
    preemption.seen_path(watch.folder, 0).touch()
    calls = []

    def scontrol(command, **kwargs):
        calls.append(command)
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(preempt.subprocess, "run", scontrol)
    assert watch.finish({"SLURM_JOB_ID": "4242"}) == preemption.EXIT_CODE == 75
    assert calls == [["scontrol", "requeue", "4242"]]
    err = capsys.readouterr().err
    assert "the workers stopped at the preemption request; exit code 75" in err
    assert "requeued SLURM job 4242" in err
    assert watch.finish({}) == 75  # not under SLURM: a warning, the same code
    assert "--requeue: not under SLURM" in capsys.readouterr().err
    other = _watch(tmp_path, requeue=True, machine_rank=1)  # machine_rank 0 requeues the job, once
    assert other.requested_by is None  # another machine's launcher got the signal; its workers saw the request
    assert other.finish({"SLURM_JOB_ID": "4242"}) == 75 and len(calls) == 1


def test_requeue_failures_are_one_warning_line(capsys):
    def missing(command, **kwargs):
        raise FileNotFoundError(2, "No such file or directory", "scontrol")

    assert not preempt.requeue_slurm_job({"SLURM_JOB_ID": "7"}, run=missing)
    assert "scontrol requeue 7 failed: [Errno 2] No such file or directory" in capsys.readouterr().err

    def refused(command, **kwargs):
        return subprocess.CompletedProcess(command, 1, "", "Requested operation is presently disabled\n")

    assert not preempt.requeue_slurm_job({"SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, run=refused)
    assert "scontrol requeue 7_3 failed: Requested operation is presently disabled" in capsys.readouterr().err


# -- the worker side ---------------------------------------------------------------------------------------------

class _OneProcess:
    process_index = 0
    num_processes = 1


def test_worker_reads_the_request_file_and_leaves_its_marks(tmp_path, monkeypatch):
    monkeypatch.setenv(preemption.DIR_ENV, str(tmp_path))
    preemption._reset_for_tests()
    try:
        assert preemption.requested(_OneProcess()) is False
        assert preemption.listening_path(tmp_path, 0).exists() and not preemption.seen_path(tmp_path, 0).exists()
        assert signal.getsignal(signal.SIGTERM) is preemption._on_signal  # a job-wide SIGTERM asks too
        preemption.request_path(tmp_path).write_text("SIGTERM\n")
        assert preemption.requested(_OneProcess()) is True
        assert preemption.seen_path(tmp_path, 0).exists()
        preemption.request_path(tmp_path).unlink()
        assert preemption.requested(_OneProcess()) is True  # once agreed, it stays
    finally:
        preemption._reset_for_tests()


def test_which_signals_a_process_handles_itself():
    assert preemption.signals_to_handle({}) == [signal.SIGTERM]  # python script.py, or a one-process accel launch
    assert preemption.signals_to_handle({"TORCHELASTIC_RUN_ID": "x"}) == []  # plain torchrun: it stops with SIGTERM
    # accel launch's agent: the file, and the worker's own SIGTERM (a signal to every process of the job) too
    assert preemption.signals_to_handle({preemption.DIR_ENV: "/tmp/x"})[0] == signal.SIGTERM
    assert preemption.signals_to_handle({"TORCHELASTIC_RUN_ID": "x", preemption.SIGNALS_ENV: "sigterm, SIGUSR2"}) \
        == [signal.SIGTERM, signal.SIGUSR2]
    with pytest.raises(ValueError, match=r"ACCEL_PREEMPTION_SIGNALS: bad value 'SIGKILL'; allowed: one of SIGTERM"):
        preemption.signals_to_handle({preemption.SIGNALS_ENV: "SIGKILL"})


def test_one_process_without_a_launcher_turns_sigterm_into_the_request(isolated_env):
    """`python script.py` (or a one-process accel launch, which execs the script): the first SIGTERM sets the flag,
    a second one ends the process by SIGTERM as it would have without accel."""
    code = ("import os, signal\n"
            "from accel.runtime import preemption\n"
            "class S: process_index = 0; num_processes = 1\n"
            "assert not preemption.requested(S())\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('requested', preemption.requested(S()), flush=True)\n"
            "os.kill(os.getpid(), signal.SIGTERM)\n"
            "print('not reached', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=isolated_env)
    assert result.returncode == -signal.SIGTERM, result.stderr
    assert result.stdout == "requested True\n"
    assert "accel: got SIGTERM: preemption_requested turns true at the next step" in result.stderr


def test_under_ray_train_a_node_drain_is_the_request(monkeypatch, capsys):
    """Ray Train sends no signal before a drained node's deadline: `preemption_requested` asks
    `ray.train.get_preemption_info()` (Ray 2.60's API, stood in for here: a drain cannot be made on a one-node local
    cluster) at every read, and the answer turns True when Ray reports a drain."""
    import types

    answers = [None, None, types.SimpleNamespace(preempted_node_ids=["n1"], deadline_ms=123)]
    asked = []

    def get_preemption_info():
        asked.append(1)
        return answers[len(asked) - 1]

    monkeypatch.setitem(sys.modules, "ray.train", types.SimpleNamespace(get_preemption_info=get_preemption_info))
    monkeypatch.delenv(preemption.DIR_ENV, raising=False)
    preemption._reset_for_tests()
    try:
        assert [preemption.requested(_OneProcess()) for _ in range(3)] == [False, False, True]
        assert preemption.requested(_OneProcess()) is True and len(asked) == 3  # agreed: Ray is not asked again
        assert "accel: Ray Train: node(s) n1 are being drained (deadline 123 ms)" in capsys.readouterr().err
    finally:
        preemption._reset_for_tests()


def test_outside_a_ray_train_worker_ray_is_asked_once(monkeypatch):
    import types

    asked = []

    def get_preemption_info():  # Ray raises so outside a Ray Train worker
        asked.append(1)
        raise RuntimeError("`get_preemption_info` can only be called from within a Ray Train worker")

    monkeypatch.setitem(sys.modules, "ray.train", types.SimpleNamespace(get_preemption_info=get_preemption_info))
    monkeypatch.delenv(preemption.DIR_ENV, raising=False)
    preemption._reset_for_tests()
    try:
        assert [preemption.requested(_OneProcess()) for _ in range(3)] == [False] * 3 and len(asked) == 1
    finally:
        preemption._reset_for_tests()
