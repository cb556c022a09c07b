"""Four parallel dimensions in one job of 8 CPU processes: pipeline stages (pp 2) x tensor parallelism (tp 2) x data
parallelism (dp 2, FSDP2 as TP's data parallelism) with expert parallelism (ep 2) taken from the dp ranks, on a tiny
transformers Mixtral (scripts/moe_train.py, an unchanged Accelerate-style loop), against plain PyTorch on one process
(fp32): per-step losses within atol 1e-5, clipped gradient norms within 1e-5 relative, final weights within atol 5e-4
(AdamW turns rounding in near-zero gradients into lr-sized steps); and save_state after step 2 resumed in a second
job of the same launch gives the uninterrupted run's last two losses and its final weights bit for bit.
Measured (2 cores): losses within 3e-7, weights within 2.8e-5, the launch 40 s."""

from __future__ import annotations

import json

import pytest
import torch
from _launch import launch_jobs, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ARGS = ["--ep_size", 2, "--pp_size", 2, "--tp_size", 2, "--model", "mixtral-plain", "--save_at", 2]
PROCESSES = 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("four_dimensions")
    launch_jobs(out, make_isolated_env(out), PROCESSES, worker_module("moe_train").__file__,
                [("pp2-tp2-dp2-ep2", ARGS), ("pp2-tp2-dp2-ep2", [*ARGS, "--resume"])])
    return out / "pp2-tp2-dp2-ep2"


def test_losses_and_weights_match_one_process(run):
    from test_expert import data_parallel, reference

    dp = data_parallel(ARGS, PROCESSES)
    assert dp == 2
    model, losses, norms, _ = reference(ARGS, dp)
    result = json.loads((run / "result.json").read_text())
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(norms), atol=0, rtol=1e-5)
    weights = load_file(str(run / "result.safetensors"))
    expected = model.state_dict()
    assert weights.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, atol=5e-4, rtol=0, msg=key)


def test_resume_is_bit_exact(run):
    from test_expert import assert_resumed_bit_exact

    assert_resumed_bit_exact(run)
