"""Worker for tests/multiproc/training/test_unprepared_optimizer.py: an optimizer that cannot train the prepared
model, on 2 CPU processes, under `accel launch --zero_stage 3`. Each case builds its own Accelerator (an explicit
ParallelismConfig, which the launch's zero_stage stays under), runs 4 steps, catches what it raises, and writes
OUT/<case>.rank<R>.json: the error (type, message, the call that raised it) or the losses and the final full weights'
largest difference from the same loop with the optimizer prepared. The last case is the issue's own loop with a
plain `Accelerator()` (the launch's ZeRO-3), not caught: the launch must fail with the one line.

Quiet (the numbers are right): DDP and ZeRO-1 with an optimizer never prepared; ZeRO-3 with the optimizer built
before prepare and prepared in a later call, or built after prepare on the prepared model. Refused: ZeRO-2, ZeRO-3,
tensor parallelism (tp 2) and expert parallelism (ep 2, stacked experts) with no optimizer prepared (at the first
backward); ZeRO-3 with a second model's optimizer left unprepared (at its first step).

With --hsdp (a launch on 4 processes): HSDP (dp_replicate 2 x dp_shard 2) with no optimizer prepared (refused) and
with the optimizer prepared in a later call (quiet), and nothing after them."""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
from moe_train import LENGTH, VOCAB, OwnLM, StackedMoE

from accel import Accelerator, ParallelismConfig
from accel.utils import set_seed

STEPS = 4


def make_net() -> torch.nn.Module:
    set_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def regression_loader():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8 * STEPS, 6, generator=g), torch.randn(8 * STEPS, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def token_loader():
    tokens = torch.randint(0, VOCAB, (4 * STEPS, LENGTH), generator=torch.Generator().manual_seed(3))
    return torch.utils.data.DataLoader(tokens, batch_size=2)


def mse(model, batch):
    inputs, targets = batch
    return torch.nn.functional.mse_loss(model(inputs), targets)


def lm(model, tokens):
    return model(tokens, labels=tokens)["loss"]


TP_PLAN = {"0": "colwise", "2": "rowwise"}
LAYOUTS = {  # case -> (ParallelismConfig's arguments, model, loader, loss)
    "ddp": (dict(zero_stage=0), make_net, regression_loader, mse),
    "zero1": (dict(zero_stage=1), make_net, regression_loader, mse),
    "zero2": (dict(zero_stage=2), make_net, regression_loader, mse),
    "zero3": (dict(zero_stage=3), make_net, regression_loader, mse),
    "tp2": (dict(zero_stage=0, tp_size=2, tp_plan=TP_PLAN), make_net, regression_loader, mse),
    "ep2": (dict(zero_stage=0, ep_size=2), lambda: (set_seed(0), OwnLM(StackedMoE))[1], token_loader, lm),
    "hsdp": (dict(dp_replicate_size=2, dp_shard_size=2), make_net, regression_loader, mse),  # 4 processes
}


def train(layout: str, how: str, where: list) -> tuple[Accelerator, list, dict]:
    """4 steps of AdamW under `layout`. how: "prepared" (with the model), "unprepared" (built before prepare, never
    passed), "later" (built before prepare, prepared in a second call), "after" (built on the prepared model,
    prepared). `where` gets the call being made (what raised)."""
    kwargs, make_model, make_loader, loss_of = LAYOUTS[layout]
    accelerator = Accelerator(parallelism_config=ParallelismConfig(**kwargs))
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    where.append("prepare")
    if how == "prepared":
        model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader())
    else:
        model, loader = accelerator.prepare(model, make_loader())
        if how == "after":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if how in ("later", "after"):
            optimizer = accelerator.prepare(optimizer)
    losses = []
    for batch in loader:
        loss = loss_of(model, batch)
        where.append("backward")
        accelerator.backward(loss)
        where.append("step")
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return accelerator, losses, accelerator.get_state_dict(model)


def two_models(where: list) -> tuple[Accelerator, list, dict]:
    """ZeRO-3, two models prepared and the first one's optimizer; the second's optimizer, built before prepare,
    is not passed (a GAN's discriminator, say): refused at its first step."""
    accelerator = Accelerator(parallelism_config=ParallelismConfig(zero_stage=3))
    first, second = make_net(), make_net()
    first_optimizer = torch.optim.AdamW(first.parameters(), lr=1e-2)
    second_optimizer = torch.optim.SGD(second.parameters(), lr=1e-2)
    where.append("prepare")
    first, second, first_optimizer, loader = accelerator.prepare(first, second, first_optimizer, regression_loader())
    for batch in loader:
        loss = mse(first, batch) + mse(second, batch)
        where.append("backward")
        accelerator.backward(loss)
        where.append("step")
        first_optimizer.step()
        where.append("second step")
        second_optimizer.step()
    return accelerator, [], {}


def largest_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), (a.keys(), b.keys())
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def case(out: Path, name: str, run) -> None:
    where: list = []
    record: dict = {"error": None}
    accelerator = None
    try:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            accelerator, losses, weights = run(where)
        record.update(warnings=[str(w.message) for w in said])
        record.update(losses=losses)
        if losses:  # every rank (the full weights are the main process's only)
            accelerator.free_memory()
            accelerator, _, reference = train(name.split("-")[0], "prepared", [])
            if accelerator.is_main_process:
                record.update(difference=largest_difference(weights, reference))
    except Exception as exc:  # noqa: BLE001 (recorded for the test)
        record["error"] = {"type": type(exc).__name__, "message": str(exc), "at": where[-1] if where else None,
                           "traceback": traceback.format_exc()}
    if accelerator is not None:
        accelerator.free_memory()
    (out / f"{name}.rank{os.environ['RANK']}.json").write_text(json.dumps(record))


def main() -> None:
    out = Path(sys.argv[sys.argv.index("--out") + 1])
    if "--hsdp" in sys.argv:  # the launch on 4 processes: HSDP 2 x 2 (ZeRO-3 within each replica), then done
        for name, how in (("hsdp-unprepared", "unprepared"), ("hsdp-later", "later")):
            case(out, name, lambda where, name=name, how=how: train(name.split("-")[0], how, where))
        return
    for name, how in (("ddp-unprepared", "unprepared"), ("zero1-unprepared", "unprepared"),
                      ("zero3-later", "later"), ("zero3-after", "after"), ("zero2-unprepared", "unprepared"),
                      ("zero3-unprepared", "unprepared"), ("tp2-unprepared", "unprepared"),
                      ("ep2-unprepared", "unprepared")):
        case(out, name, lambda where, name=name, how=how: train(name.split("-")[0], how, where))
    case(out, "zero3-second-model", two_models)

    # the loop, unchanged: the launch's --zero_stage 3, the optimizer built before prepare and not passed
    accelerator = Accelerator()
    model = make_net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, loader = accelerator.prepare(model, regression_loader())
    for batch in loader:
        accelerator.backward(mse(model, batch))
        optimizer.step()
        optimizer.zero_grad()
    accelerator.end_training()


if __name__ == "__main__":
    main()
