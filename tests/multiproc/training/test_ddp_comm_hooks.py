"""DDP communication hooks (`DistributedDataParallelKwargs(comm_hook=, comm_wrapper=, comm_state_option=)`) on 2 CPU
processes (gloo), against plain `torch.nn.parallel.DistributedDataParallel` with the same torch hook registered by
hand. Accelerate's own test of them needs GPUs.

One launch runs every variant (scripts/ddp_comm_hooks.py). Tolerance: the weights after 5 SGD steps equal the
hand-registered run's within 1e-6 (they are bit-identical today: same hook, same state, same order). That the hook
really ran is checked twice: DDP logs the registered hook's name, and the weights differ from the no-hook run by
more than 1e-5 (fp16/bf16 rounding of the reduced gradients; PowerSGD's rank-1/rank-3 approximation).
"""

import json
from pathlib import Path

import pytest
from _launch import accel_launch

pytestmark = pytest.mark.multiproc

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ddp_comm_hooks.py"
ATOL = 1e-6
HOOK_EFFECT = 1e-5

# hook -> the name DDP logs (its __qualname__); a wrapper logs the wrapper's name
LOGGED = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook", "power_sgd": "powerSGD_hook",
          "batched_power_sgd": "batched_powerSGD_hook"}


def test_every_comm_hook_matches_torch_ddp_with_the_hook_registered_by_hand(isolated_env, tmp_path):
    accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT, "--out", tmp_path, timeout=240)
    record = json.loads((tmp_path / "record.json").read_text())
    assert (record["world_size"], record["backend"]) == (2, "gloo")
    variants = {(v["hook"], v["wrapper"], v["options"].get("matrix_approximation_rank")): v for v in record["variants"]}
    assert len(variants) == 9, variants.keys()
    for (hook, wrapper, _), v in variants.items():
        name = f"{hook}/{wrapper}/{v['options']}"
        assert v["ranks_equal"], f"{name}: the ranks' weights differ"
        assert v["vs_torch"] <= ATOL, f"{name}: accel vs torch DDP with the hook by hand: {v['vs_torch']}"
        expected = None if hook == "no" else LOGGED[hook] if wrapper == "no" else \
            f"{wrapper}_compress_wrapper.<locals>.{wrapper}_compress_wrapper_hook"
        assert v["accel_logged"] == v["torch_logged"] == expected, f"{name}: {v['accel_logged']}"
        if hook != "no":
            assert v["vs_no_hook"] > HOOK_EFFECT, f"{name}: no effect of the hook ({v['vs_no_hook']})"
