"""Launch output without starting processes: thread count, torchrun's log flags, where each rank's output goes,
and which warnings a non-main rank leaves to rank 0."""

from __future__ import annotations

import os
import warnings

import pytest

from accel.core import rank_warnings
from accel.cli import output
from accel.cli._common import UsageError
from accel.cli.main import build_parser


def _args(*argv: str):
    return build_parser().parse_args(["launch", *argv, "x.py"])


def test_threads_are_cores_per_local_process_unless_the_user_chose(monkeypatch, capsys):
    monkeypatch.setattr(output, "usable_cores", lambda: 16)
    env: dict = {}
    assert output.set_worker_threads(4, on_cpu=True, environ=env) == 4 and env["OMP_NUM_THREADS"] == "4"
    assert capsys.readouterr().err == ("accel launch: 4 processes on 16 cores: OMP_NUM_THREADS=4 each (set "
                                       "OMP_NUM_THREADS to choose)\n")
    env = {}
    assert output.set_worker_threads(32, on_cpu=False, environ=env) == 1 and env["OMP_NUM_THREADS"] == "1"
    assert capsys.readouterr().err == ""  # GPU launches say nothing
    env = {"OMP_NUM_THREADS": "7"}
    assert output.set_worker_threads(4, on_cpu=True, environ=env) is None and env == {"OMP_NUM_THREADS": "7"}
    assert output.set_worker_threads(1, on_cpu=True, environ={}) is None  # one process: torch's own default
    assert capsys.readouterr().err == ""


def test_output_flags_become_torchrun_flags(tmp_path):
    assert output.torchrun_flags(_args()) == []
    logs = tmp_path / "logs"
    assert output.torchrun_flags(_args("--log_dir", str(logs), "--local_ranks_filter", "1,0,1")) == [
        "--log_dir", str(logs), "--tee", "3", "--local_ranks_filter", "0,1"]
    assert output.needs_agent(_args("--log_dir", "d")) and not output.needs_agent(_args())


@pytest.mark.parametrize("argv, needle", [
    (("--local_ranks_filter", "a"), "--local_ranks_filter 'a': allowed: comma-separated local ranks"),
    (("--local_ranks_filter", "-1"), "--local_ranks_filter '-1'"),
    (("--local_ranks_filter", ""), "--local_ranks_filter ''"),
])
def test_bad_filter_is_one_line(argv, needle):
    with pytest.raises(UsageError) as err:
        output.torchrun_flags(_args(*argv))
    assert needle in str(err.value)


def test_log_dir_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(UsageError, match="it is a file; allowed: a folder"):
        output.torchrun_flags(_args("--log_dir", str(tmp_path / "f")))


def _envs(ranks: list[int], restart: str = "0") -> dict[int, dict[str, str]]:
    return {local: {"RANK": str(rank), "TORCHELASTIC_RESTART_COUNT": restart} for local, rank in enumerate(ranks)}


def test_log_dir_files_are_named_by_global_rank_and_hidden_ranks_are_not_teed(tmp_path):
    from torch.distributed.elastic.multiprocessing.api import Std

    specs = output._rank_logs_specs_class()(str(tmp_path), Std.NONE, Std.ALL, {0})
    envs = _envs([2, 3])  # the second machine of two
    dest = specs.reify(envs)
    assert dest.stdouts == {0: str(tmp_path / "rank2.stdout.log"), 1: str(tmp_path / "rank3.stdout.log")}
    assert dest.stderrs[1] == str(tmp_path / "rank3.stderr.log")
    assert dest.tee_stdouts == {0: dest.stdouts[0]} and dest.tee_stderrs == {0: dest.stderrs[0]}
    assert specs.hidden_stderr == {3: dest.stderrs[1]}
    assert envs[1]["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "rank3.error.json")
    again = specs.reify(_envs([2, 3], restart="1"))
    assert again.stdouts[0] == str(tmp_path / "rank2.attempt1.stdout.log")
    specs.cleanup()
    assert tmp_path.is_dir()  # the user's folder stays


def test_without_log_dir_shown_ranks_use_the_console_and_hidden_stderr_a_temporary_file():
    from torch.distributed.elastic.multiprocessing.api import Std

    specs = output._rank_logs_specs_class()(None, Std.NONE, Std.NONE, {1})
    dest = specs.reify(_envs([0, 1]))
    assert dest.stdouts == {0: os.devnull, 1: ""} and dest.stderrs[1] == ""  # "": the agent's own console
    assert dest.stderrs[0].endswith("rank0.stderr.log") and specs.hidden_stderr == {0: dest.stderrs[0]}
    assert dest.tee_stdouts == {} and dest.tee_stderrs == {}
    folder = specs.root_log_dir
    assert os.path.isdir(folder)
    specs.cleanup()
    assert not os.path.exists(folder) and not os.path.exists(specs.root_log_dir)


@pytest.mark.parametrize("environ, quiet", [
    ({"RANK": "1"}, True),
    ({"RANK": "0"}, False),
    ({}, False),
    ({"RANK": "3", "ACCEL_WARNINGS_ALL_RANKS": "1"}, False),
])
def test_non_main_ranks_leave_repeated_warnings_to_rank_0(environ, quiet):
    with warnings.catch_warnings(record=True) as seen:
        warnings.resetwarnings()  # no filter: the default action, as for a UserWarning in a fresh interpreter
        assert rank_warnings.warn_once_per_job(environ) is quiet
        warnings.warn("old api", FutureWarning)
        warnings.warn_explicit("accel says", UserWarning, "accel/x.py", 1, module="accel.accelerator")
        warnings.warn("about this rank's batch", UserWarning)
    shown = [str(w.message) for w in seen]
    assert "about this rank's batch" in shown
    assert ("old api" in shown, "accel says" in shown) == (not quiet, not quiet)


def test_a_filter_the_user_set_still_decides_on_every_rank():
    with warnings.catch_warnings():
        warnings.resetwarnings()
        warnings.simplefilter("error", FutureWarning)  # e.g. -W error::FutureWarning
        rank_warnings.warn_once_per_job({"RANK": "1"})
        with pytest.raises(FutureWarning):
            warnings.warn("old api", FutureWarning)


def test_rendezvous_method_names_match_torchs():
    """The launcher's frame walk names the same caller as torch's `get_method_name` (it logs it) at every depth."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from accel.cli.output import _method_name

    torchs = dynamic_rendezvous.get_method_name

    def caller(depth):
        def inner():
            return torchs(depth), _method_name(depth)
        return inner()

    for depth in (1, 2, 3):
        theirs, ours = caller(depth)
        assert ours == theirs
    assert _method_name(10_000) == "no_method_name"
