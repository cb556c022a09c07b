"""The throughput monitor on 2 CPU processes of data parallelism, turned on by `accel launch --throughput_monitor`:
each rank counts its own batches and reports the job's rates (its count x the data-parallel degree), per device
half of that, and MFU from the given FLOPs per token and peak."""

import json

import pytest
from _launch import SCRIPTS, accel_launch

pytestmark = pytest.mark.multiproc


def test_each_rank_reports_the_jobs_rates(tmp_path):
    from conftest import make_isolated_env

    accel_launch(make_isolated_env(tmp_path), "--cpu", "--num_processes", 2, "--throughput_monitor",
                 "--throughput_log_every", 2, SCRIPTS / "throughput_worker.py", tmp_path, timeout=240)
    for rank in range(2):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        metrics = found["metrics"]
        assert (found["steps"], found["log_every"], found["data_parallel_size"], found["num_processes"]) == (5, 2, 2, 2)
        # the last window: steps 4-5, one batch of 2 x 8 tokens per step on this rank, 2 data-parallel ranks
        assert metrics["throughput/tokens_per_sec"] == pytest.approx(2 * 2 * 8 * 2 / (2 * metrics[
            "throughput/step_time_s"]))
        per_device = metrics["throughput/tokens_per_sec_per_device"]
        assert per_device == pytest.approx(metrics["throughput/tokens_per_sec"] / 2)
        achieved = 1e6 * per_device
        assert metrics["throughput/tflops_per_device"] == pytest.approx(achieved / 1e12)
        assert metrics["throughput/mfu_percent"] == pytest.approx(100 * achieved / 1e12)
