"""Exception texts the launcher embeds in its own lines are one line each: the warning when the
workers' stacks could not be collected, a DeepSpeed config warning, a host's ssh client killed by a signal."""

from __future__ import annotations

import signal
import warnings

from accel.cli import checks, hang_report, multinode


def test_a_failed_stack_collection_is_one_line(tmp_path, monkeypatch, capsys):
    from torch.distributed.elastic.multiprocessing.api import SubprocessContext

    monkeypatch.setattr(SubprocessContext, "_close", lambda self, death_sig, timeout=30: None)
    monkeypatch.setattr(hang_report.tempfile, "mkdtemp", lambda prefix: str(tmp_path))
    watch = hang_report.HangWatch(600)

    def fails(pcontext):
        raise RuntimeError("first line\nsecond line\n  third")

    monkeypatch.setattr(watch, "before_stop", fails)
    with watch.around_agent():
        SubprocessContext._close(object(), signal.SIGTERM)
    assert capsys.readouterr().err == ("accel launch: warning: could not collect the workers' stacks: first line "
                                       "second line third\n")


def test_a_held_config_warning_is_one_line(monkeypatch, capsys):
    from accel.config import DeepSpeedConfigWarning

    def resolve(config_file, overrides, flags_source):
        warnings.warn("ds.json: key 'x' is ignored\nby accel", DeepSpeedConfigWarning, stacklevel=1)
        from accel.config import config_from_dict

        return config_from_dict({}, "test")

    monkeypatch.setattr(checks, "resolve_launch_config", resolve)
    checks.resolve_checked(None, {}, "accel launch", "flags", hold_warnings=True)
    checks.release_warnings()
    assert capsys.readouterr().err == "accel launch: warning: ds.json: key 'x' is ignored by accel\n"


def test_a_hosts_ssh_client_killed_by_a_signal_is_named():
    assert multinode._describe_exit(-9) == "was killed by signal 9 (SIGKILL) (its ssh client, on this machine)"
