"""Ray Train on a real local Ray cluster (2 CPU workers): the README's TorchTrainer example
(examples/clusters/ray_train.py) gives the same losses as `accel launch --num_processes 2` of the same loop.

The Ray run takes its settings from the constructor only (`Accelerator(mixed_precision="bf16",
parallelism_config=ParallelismConfig(zero_stage=2))`), the launched one from `accel launch --mixed_precision bf16
--zero_stage 2` with the loop's arguments left out: what `accel launch` would pass is reachable from the constructor.
Losses equal exactly (the same gloo reductions in the same order). One fit: a Ray Train fit costs about 20 s here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _launch import ROOT, accel_launch

pytestmark = pytest.mark.multiproc
ray = pytest.importorskip("ray", reason="ray (a test extra) is not installed")

EXAMPLE = ROOT / "examples" / "clusters" / "ray_train.py"

DRIVER = """import json
import ray
from ray.train import RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray_train import train_loop


def loop(config):  # the example's loop, then what this worker's preemption_requested asked Ray (pickled by value)
    import os
    from accel.runtime import preemption

    train_loop(config)
    with open(config["losses"] + ".rank" + os.environ["RANK"], "w") as f:
        f.write(repr(preemption._local["ray"]))

ray.init(num_cpus=2, include_dashboard=False)
try:
    for name, config in json.loads({configs!r}).items():
        trainer = TorchTrainer(loop, train_loop_config=config,
                               scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                               run_config=RunConfig(name=name, storage_path={storage!r}))
        trainer.fit()
finally:
    ray.shutdown()
"""


def test_ray_train_equals_accel_launch(tmp_path, isolated_env):
    # the workers import train_loop by its module's name, as they would a user's module (PYTHONPATH, or Ray's
    # runtime_env working_dir on a real cluster)
    path = [str(EXAMPLE.parent), *filter(None, [isolated_env.get("PYTHONPATH")])]
    env = dict(isolated_env, PYTHONPATH=":".join(path), RAY_DEDUP_LOGS="0", RAY_USAGE_STATS_ENABLED="0",
               RAY_AUTH_MODE="disabled")
    configs = {"zero2_bf16": {"losses": str(tmp_path / "ray.json"), "zero_stage": 2, "mixed_precision": "bf16"}}
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(configs=json.dumps(configs),
                                    storage=str(tmp_path / "ray_results")))
    result = subprocess.run([sys.executable, str(driver)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]

    accel_launch(env, "--cpu", "--num_processes", "2", "--zero_stage", "2", "--mixed_precision", "bf16", str(EXAMPLE),
                 "--losses", str(tmp_path / "launched.json"))
    on_ray = json.loads((tmp_path / "ray.json").read_text())
    launched = json.loads((tmp_path / "launched.json").read_text())
    assert on_ray["num_processes"] == launched["num_processes"] == 2
    # Ray set Accelerate's device variable in each worker, and the Accelerator read it (cpu; under the collective-device
    # check a CPU job's device reads cpu:0 either way)
    assert on_ray["ACCELERATE_TORCH_DEVICE"] == "cpu" and launched["ACCELERATE_TORCH_DEVICE"] is None
    assert on_ray["device"] == launched["device"]
    assert (on_ray["zero_stage"], on_ray["mixed_precision"]) == (launched["zero_stage"], launched["mixed_precision"]) \
        == (2, "bf16")
    assert len(on_ray["losses"]) == 16 and on_ray["losses"] == launched["losses"]
    # every step's preemption_requested asked Ray's get_preemption_info (a barrier of the workers) and got no drain
    assert [(tmp_path / f"ray.json.rank{rank}").read_text() for rank in (0, 1)] == ["True", "True"]
