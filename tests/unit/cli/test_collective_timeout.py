"""collective_timeout (config key < launch flag < code) and the hang report's pieces, without starting workers."""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest

from accel.core import diagnostics as diag
from accel.cli import hang_report, launch
from accel.cli.main import build_parser
from accel.config import LAUNCH_ENV, AccelConfig, config_from_dict, encode_for_workers
from accel.config.schema import DEFAULT_COLLECTIVE_TIMEOUT
from accel.config.kwargs import InitProcessGroupKwargs
from accel.state import _collective_timeout

GLOO_TIMEOUT = ("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv "
                "operation to complete")


# ----------------------------------------------------------------------------------------------------------
# the key, the flag, the code: precedence and bad values
# ----------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_user_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("ACCEL_CONFIG_FILE", LAUNCH_ENV):
        monkeypatch.delenv(name, raising=False)


def resolved(*flags: str, config_file: Path | None = None) -> float:
    args = build_parser().parse_args(["launch", *flags, "train.py"])
    return launch.resolve_launch_config(config_file, launch.flag_overrides(args)).collective_timeout


def test_the_flag_beats_the_config_file_which_beats_the_default(no_user_config, tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("collective_timeout: 120\n")
    assert resolved() == DEFAULT_COLLECTIVE_TIMEOUT == 600
    assert resolved(config_file=cfg_file) == 120.0
    assert resolved("--collective_timeout", "2.5", config_file=cfg_file) == 2.5
    assert resolved("--collective-timeout", "30") == 30.0


def test_init_process_group_kwargs_wins_in_code_over_the_launched_config(no_user_config, monkeypatch):
    monkeypatch.setenv(LAUNCH_ENV, encode_for_workers(config_from_dict({"collective_timeout": 42}, "test")))
    assert _collective_timeout(None) == timedelta(seconds=42)  # what PartialState gives init_process_group
    handler = InitProcessGroupKwargs(timeout=timedelta(seconds=5))
    assert _collective_timeout(handler.to_kwargs()["timeout"]) == timedelta(seconds=5)
    assert InitProcessGroupKwargs(timeout=7).timeout == timedelta(seconds=7)  # seconds are taken too
    assert "timeout" not in InitProcessGroupKwargs().to_kwargs()  # None: the config decides


@pytest.mark.parametrize("value", [-1, 0, "soon", True, timedelta(seconds=-3), float("inf")])
def test_bad_code_timeouts_are_one_line_value_errors(value):
    with pytest.raises(ValueError) as err:
        InitProcessGroupKwargs(timeout=value)
    message = str(err.value)
    assert "\n" not in message and "InitProcessGroupKwargs: argument 'timeout': bad value" in message
    assert "allowed: a datetime.timedelta or a number of seconds > 0" in message


def one_line_error(result, *needles: str) -> str:
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith("accel launch: error: ") and all(n in lines[0] for n in needles), (needles, lines[0])
    return lines[0]


SECONDS = "allowed: a finite number of seconds from 1 to 31536000"


@pytest.mark.parametrize("value,needles", [
    ("-5", ("accel launch flags", "key 'collective_timeout': bad value -5;", SECONDS)),
    ("0.5", ("key 'collective_timeout': bad value 0.5;", SECONDS)),
    ("nan", ("key 'collective_timeout': bad value nan;", SECONDS)),
    ("inf", ("key 'collective_timeout': bad value inf;", SECONDS)),
    ("1e308", ("key 'collective_timeout': bad value 1e+308;", SECONDS)),  # timedelta would overflow
    ("99999999999", ("key 'collective_timeout': bad value 99999999999;", SECONDS)),
    ("soon", ("--collective_timeout", "bad value 'soon'", SECONDS)),
])
def test_bad_flag_values_are_one_line_errors(run_accel, tmp_path, value, needles):
    script = tmp_path / "s.py"
    script.write_text("")
    one_line_error(run_accel("launch", "--cpu", "--num_processes", "2", "--collective_timeout", value, script),
                   *needles)


def test_a_bad_config_file_value_names_the_file(run_accel, tmp_path):
    script, cfg_file = tmp_path / "s.py", tmp_path / "c.yaml"
    script.write_text("")
    cfg_file.write_text("collective_timeout: soon\n")
    one_line_error(run_accel("launch", "--config_file", cfg_file, script),
                   str(cfg_file), "key 'collective_timeout': bad value 'soon'", SECONDS)


# ----------------------------------------------------------------------------------------------------------
# the worker's record
# ----------------------------------------------------------------------------------------------------------

def raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:
        return caught


def test_a_gloo_timeout_is_recorded_with_the_op_the_flight_recorder_saw():
    failure = diag.collective_failure(raised(RuntimeError(GLOO_TIMEOUT)), [{"profiling_name": "gloo:all_reduce"}])
    assert failure["kind"] == "timeout" and failure["op"] == "all_reduce" and failure["in_backward"] is False
    assert failure["frames"][-1][2] == "raised"  # the traceback's frames, outermost first


def test_a_chained_collective_error_counts_and_other_timeouts_do_not():
    try:
        try:
            raise RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234")
        except RuntimeError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        failure = diag.collective_failure(outer)
    assert failure["kind"] == "error" and failure["op"] == "a collective"  # a dead peer, not a hang
    assert diag.collective_failure(raised(RuntimeError("DataLoader timed out after 5 seconds"))) is None
    assert diag.collective_failure(raised(KeyboardInterrupt())) is None


def test_the_called_function_names_the_op_over_the_flight_recorder():
    frames = [diag.Frame("/x/train.py", 3, "main"), diag.Frame("/t/torch/distributed/c10d_logger.py", 83, "wrapper"),
              diag.Frame("/t/torch/distributed/distributed_c10d.py", 5000, "broadcast_object_list"),
              diag.Frame("/t/torch/distributed/distributed_c10d.py", 4000, "broadcast")]
    assert diag.collective_name(frames, {"profiling_name": "gloo:broadcast"}) == "broadcast_object_list"


def test_pending_collective_follows_nccl_completion_and_gloo_order():
    nccl = [{"profiling_name": "nccl:all_reduce", "state": "completed"},
            {"profiling_name": "nccl:all_gather", "state": "started"},
            {"profiling_name": "nccl:all_reduce", "state": "scheduled"}]
    assert diag.pending_collective(nccl)["profiling_name"] == "nccl:all_gather"
    assert diag.pending_collective(nccl[:1]) is None
    gloo = [{"profiling_name": "gloo:broadcast", "state": "scheduled"},
            {"profiling_name": "gloo:all_reduce", "state": "scheduled"}]
    assert diag.pending_collective(gloo)["profiling_name"] == "gloo:all_reduce"
    assert diag.pending_collective([]) is None


def test_a_flight_recorder_dump_may_hold_plain_data_only():
    entries = {"entries": [{"profiling_name": "nccl:all_reduce", "frames": [{"name": "f", "line": 1}]}]}
    assert diag.load_flight_recorder(pickle.dumps(entries)) == entries
    with pytest.raises(pickle.UnpicklingError):
        diag.load_flight_recorder(pickle.dumps(SimpleNamespace(a=1)))


FAULTHANDLER_DUMP = """\
Thread 0x00007f03b0fdb6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 982 in run
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f03b1c26b80 (most recent call first):
  File "/job/train.py", line 5 in inner
  File "/job/train.py", line 8 in <module>
"""


def test_the_main_threads_stack_is_read_from_a_faulthandler_dump():
    assert diag.main_thread_stack(FAULTHANDLER_DUMP) == [diag.Frame("/job/train.py", 8, "<module>"),
                                                          diag.Frame("/job/train.py", 5, "inner")]
    assert diag.main_thread_stack("") == []
    assert not diag.in_collective(diag.main_thread_stack(FAULTHANDLER_DUMP))


# ----------------------------------------------------------------------------------------------------------
# the launcher's report, on a run folder written by hand
# ----------------------------------------------------------------------------------------------------------

def failure(local_rank: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(local_rank=local_rank, pid=1000 + local_rank, exitcode=exitcode)


def write_record(folder: Path, rank: int, op: str, kind: str = "timeout") -> None:
    record = {"kind": kind, "op": op, "in_backward": op == "all_reduce", "message": GLOO_TIMEOUT, "timeout_s": 9.0,
              "frames": [["/job/train.py", 12, "<module>"]]}
    diag.record_path(folder, rank).write_text(json.dumps(record))


@pytest.fixture
def watch(tmp_path, monkeypatch):
    monkeypatch.setattr(hang_report.tempfile, "mkdtemp", lambda prefix: str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    watch = hang_report.HangWatch(600)
    watch.folder = diag.attempt_folder(watch.run_dir, 0)
    watch.folder.mkdir()
    return watch


def test_four_ranks_one_stuck_one_still_waiting(watch):
    write_record(watch.folder, 0, "all_reduce")
    write_record(watch.folder, 1, "all_reduce")
    for rank, where in ((2, '  File "/job/train.py", line 30 in load_batch\n'),
                        (3, '  File "/sp/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n')):
        diag.stack_path(watch.folder, rank).write_text(f"Current thread 0x1 (most recent call first):\n{where}"
                                                       '  File "/job/train.py", line 12 in <module>\n')
    watch.stopped = {2: 0, 3: 0}
    report = watch.report({0: failure(0, 1), 1: failure(1, 1), 2: failure(2, -15), 3: failure(3, -15)})
    assert report.first_rank == 2
    assert report.lines[0] == ("accel launch: hang: rank 2 never reached the collective that ranks 0, 1, 3 waited in "
                               "(all_reduce, all_reduce in backward) for collective_timeout=9s; the job was stopped")
    assert report.lines[1].startswith("accel launch: rank 2 (local rank 2, pid 1002) is stuck outside the collective "
                                      "(ended by signal 15 (SIGTERM), first failure)")
    assert any("rank 3 (local rank 3, pid 1003) waited in all_reduce and was still waiting" in line
               for line in report.lines)


def test_a_peer_that_died_is_no_hang(watch):
    write_record(watch.folder, 0, "all_reduce", kind="error")  # connection closed: rank 1 crashed
    assert watch.report({0: failure(0, 1), 1: failure(1, 3)}) is None


def test_different_collectives_and_a_rank_without_a_stack_file(watch):
    write_record(watch.folder, 0, "all_gather")
    write_record(watch.folder, 1, "barrier")
    watch.stopped = {2: None}  # it never created PartialState: not signalled
    report = watch.report({0: failure(0, 1), 1: failure(1, 1), 2: failure(2, -15)})
    assert report.first_rank == 2
    assert "no stack: it had not reached accel's PartialState" in report.lines[1]
    del watch.stopped[2]
    lines = watch.report({0: failure(0, 1), 1: failure(1, 1)}).lines
    assert lines[0].startswith("accel launch: hang: the ranks waited in different collectives (rank 0: all_gather; "
                               "rank 1: barrier)")


def test_stacks_show_the_scripts_frames_and_the_innermost_library_frame():
    import torch

    frames = [diag.Frame("<frozen runpy>", 88, "_run_code"), diag.Frame(__file__, 1, "<module>"),
              diag.Frame(torch.__file__, 5, "a"), diag.Frame(diag.__file__, 7, "b")]
    lines = hang_report.stack_lines(frames)
    assert lines[0].endswith("line 1, in <module>") and '"""collective_timeout' in lines[1]
    assert lines[2].endswith("line 7, in b  (+1 library frame)") and len(lines) == 4
