"""accel.logging.get_logger (Accelerate's semantics) and progress bars: Accelerate's `tqdm` and the bars of accel's
own long operations (drawn on the main process, on a terminal only, with a built-in line when tqdm is absent)."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from accel.logging import get_logger
from accel.state import PartialState
from accel.utils.progress import progress, stages, tqdm

OFF_SWITCHES = ("ACCEL_DISABLE_PROGRESS", "HF_HUB_DISABLE_PROGRESS_BARS", "TQDM_DISABLE")


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    """No state before (get_logger must refuse), none left after; no off switch or rank from the caller."""
    for name in OFF_SWITCHES + ("ACCELERATE_LOG_LEVEL", "ACCEL_LOG_LEVEL", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    PartialState._reset_for_tests()
    yield
    PartialState._reset_for_tests()


@pytest.fixture
def tty(capsys, monkeypatch):
    """stderr claims to be a terminal. capsys swaps sys.stderr only when the test starts, so its stream class
    (pytest's CaptureIO) is patched."""
    from _pytest.capture import CaptureIO

    monkeypatch.setattr(CaptureIO, "isatty", lambda self: True)


def fake_rank(rank: int) -> PartialState:
    state = PartialState(cpu=True)
    state.process_index = state.local_process_index = rank
    return state


# -- get_logger -----------------------------------------------------------------------------------------------------


def test_logger_refuses_without_state_like_accelerate():
    with pytest.raises(RuntimeError, match=r"initialize the accelerate state by calling either `PartialState\(\)`"):
        get_logger("accel.test.nostate").info("x")


def test_logger_levels_and_env_var(monkeypatch):
    root_level = logging.getLogger().level
    try:
        assert get_logger("accel.test.lvl", log_level="debug").logger.level == logging.DEBUG
        monkeypatch.setenv("ACCELERATE_LOG_LEVEL", "error")
        logger = get_logger("accel.test.env")
        assert logger.logger.level == logging.ERROR and logging.getLogger().level == logging.ERROR
        assert get_logger("accel.test.arg", "warning").logger.level == logging.WARNING  # the argument wins
        monkeypatch.delenv("ACCELERATE_LOG_LEVEL")
        logging.getLogger("accel.test.none").setLevel(logging.CRITICAL)
        assert get_logger("accel.test.none").logger.level == logging.CRITICAL  # no level given: left as it is
    finally:
        logging.getLogger().setLevel(root_level)


def test_logger_prefixes_rank_reports_caller_and_warns_once(caplog):
    PartialState(cpu=True)
    logger = get_logger("accel.test.once", "INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.once"):
        logger.info("hello %s", "there")
        logger.debug("hidden")
        for _ in range(3):
            logger.warning_once("careful")
        logger.warning_once("other")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["[RANK 0] hello there", "[RANK 0] careful", "[RANK 0] other"]
    assert caplog.records[0].filename == "test_logging_progress.py"  # stacklevel: the caller, not accel/logging.py


def test_logger_main_process_only_and_in_order_on_a_non_main_rank(caplog, monkeypatch):
    state = fake_rank(1)
    state.num_processes = 2
    barriers = []
    monkeypatch.setattr(PartialState, "wait_for_everyone", lambda self: barriers.append(1))
    logger = get_logger("accel.test.rank", "INFO")
    with caplog.at_level(logging.INFO, logger="accel.test.rank"):
        logger.info("main only")
        logger.info("everyone", main_process_only=False)
        logger.info("in turn", in_order=True)  # in_order overrides main_process_only, as in Accelerate
    assert [r.getMessage() for r in caplog.records] == ["[RANK 1] everyone", "[RANK 1] in turn"]
    assert len(barriers) == 2  # one barrier per rank's turn


# -- accel.utils.tqdm -----------------------------------------------------------------------------------------------


def test_tqdm_main_process_only(capsys):
    PartialState(cpu=True)
    list(tqdm(range(3), desc="shown"))
    assert "shown" in capsys.readouterr().err
    fake_rank(1)
    list(tqdm(range(3), desc="hidden"))
    list(tqdm(range(3), desc="everywhere", main_process_only=False))
    err = capsys.readouterr().err
    assert "hidden" not in err and "everywhere" in err
    with pytest.raises(ValueError, match="main_process_only"):
        tqdm(True, range(3))


# -- accel's own bars -----------------------------------------------------------------------------------------------


def test_progress_draws_on_a_terminal_only(capsys, monkeypatch):
    assert list(progress(range(4), desc="quiet")) == [0, 1, 2, 3]
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert list(progress(range(4), desc="loud")) == [0, 1, 2, 3]
    err = capsys.readouterr().err
    assert "loud" in err and "4/4" in err


@pytest.mark.parametrize("switch", OFF_SWITCHES)
def test_progress_off_switches(tty, capsys, monkeypatch, switch):
    monkeypatch.setenv(switch, "1")
    list(progress(range(3), desc="off"))
    assert capsys.readouterr().err == ""


def test_progress_silent_on_a_non_main_rank(tty, capsys, monkeypatch):
    fake_rank(1)
    list(progress(range(3), desc="rank1"))
    assert capsys.readouterr().err == ""
    PartialState._reset_for_tests()
    monkeypatch.setenv("RANK", "1")  # no state: the launcher's RANK decides, and no state is created
    list(progress(range(3), desc="rank1"))
    assert capsys.readouterr().err == "" and not PartialState._shared_state.get("_initialized")


def test_fallback_line_without_tqdm(tty, capsys, monkeypatch):
    for name in ("tqdm", "tqdm.auto"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them now raises ImportError
    list(progress(range(3), desc="plain"))
    err = capsys.readouterr().err
    assert err.startswith("\rplain: 0/3 [") and "\rplain: 3/3 [####################]" in err
    assert err.endswith("\n") and err.count("\n") == 1  # one line, rewritten in place
    with stages("save_state", 2) as begin:
        begin("first")
        begin("second")
    err = capsys.readouterr().err
    assert "0/2" in err and "first" in err and "1/2" in err and "second" in err and "2/2" in err and "done" in err
    with pytest.raises(ImportError, match="pip install tqdm"):
        tqdm(range(2))


def test_stages_bar_closes_on_error(tty, capsys):
    with pytest.raises(KeyError), stages("load_state", 3) as begin:
        begin("checking files")
        raise KeyError("boom")
    err = capsys.readouterr().err
    assert "checking files" in err and err.endswith("\n") and "done" not in err


# -- in accel's operations ------------------------------------------------------------------------------------------


def sharded_model(tmp_path):
    from accel.checkpoint.model_io import save_state_dict_sharded

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    files = save_state_dict_sharded(model.state_dict(), tmp_path / "ckpt", max_shard_size=16 * 16 * 4 + 64)
    return model, files


def test_sharded_save_and_dispatch_show_bars_on_a_terminal(tmp_path, tty, capsys):
    from accel.big_modeling import init_empty_weights, load_checkpoint_and_dispatch

    model, files = sharded_model(tmp_path)
    assert len(files) == 5  # four shards and the index
    err = capsys.readouterr().err
    assert "Saving checkpoint shards" in err and "4/4" in err
    with init_empty_weights():
        empty = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    loaded = load_checkpoint_and_dispatch(empty, tmp_path / "ckpt", device_map={"": "cpu"})
    err = capsys.readouterr().err
    assert "Loading checkpoint shards" in err and "4/4" in err
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


def test_sharded_load_is_silent_off_a_terminal(tmp_path, capsys):
    from accel.checkpoint.model_io import load_checkpoint_in_model

    model, _ = sharded_model(tmp_path)
    load_checkpoint_in_model(torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)]), tmp_path / "ckpt")
    assert capsys.readouterr().err == ""


def test_save_and_load_state_name_their_steps(tmp_path, tty, capsys, monkeypatch):
    from accel import Accelerator

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(3, 2))
    accelerator.save_state(tmp_path / "state")
    err = capsys.readouterr().err
    assert "save_state" in err and "writing tensors" in err and "3/3" in err
    accelerator.load_state(tmp_path / "state")
    err = capsys.readouterr().err
    assert "load_state" in err and "reading tensors" in err and "3/3" in err
    assert model is not None
