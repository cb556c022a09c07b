"""Sequence parallelism (Ulysses, sp) and context parallelism (cp) on 2 and 4 CPU processes against plain PyTorch on
one process on the full sequences (fp32): per-step losses within atol 1e-5, clipped gradient norms within 1e-4
relative, final weights after 4 AdamW steps within atol 5e-4 (AdamW divides each gradient by its own running size, so
a parameter whose gradient is nearly 0, e.g. GPT-2's key bias, turns rounding differences into lr-sized steps).

Every batch shape, on tied Llama and GPT-2 under sp 2, cp 2 and dp 2 x cp 2: `for (x,) in loader:
model(input_ids=x, labels=x)` (before: sp 2 first loss 3.598 against one process's 4.167), a list batch with a
separate labels tensor and a padding mask, a namedtuple with packed position_ids, a dict with shift_labels the user
shifted, labels=input_ids of a dict batch accel pads (cp 2, length 14), and a loss computed from the logits with
accelerator.shift_labels / reduce_sequence_loss; same tolerances.

Tiny transformers Llama (untied and tied), GPT-2 and a module of our own that calls scaled_dot_product_attention; sp 2
and cp 2 alone, with a padding mask and with packed sequences, eager and sdpa kernels, activation checkpointing, a
length that needs padding to divide; dp 2 x sp 2, dp 2 x cp 2, ZeRO-3 x cp 2 and TP 2 x sp 2 on 4 processes; HSDP
(dp_replicate 2 x dp_shard 2) x sp 2 and x cp 2 on 8; pipeline stages (pp 2, 1F1B) x sp 2 and x cp 2 on Llama and
pp 2 x sp 2 on our own module on 4 (the target shifted over the whole sequence before the loss_fn's cut:
accelerator.shift_labels); and bit-exact resumes from save_state (cp 2, HSDP x cp 2, pp 2 x cp 2). The runs share one launch per process count (scripts/seq_train.py --jobs)."""

from __future__ import annotations

import json

import pytest
import torch
from _launch import launch_jobs, worker_module
from safetensors.torch import load_file

pytestmark = pytest.mark.multiproc

ATOL = 1e-5
WEIGHT_ATOL = 5e-4
# context parallelism attends each rank's query chunks to the gathered keys (SDPA on chunks, not one call on the whole
# sequence): float32 sums in another order, which AdamW (lr 1e-2, its steps normalised per element) carries into the
# next losses and the weights. Measured on cp2-llama-tied-list, on two machines with the same code: losses 6.2e-6 and
# 1.34e-5 off (relative 3e-6), gradient norm up to 1.25e-4 relative, weights up to 6.3e-4, every element within
# 1e-3; a wrong layout is 0.5-1.1 off in the loss
CP_ATOL, CP_NORM_RTOL, CP_WEIGHT_ATOL = 2e-5, 2e-4, 1e-3
# pipeline stages x sp/cp on Llama: the pipeline tests' tolerance (measured: weights within 3.3e-6); the module of our
# own keeps the sequence layouts' (its sp 2 run without stages is 1.85e-5 off, as with them: AdamW on a ~0 gradient)
PIPELINE_WEIGHT_ATOL = 1e-5
SCRIPT = worker_module("seq_train").__file__
HSDP = ["--dp_replicate_size", 2, "--dp_shard_size", 2, "--zero_stage", 3, "--batch_size", 1]

# name -> (processes, worker arguments, data-parallel degree)
RUNS = {
    "sp2-llama": (2, ["--sp_size", 2], 1),
    "sp2-llama-tied-eager": (2, ["--sp_size", 2, "--model", "llama_tied", "--attn", "eager"], 1),
    "sp2-gpt2": (2, ["--sp_size", 2, "--model", "gpt2"], 1),
    "sp2-padding": (2, ["--sp_size", 2, "--mask", "padding"], 1),
    "sp2-packed-eager": (2, ["--sp_size", 2, "--mask", "packed", "--attn", "eager"], 1),
    "sp2-own-module": (2, ["--sp_size", 2, "--model", "sdpa"], 1),
    "cp2-llama": (2, ["--cp_size", 2], 1),
    "cp2-gpt2-eager": (2, ["--cp_size", 2, "--model", "gpt2", "--attn", "eager"], 1),
    "cp2-padding-length14": (2, ["--cp_size", 2, "--mask", "padding", "--length", 14], 1),
    "cp2-packed": (2, ["--cp_size", 2, "--mask", "packed"], 1),
    "cp2-own-module-checkpointing": (2, ["--cp_size", 2, "--model", "sdpa", "--checkpointing", "full"], 1),
    "cp2-llama-checkpointing": (2, ["--cp_size", 2, "--checkpointing", "full"], 1),
    "dp2-sp2": (4, ["--sp_size", 2], 2),
    "dp2-cp2": (4, ["--cp_size", 2], 2),
    "zero3-cp2": (4, ["--cp_size", 2, "--zero_stage", 3], 2),
    "tp2-sp2": (4, ["--sp_size", 2, "--tp_size", 2, "--kv_heads", 4], 1),
    # HSDP x sp/cp on 8: FSDP2 over (dp_replicate 2, dp_shard 2 x seq 2), 1 sample per dp rank (4 steps of 16);
    # hsdp-cp2 also saves after step 2 and resumes (RESUMED)
    "hsdp-sp2": (8, ["--sp_size", 2, *HSDP], 4),
    "hsdp-cp2": (8, ["--cp_size", 2, *HSDP, "--save_at", 2], 4),
    # pipeline stages x sp/cp on 4 (1F1B, 2 micro-batches of 1): each stage's sequence ranks hold a slice of every
    # micro-batch; targets shifted over the whole sequence (accelerator.shift_labels); pp2-cp2-llama also resumes
    "pp2-sp2-llama": (4, ["--pp_size", 2, "--sp_size", 2, "--loop", "pipeline"], 1),
    "pp2-cp2-llama": (4, ["--pp_size", 2, "--cp_size", 2, "--loop", "pipeline", "--save_at", 2], 1),
    "pp2-sp2-own-module": (4, ["--pp_size", 2, "--sp_size", 2, "--model", "sdpa"], 1),
}
# runs whose state saved after step 2 is loaded by a second job in the same folder: (processes, arguments)
RESUMED = {"cp2-resume": (2, ["--cp_size", 2, "--mask", "padding", "--save_at", 2]), "hsdp-cp2": RUNS["hsdp-cp2"][:2],
           "pp2-cp2-llama": RUNS["pp2-cp2-llama"][:2]}

# every batch shape: the labels reach the model unshifted, however they arrive, and the wrapped forward
# shifts them over the whole sequence; a loss computed from the logits uses shift_labels / reduce_sequence_loss
LOOP_DATA = {"tuple": [], "list": ["--mask", "padding"], "namedtuple": ["--mask", "packed"], "shift_labels": [],
             "user_loss": [], "ids_as_labels": ["--length", 14]}
GPT2_LOOPS = ("tuple", "namedtuple", "user_loss")
for _layout, _processes, _dp in ((["--sp_size", 2], 2, 1), (["--cp_size", 2], 2, 1), (["--cp_size", 2], 4, 2)):
    _prefix = ("dp2-" if _dp > 1 else "") + _layout[0][2:4] + "2"
    for _loop, _data in LOOP_DATA.items():
        if _loop == "ids_as_labels" and _layout[0] == "--sp_size":
            continue  # the padded length is cp's case (sp pads only to a multiple of 2: length 14 divides)
        if _dp > 1 and "padding" in _data:  # dp ranks with different token counts average their own means (DDP's
            _data = []                        # and Accelerate's semantics, not one process's batch mean)
        RUNS[f"{_prefix}-llama-tied-{_loop}"] = (_processes, [*_layout, "--model", "llama_tied", "--loop", _loop,
                                                              *_data], _dp)
        if _loop in GPT2_LOOPS:
            RUNS[f"{_prefix}-gpt2-{_loop}"] = (_processes, [*_layout, "--model", "gpt2", "--loop", _loop, *_data], _dp)


def option(args: list, name: str, default):
    return type(default)(args[args.index(name) + 1]) if name in args else default


def reference(args: list, dp: int):
    """The same model and data on one process, plain PyTorch, the whole sequences, batch 2 x dp."""
    seq_train = worker_module("seq_train")
    kind, attn = option(args, "--model", "llama"), option(args, "--attn", "sdpa")
    model = seq_train.make_model(kind, attn, option(args, "--kv_heads", 2))
    samples = seq_train.make_samples(kind, option(args, "--mask", "none"), option(args, "--length", 16))
    loader = torch.utils.data.DataLoader(samples, batch_size=option(args, "--batch_size", 2) * dp, shuffle=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for step, batch in enumerate(loader):
        if step >= seq_train.STEPS:
            break
        if kind == "sdpa":
            inputs, target = batch
            loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, seq_train.VOCAB), target.reshape(-1))
        else:
            loss = model(**batch).loss
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses, norms


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from conftest import make_isolated_env

    out = tmp_path_factory.mktemp("sequence")
    env = make_isolated_env(out)
    for processes in (2, 4, 8):
        jobs = [(name, args) for name, (n, args, _) in RUNS.items() if n == processes]
        for name, (n, args) in RESUMED.items():  # a save after step 2, then a resume from it (same folder)
            if n == processes:
                jobs += [(name, args)] * (name not in RUNS) + [(name, [*args, "--resume"])]
        launch_jobs(out, env, processes, SCRIPT, jobs)
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_matches_one_process_on_the_whole_sequence(runs, name):
    _, args, dp = RUNS[name]
    expected_weights, expected_losses, expected_norms = reference([str(a) for a in args], dp)
    result = json.loads((runs / name / "result.json").read_text())
    assert len(result["losses"]) == len(expected_losses)
    context = "--cp_size" in args
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(expected_losses),
                               atol=CP_ATOL if context else ATOL, rtol=0)
    torch.testing.assert_close(torch.tensor(result["norms"]), torch.tensor(expected_norms), atol=0,
                               rtol=CP_NORM_RTOL if context else 1e-4)
    weights = load_file(str(runs / name / "result.safetensors"))
    weight_atol = CP_WEIGHT_ATOL if context else WEIGHT_ATOL
    if "--pp_size" in args and "sdpa" not in args:
        weight_atol = PIPELINE_WEIGHT_ATOL
    for key, value in expected_weights.items():
        if key in weights:
            torch.testing.assert_close(weights[key], value, atol=weight_atol, rtol=0, msg=key)
    assert set(weights) <= set(expected_weights) and len(weights) >= len(expected_weights) - 1  # lm_head when tied


def test_a_model_called_without_labels_warns_once_naming_the_helpers(runs):
    """The user-loss loops call the model without labels on every step: one warning, on rank 0, in one line, naming
    accelerator.shift_labels and reduce_sequence_loss; the loops that pass labels get none."""
    for name, (_, args, _) in RUNS.items():
        if "--loop" not in args:
            continue
        seen = json.loads((runs / name / "result.json").read_text())["warnings"]
        if "user_loss" in args:
            assert len(seen) == 1 and "\n" not in seen[0], (name, seen)
            assert "accelerator.shift_labels(input_ids)" in seen[0] and "reduce_sequence_loss" in seen[0]
        else:
            assert seen == [], (name, seen)


@pytest.mark.parametrize("name", list(RESUMED))
def test_resume_from_save_state_is_bit_exact(runs, name):
    """The run saved after step 2 and the resumed run's last two steps and weights equal the uninterrupted run's."""
    whole = json.loads((runs / name / "result.json").read_text())
    resumed = json.loads((runs / name / "resumed.json").read_text())
    assert resumed["losses"] == whole["losses"][2:] and resumed["norms"] == whole["norms"][2:]
    final, again = load_file(str(runs / name / "result.safetensors")), \
        load_file(str(runs / name / "resumed.safetensors"))
    assert final.keys() == again.keys()
    for key in final:
        assert torch.equal(final[key], again[key]), key


def test_heads_that_do_not_divide_are_one_line_not_a_traceback_per_rank(isolated_env, tmp_path):
    """Found at prepare (the model's head counts are known only then): the workers' ConfigError is printed once, as
    one line, by rank 0 (accel.core.diagnostics' excepthook), and the launch fails."""
    from _launch import accel_launch

    proc = accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT, "--out", tmp_path, "--sp_size", 2,
                        "--kv_heads", 1, expect=1)
    line = ("accel: error: sequence parallelism: sp_size=2 does not divide the model's num_key_value_heads=1 "
            "(LlamaConfig)")
    assert proc.stderr.count(line) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_a_tuple_batch_that_needs_padding_is_one_line(isolated_env, tmp_path):
    """`for (x,) in loader` with length 14 under cp 2 (a multiple of 4 needed): a tuple cannot be padded (no mask,
    labels not told from inputs), so it is refused once, on rank 0, in one line naming the fix."""
    from _launch import accel_launch

    proc = accel_launch(isolated_env, "--cpu", "--num_processes", 2, SCRIPT, "--out", tmp_path, "--cp_size", 2,
                        "--model", "llama_tied", "--loop", "tuple", "--length", 14, expect=1)
    line = ("accel: error: context parallelism: the batch's first tensor has sequence length 14, which does not "
            "divide into 4 equal parts (2 x cp_size); allowed: lengths that are a multiple of 4")
    assert proc.stderr.count(line) == 1 and "Traceback" not in proc.stderr, proc.stderr
