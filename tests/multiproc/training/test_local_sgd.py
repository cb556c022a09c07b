"""Accelerate's LocalSGD (`from accelerate.local_sgd import LocalSGD`) on plain DDP, through the shim, against a
reference that runs the same two ranks' local steps and parameter averagings in one process, and (where Hugging
Face Accelerate is installed) against the same script run on Accelerate itself.

One launch of 2 processes runs three jobs: LocalSGD every 3 steps, the same with gradient accumulation 2 (the
averaging then falls inside and outside accumulation windows), and `enabled=False` (plain DDP). The reference:
rank r trains on batches r, r+2, ... (Accelerate's batch sharding without shuffling); with LocalSGD each rank's
gradients stay its own and every parameter becomes the mean of the two ranks' after every 3rd `step()` and when
the block ends; without it the gradients are averaged at every synchronising step."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import types

import _launch
import pytest
import torch
from safetensors.torch import load_file

from accel.runtime.state import DistributedType

BATCH, K = 4, 3
JOBS = {"every3": ["--local-sgd-steps", K], "every3_accum2": ["--local-sgd-steps", K, "--accum", 2],
        "disabled": ["--local-sgd-steps", K, "--disabled"]}


def reference(accum: int, enabled: bool) -> tuple[list[dict], list[list[list[int]]]]:
    index, x, y, model = _launch.worker_module("local_sgd_train").make_problem()
    models = [model, copy.deepcopy(model)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in models]
    micro_steps = len(x) // BATCH // 2
    seen: list[list[list[int]]] = [[], []]
    for step in range(1, micro_steps + 1):
        for rank, m in enumerate(models):
            batch = slice((2 * (step - 1) + rank) * BATCH, (2 * (step - 1) + rank + 1) * BATCH)
            seen[rank].append(index[batch].tolist())
            (torch.nn.functional.mse_loss(m(x[batch]), y[batch]) / accum).backward()
        if step % accum == 0:
            if not enabled:  # DDP: the accumulated gradients averaged at the synchronising backward
                for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
                    p0.grad = p1.grad = (p0.grad + p1.grad) / 2
            for opt in optimizers:
                opt.step()
                opt.zero_grad()
        if enabled and step % K == 0:
            _average(models)
    if enabled:
        _average(models)  # leaving the block
    return [{k: v.detach() for k, v in m.state_dict().items()} for m in models], seen


def _average(models) -> None:
    with torch.no_grad():
        for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
            mean = (p0 + p1) / 2
            p0.copy_(mean)
            p1.copy_(mean)


@pytest.mark.multiproc
def test_local_sgd_through_the_shim_matches_the_reference(tmp_path, isolated_env):
    argv = []
    for name, args in JOBS.items():
        (tmp_path / name).mkdir()
        argv.append(["--out", str(tmp_path / name), *map(str, args)])
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps(argv))
    _launch.accel_launch(isolated_env, "--cpu", "--num_processes", 2, "--accelerate_shim",
                         _launch.SCRIPTS / "local_sgd_train.py", "--jobs", jobs)
    for name, args in JOBS.items():
        accum = int(args[args.index("--accum") + 1]) if "--accum" in args else 1
        enabled = "--disabled" not in args
        expected, seen = reference(accum, enabled)
        for rank in (0, 1):
            record = json.loads((tmp_path / name / f"rank{rank}.json").read_text())
            assert record["seen"] == seen[rank], (name, rank)
            assert record["enabled"] is enabled and record["num_steps"] == len(seen[rank])
            got = load_file(str(tmp_path / name / f"rank{rank}.safetensors"))
            for key, value in expected[rank].items():
                torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=f"{name} rank {rank} {key}")
        final = [load_file(str(tmp_path / name / f"rank{r}.safetensors")) for r in (0, 1)]
        assert all(torch.equal(final[0][k], final[1][k]) for k in final[0]), name  # the block ends in agreement
    # the same script on Hugging Face Accelerate itself (torchrun, where it is installed): the same weights, bit for bit
    from accel.shim import real_accelerate_dir

    if real_accelerate_dir() is not None:
        real = tmp_path / "accelerate"
        real.mkdir()
        env = {**isolated_env, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
        env.pop("ACCEL_CHECK_COLLECTIVE_DEVICES")
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(_launch.SCRIPTS / "local_sgd_train.py"), "--out", str(real),
                        *map(str, JOBS["every3_accum2"])],
                       env=env, check=True, capture_output=True, timeout=240)
        for rank in (0, 1):
            theirs = load_file(str(real / f"rank{rank}.safetensors"))
            ours = load_file(str(tmp_path / "every3_accum2" / f"rank{rank}.safetensors"))
            assert all(torch.equal(theirs[k], ours[k]) for k in ours), rank
    # the reference itself tells the cases apart: local steps are not DDP's steps
    local, ddp = reference(1, True)[0][0], reference(1, False)[0][0]
    assert not all(torch.allclose(local[k], ddp[k], atol=1e-4) for k in local)


def _fake(kind, processes: int = 2, replicated: bool = True):
    return types.SimpleNamespace(distributed_type=kind, num_processes=processes,
                                 backend=types.SimpleNamespace(replicated_state=replicated))


def test_local_sgd_on_one_process_only_counts():
    from accel.local_sgd import LocalSGD

    local_sgd = LocalSGD(_fake(DistributedType.NO, 1), torch.nn.Linear(2, 2), local_sgd_steps=2)
    with local_sgd:  # nothing to average, no no_sync asked for
        for _ in range(5):
            local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 5


@pytest.mark.parametrize("kind,replicated", [(DistributedType.FSDP, True), (DistributedType.DEEPSPEED, True),
                                             (DistributedType.MULTI_CPU, False)])
def test_local_sgd_refuses_sharded_parameters(kind, replicated):
    from accel.local_sgd import LocalSGD

    with pytest.raises(NotImplementedError, match="LocalSGD is supported only for CPUs and GPUs"):
        LocalSGD(_fake(kind, replicated=replicated), torch.nn.Linear(2, 2), local_sgd_steps=2)


def test_local_sgd_under_fault_tolerance():
    """Per-step fault tolerance all-reduces over the groups at every step: LocalSGD is refused, naming the config's
    semi_sync_method; with it (torchft synchronises the groups), the block only counts."""
    from accel.local_sgd import LocalSGD

    per_step = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=2,
                                     backend=types.SimpleNamespace(replicated_state=True, semi_synchronous=False))
    with pytest.raises(NotImplementedError, match="set fault_tolerance.semi_sync_method: local_sgd or diloco"):
        LocalSGD(per_step, torch.nn.Linear(2, 2), local_sgd_steps=2)
    per_step.backend.semi_synchronous = True
    local_sgd = LocalSGD(per_step, torch.nn.Linear(2, 2), local_sgd_steps=2)
    with local_sgd:
        local_sgd.step()
    assert not local_sgd.enabled and local_sgd.num_steps == 1
