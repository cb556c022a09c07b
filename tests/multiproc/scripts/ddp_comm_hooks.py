"""Worker for tests/multiproc/training/test_ddp_comm_hooks.py: every DDP communication hook on CPU processes (gloo).

For each variant (comm_hook, comm_wrapper, comm_state_option), in one launch: train a small MLP through accel with
`DistributedDataParallelKwargs(comm_hook=..., ...)`, then train the same model on the same per-rank batches with
plain `torch.nn.parallel.DistributedDataParallel` and the same torch hook registered by hand. The main process
writes record.json: per variant, the largest weight difference to the hand-registered run and to the no-hook run,
the hook name DDP logged for each, and whether the ranks ended equal.

Two hooks need a hand-made registration on gloo, done here exactly as accel documents it (accel/backends/ddp.py):
torch's DDP refuses to register bf16 hooks without CUDA+NCCL (gloo reduces bfloat16 correctly), and torch's
`batched_powerSGD_hook` fails at its first compressed step (its `_orthogonalize` refuses the hook's 2-D matrix).
"""

import argparse
import json
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from accel import Accelerator, DDPCommunicationHookType, DistributedDataParallelKwargs, PartialState

STEPS = 5
POWER_SGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}  # compressed from the third step on
VARIANTS = [
    ("no", "no", {}),
    ("fp16", "no", {}),
    ("bf16", "no", {}),
    ("power_sgd", "no", POWER_SGD),
    ("power_sgd", "no", {**POWER_SGD, "matrix_approximation_rank": 3}),  # QR instead of Gram-Schmidt
    ("power_sgd", "fp16", POWER_SGD),
    ("power_sgd", "bf16", POWER_SGD),
    ("batched_power_sgd", "no", POWER_SGD),
    ("batched_power_sgd", "fp16", POWER_SGD),
]


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def batches(rank: int) -> list:
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, so the reduction matters
    return [(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(STEPS)]


def torch_batched_power_sgd():
    """torch's batched_powerSGD_hook, with an `_orthogonalize` that takes its 2-D matrix as a batch of one."""
    hook, batched = powerSGD_hook.batched_powerSGD_hook, powerSGD_hook._orthogonalize

    def orthogonalize(matrices, epsilon=0):
        return batched(matrices[None] if matrices.dim() == 2 else matrices, epsilon)

    scope = {**vars(powerSGD_hook), "_orthogonalize": orthogonalize}
    fixed = types.FunctionType(hook.__code__, scope, hook.__name__, hook.__defaults__, hook.__closure__)
    fixed.__qualname__ = hook.__qualname__
    return fixed


def torch_batched_fails() -> bool:
    """Whether torch's own batched hook refuses the 2-D matrix it hands to `_orthogonalize` (no communication)."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except Exception:  # noqa: BLE001 - AssertionError in torch 2.13
        return True
    return False


def by_hand(hook: str, wrapper: str, options: dict):
    """(state, hook) for plain DDP's register_comm_hook, from torch's modules (None: no hook)."""
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "power_sgd": powerSGD_hook.powerSGD_hook,
             "batched_power_sgd": torch_batched_power_sgd() if torch_batched_fails()
             else powerSGD_hook.batched_powerSGD_hook}
    if hook == "no":
        return None
    fn = hooks[hook]
    state = powerSGD_hook.PowerSGDState(process_group=None, **options) if "power_sgd" in hook else None
    if wrapper != "no":
        fn = {"fp16": default_hooks.fp16_compress_wrapper, "bf16": default_hooks.bf16_compress_wrapper}[wrapper](fn)
    if "bf16" in (hook, wrapper):  # DDP checks the name for NCCL; gloo all-reduces bfloat16 correctly
        inner = fn

        def renamed(state, bucket):
            return inner(state, bucket)

        renamed.__qualname__ = inner.__qualname__
        fn = renamed
    return state, fn


def train(model, step_fn, data) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for inputs, targets in data:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        step_fn(loss)
        optimizer.step()
        optimizer.zero_grad()


def run_accel(hook: str, wrapper: str, options: dict, data):
    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType(hook),
                                            comm_wrapper=DDPCommunicationHookType(wrapper),
                                            comm_state_option=dict(options))
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    model = accelerator.prepare(make_model())
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.5))
    for inputs, targets in data:
        accelerator.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        optimizer.zero_grad()
    logged = model._get_ddp_logging_data().get("comm_hook")
    weights = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}
    accelerator.free_memory()
    return weights, logged


def run_torch(hook: str, wrapper: str, options: dict, data):
    model = torch.nn.parallel.DistributedDataParallel(make_model())
    registered = by_hand(hook, wrapper, options)
    if registered is not None:
        model.register_comm_hook(*registered)
    train(model, lambda loss: loss.backward(), data)
    logged = model._get_ddp_logging_data().get("comm_hook")
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}, logged


def max_diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def ranks_equal(weights: dict) -> bool:
    flat = torch.cat([v.flatten() for v in weights.values()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    state = PartialState(cpu=True)  # the gloo group, before the first Accelerator
    records, baseline = [], None
    for hook, wrapper, options in VARIANTS:
        data = batches(state.process_index)
        mine, mine_logged = run_accel(hook, wrapper, options, data)
        theirs, theirs_logged = run_torch(hook, wrapper, options, data)
        if baseline is None:
            baseline = theirs
        records.append({"hook": hook, "wrapper": wrapper, "options": options,
                        "vs_torch": max_diff(mine, theirs), "vs_no_hook": max_diff(mine, baseline),
                        "accel_logged": mine_logged, "torch_logged": theirs_logged,
                        "ranks_equal": ranks_equal(mine)})

    if state.is_main_process:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        summary = {"world_size": dist.get_world_size(), "backend": dist.get_backend(),
                   "torch_batched_fails": torch_batched_fails(), "variants": records}
        (out / "record.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
