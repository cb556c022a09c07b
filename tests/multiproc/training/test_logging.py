"""get_logger and Accelerate's tqdm on 2 CPU processes, one launch: a log line once per job by default, once per
rank with main_process_only=False, in rank order with in_order=True; tqdm draws on rank 0 only by default."""

import re

import pytest
from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def stderr(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("logging")
    return accel_launch(make_isolated_env(out), "--cpu", "--num_processes", 2, SCRIPTS / "logging_worker.py",
                        timeout=120).stderr


def test_logger_once_per_job_by_default(stderr):
    assert re.findall(r"\[RANK \d\] default from rank \d", stderr) == ["[RANK 0] default from rank 0"]
    assert sorted(re.findall(r"\[RANK \d\] everyone from rank \d", stderr)) == [
        "[RANK 0] everyone from rank 0", "[RANK 1] everyone from rank 1"]


def test_logger_in_order_prints_every_rank_in_rank_order(stderr):
    # rank 0 reached the call half a second after rank 1, yet prints first, in each turn
    assert re.findall(r"turn \d from rank \d", stderr) == [
        "turn 0 from rank 0", "turn 0 from rank 1", "turn 1 from rank 0", "turn 1 from rank 1"]


def test_tqdm_draws_on_rank_0_only(stderr):
    assert "main bar of rank 0" in stderr and "main bar of rank 1" not in stderr
    assert "every bar of rank 0" in stderr and "every bar of rank 1" in stderr
