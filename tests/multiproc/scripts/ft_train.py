"""Worker for tests/multiproc/training/test_fault_tolerance.py: a small MLP or a tiny transformers Llama (`--model
llama`) trained by an unchanged Accelerate loop, under fault tolerance (accel launch --fault_tolerance) or plain DDP.

Under fault tolerance the loop runs until the quorum committed --steps steps (`committed_steps`, which a healed
group receives with the weights). `--kill-after K`: on its first attempt, the last process of the last replica group
SIGKILLs itself after K steps committed with every group, between two steps or (`--kill-in backward`) inside the
next backward, while the other group waits for it in the all-reduce (nothing is saved, nothing is read back: no
checkpoint exists). A restarted attempt waits `--restart-delay` seconds before it starts (a restart that takes a
while: the live group then trains alone). While a group trains without the others it sleeps `--alone-sleep` seconds
per step, so the job is still running when the killed group is back. Each process appends one JSON line per step to
OUT/steps-g<group>-r<rank>-a<attempt>.jsonl and writes its final weights to
OUT/weights-g<group>-r<rank>.safetensors.

`--full-state` makes the loop carry everything a run carries besides the weights: a LambdaLR schedule, dropout,
accumulation over 2 batches (`accumulate()`), a registered object that weighs each loss; with `accel launch
--mixed_precision fp16` the gradient scaler too. The last line of each process then records that state (learning rate,
scheduler step, scaler, `accelerator.step`, the registered object, the RNG states), so the test compares it over the
groups: a heal that forgot a part leaves the healed group's different. `--start-delay S`: group 1 starts S seconds
late. `--diverge-at K`: group 1 changes one weight after K committed steps (replicas that drift apart)."""

import argparse
import hashlib
import json
import os
import random
import signal
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator
from accel.utils import set_seed


VOCAB, SEQ = 64, 8


class LossWeight:
    """A registered object the loop reads: each loss is weighed by how many batches it saw (a heal that forgot it would
    weigh the healed group's losses otherwise)."""

    def __init__(self) -> None:
        self.batches = 0

    def factor(self) -> float:
        self.batches += 1
        return 1.0 + 0.05 * (self.batches % 5)

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])


def make_problem(kind: str = "mlp", samples: int = 256, dropout: float = 0.0):
    """(inputs, targets, model): a small MLP on a regression, or a tiny transformers Llama (2 layers, grouped-query
    attention) predicting random tokens."""
    g = torch.Generator().manual_seed(5)
    if kind == "llama":
        import transformers as tf

        ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
        set_seed(0)
        config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
                                attention_dropout=dropout, attn_implementation="eager")
        return ids, ids, tf.LlamaForCausalLM(config)
    x = torch.randn(samples, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(samples, 1, generator=g)
    set_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Dropout(dropout),
                                torch.nn.Linear(16, 1))
    return x, y, model


def loss_of(model, inputs, targets, kind: str):
    if kind == "llama":
        return model(input_ids=inputs, labels=targets).loss  # transformers shifts the labels itself
    return torch.nn.functional.mse_loss(model(inputs), targets)


def load_dir_weights(out: Path, group: int, rank: int) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / f"weights-g{group}-r{rank}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-after", type=int, default=None)
    parser.add_argument("--kill-in", choices=("loop", "backward"), default="loop",
                        help="where the victim dies: between steps, or in its backward (the live group then waits in "
                             "the all-reduce for it)")
    parser.add_argument("--alone-sleep", type=float, default=0.0)
    parser.add_argument("--restart-delay", type=float, default=0.0)
    parser.add_argument("--model", choices=("mlp", "llama"), default="mlp")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=0,
                        help="the plain epoch loop, unchanged (a healed group's loader moves on with the others' "
                             "steps); 0: the loop bounded by --steps committed steps")
    parser.add_argument("--local-sgd-steps", type=int, default=None,
                        help="the loop in Accelerate's LocalSGD block; --steps then counts this process's steps")
    parser.add_argument("--save", action="store_true", help="at the end: save_state, forget, load_state back")
    parser.add_argument("--load-at-end", default=None, help="at the end: load_state(this folder), write the weights")
    parser.add_argument("--full-state", action="store_true",
                        help="a schedule, dropout, accumulation 2 and a registered object (fp16: the launch's flag)")
    parser.add_argument("--start-delay", type=float, default=0.0, help="group 1 starts this many seconds late")
    parser.add_argument("--diverge-at", type=int, default=None, help="group 1 changes a weight after K steps")
    args = parser.parse_args()
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        time.sleep(args.restart_delay)  # a restart that takes a while (a new node, a container to pull)
    elif os.environ.get("ACCEL_FT_REPLICA_ID") == "1":
        time.sleep(args.start_delay)  # a group that comes late (a node that pulls its image slowly)

    x, y, model = make_problem(args.model, args.samples, dropout=0.1 if args.full_state else 0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(x, y), batch_size=4, shuffle=False)
    accelerator = Accelerator(gradient_accumulation_steps=2 if args.full_state else 1)
    if args.full_state:
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: max(0.0, 1 - s / 200))
        model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
        weigh = LossWeight()
        accelerator.register_for_checkpointing(weigh)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    ft = accelerator.config.fault_tolerance
    group = ft.replica_id if ft.enabled else 0
    rank, attempt = accelerator.process_index, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    log = open(out / f"steps-g{group}-r{rank}-a{attempt}.jsonl", "a", buffering=1)  # noqa: SIM115
    if args.local_sgd_steps:  # steps counted by this process (under semi-synchronous fault tolerance too)
        from accel.local_sgd import LocalSGD

        local_sgd = LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=args.local_sgd_steps)
        local_sgd.__enter__()
        manager = accelerator.backend.run.manager if ft.enabled else None

        def progress() -> int:
            return local_sgd.num_steps
    elif ft.enabled:
        from accel.fault_tolerance import committed_steps

        manager = accelerator.backend.run.manager

        def progress() -> int:
            return committed_steps(accelerator)
    else:
        taken = [0]

        def progress() -> int:
            return taken[0]

    victim = ft.enabled and group == ft.group_size - 1 and rank == accelerator.num_processes - 1 and attempt == 0
    together = 0  # steps this process committed with every group
    def batches():
        if args.epochs:  # an unchanged epoch loop
            for _ in range(args.epochs):
                yield from loader
            return
        while progress() < args.steps:
            for batch in loader:
                if progress() >= args.steps:
                    return
                yield batch

    for inputs, targets in batches():
        if victim and args.kill_after is not None and together >= args.kill_after:
            log.write(json.dumps({"t": time.time(), "killed_at": progress()}) + "\n")
            if args.kill_in == "loop":
                os.kill(os.getpid(), signal.SIGKILL)
            last = list(accelerator.unwrap_model(model).parameters())[-1]
            last.register_hook(lambda grad: os.kill(os.getpid(), signal.SIGKILL))  # before DDP's all-reduce
        before = progress()
        if args.full_state:
            with accelerator.accumulate(model):
                loss = loss_of(model, inputs, targets, args.model) * weigh.factor()
                accelerator.backward(loss)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad()
        else:
            loss = loss_of(model, inputs, targets, args.model)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if args.diverge_at is not None and group == 1 and progress() == args.diverge_at and before < progress():
            with torch.no_grad():
                first = next(accelerator.unwrap_model(model).parameters())
                (first.to_local() if hasattr(first, "to_local") else first).view(-1)[0] += 1e-3
        record = {"t": time.time(), "before": before}
        if args.full_state:
            record["rng"] = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:12]
        if args.local_sgd_steps:
            local_sgd.step()
            record.update(after=progress(), participants=manager.num_participants() if manager else 0,
                          synced=manager.current_step() if manager else None)
        elif ft.enabled:
            record.update(after=progress(), participants=manager.num_participants())
            together += record["after"] > before and manager.num_participants() == ft.group_size
            if manager.num_participants() < ft.group_size:
                time.sleep(args.alone_sleep)
        else:
            taken[0] += 1
            record.update(after=taken[0], participants=accelerator.num_processes)
        log.write(json.dumps(record) + "\n")
    if args.local_sgd_steps:
        local_sgd.__exit__(None, None, None)

    def weights():  # every process takes part (ZeRO-3 gathers the shards)
        return {k: v.detach().cpu().contiguous() for k, v in accelerator.get_state_dict(model).items()}

    save_file(weights(), str(out / f"weights-g{group}-r{rank}.safetensors"))
    if args.full_state:  # what a run carries besides the weights, as this process ends
        scaler = accelerator.scaler
        log.write(json.dumps({"state": {
            "lr": schedule.get_last_lr(), "scheduler_steps": schedule.scheduler.last_epoch, "step": accelerator.step,
            "scale": None if scaler is None else scaler.get_scale(), "registered": weigh.batches,
            "torch_rng": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
            "python_rng": hashlib.sha256(repr(random.getstate()).encode()).hexdigest()}}) + "\n")
    if args.save:  # each group its own folder (each group is a job of its own)
        folder = accelerator.save_state(str(out / f"ckpt-g{group}"))
        saved_steps = progress()
        manager.load_state_dict({"step": 0, "batches_committed": 0})
        with torch.no_grad():
            for param in model.parameters():
                param.zero_()
        accelerator.load_state(folder)
        saved = load_dir_weights(out, group, rank)
        same = all(torch.equal(value, saved[key]) for key, value in weights().items())
        log.write(json.dumps({"saved_steps": saved_steps, "loaded_steps": progress(), "same_weights": same}) + "\n")
    if args.load_at_end:
        accelerator.load_state(args.load_at_end)
        save_file(weights(), str(out / f"loaded-g{group}-r{rank}.safetensors"))
    accelerator.end_training()


if __name__ == "__main__":
    main()
