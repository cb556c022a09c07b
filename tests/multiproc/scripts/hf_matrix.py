"""Worker for test_hf_models.py: tiny transformers models (GPT-2 with Conv1D and fused q/k/v, Llama tied and
untied, BERT with a tied MLM head; built from configs, no download) trained under one or more backends in one
launch. For each (backend, model) it trains STEPS AdamW steps with a warm-up schedule and clipping, saves the
training state after SAVE_AT steps, resumes a fresh copy from that checkpoint, checks ties every step, and
writes `save_model`; rank 0 then loads that folder with transformers' `from_pretrained` and compares logits.

Everything rank 0 learns goes to OUT/records.json; the test compares it with plain PyTorch on one process.
"""

import argparse
import gc
import json
import shutil
from pathlib import Path

import torch
from _jobs import set_aside_survivors

from accel import Accelerator, ParallelismConfig
from accel.utils import TorchDynamoPlugin, set_seed

STEPS, SAVE_AT, GLOBAL_BATCH, SEQ, VOCAB, LR, MAX_NORM = 4, 2, 4, 8, 64, 1e-2, 1.0

BACKENDS = {  # name -> ParallelismConfig fields
    "ddp": {},
    "zero1": {"zero_stage": 1},
    "zero2": {"zero_stage": 2},
    "zero3": {"zero_stage": 3},
    "zero2_offload": {"zero_stage": 2, "offload_optimizer": True},
    "zero3_offload": {"zero_stage": 3, "offload_params": True, "offload_optimizer": True},
    "tp2": {"tp_size": 2},
    "dp2xtp2": {"tp_size": 2},
    "pp2": {"pp_size": 2, "pp_microbatches": 2},
    "ddp_ac_selective": {"activation_checkpointing": "selective"},  # activation checkpointing on 4 backends
    "zero3_ac": {"zero_stage": 3, "activation_checkpointing": "full"},
    "tp2_ac_selective": {"tp_size": 2, "activation_checkpointing": "selective"},
    "pp2_ac": {"pp_size": 2, "pp_microbatches": 2, "activation_checkpointing": "full"},
    # regional torch.compile (inductor) on 4 backends, with activation checkpointing under ZeRO-3
    "ddp_compile": {"dynamo": {"backend": "inductor", "use_regional_compilation": True}},
    "zero3_ac_compile": {"zero_stage": 3, "activation_checkpointing": "full",
                         "dynamo": {"backend": "inductor", "use_regional_compilation": True}},
    "tp2_compile": {"tp_size": 2, "dynamo": {"backend": "inductor", "use_regional_compilation": True}},
    "pp2_compile": {"pp_size": 2, "pp_microbatches": 2,
                    "dynamo": {"backend": "inductor", "use_regional_compilation": True}},
    # whole-model compilation: not in the test (slow), run by hand (docs/compile.md)
    "ddp_compile_whole": {"dynamo": {"backend": "inductor"}},
    "zero3_compile_whole": {"zero_stage": 3, "dynamo": {"backend": "inductor"}},
    "tp2_compile_whole": {"tp_size": 2, "dynamo": {"backend": "inductor"}},
    "pp2_compile_whole": {"pp_size": 2, "pp_microbatches": 2, "dynamo": {"backend": "inductor"}},
    "pp2xtp2": {"pp_size": 2, "tp_size": 2, "pp_microbatches": 2},
    "zero3xtp2": {"tp_size": 2, "zero_stage": 3},  # on 4 processes: dp 2 x tp 2 with parameters resharded
    "pp2xdp2": {"pp_size": 2, "pp_microbatches": 2},  # on 4 processes: DDP per stage
    "pp2xzero1": {"pp_size": 2, "pp_microbatches": 2, "zero_stage": 1},  # on 4 processes
    "pp2xzero3": {"pp_size": 2, "pp_microbatches": 2, "zero_stage": 3},  # on 4 processes: FSDP2 per stage
}
PP_MODELS = ("gpt2", "llama_tied", "llama_untied")


def build(name: str) -> torch.nn.Module:
    """The model, initialised from seed 0 (fp32, no dropout, so one process and many agree)."""
    import transformers as tf

    set_seed(0)
    if name == "gpt2":
        config = tf.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0,
                               embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0,
                               eos_token_id=0)
        return tf.GPT2LMHeadModel(config)
    if name.startswith("llama"):
        config = tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                                num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
                                tie_word_embeddings=name == "llama_tied")
        return tf.LlamaForCausalLM(config)
    if name == "bert":
        config = tf.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                               vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
        return tf.BertForMaskedLM(config)
    raise ValueError(name)


def batches() -> torch.Tensor:
    """STEPS global batches of token ids: [STEPS, GLOBAL_BATCH, SEQ]."""
    return torch.randint(0, VOCAB, (STEPS, GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(7))


def loss_fn(outputs, target):
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))


def tie_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that refer to one parameter object (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def make_optimizer(model):
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return optimizer, get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=STEPS)


def reference(name: str, dp_size: int) -> dict:
    """Plain PyTorch on one process over the same global batches (used by the test). The scheduler steps
    once per data-parallel rank per optimizer step, as the prepared scheduler does (Accelerate's semantics: its
    schedule counts one process's batches)."""
    model = build(name)
    optimizer, scheduler = make_optimizer(model)
    losses, norms = [], []
    for batch in batches():
        loss = loss_fn(model(input_ids=batch), batch)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM).item())
        optimizer.step()
        for _ in range(dp_size):
            scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"model": model, "losses": losses, "norms": norms}


class Run:
    """One backend's Accelerator; trains a model from scratch or from a checkpoint."""

    def __init__(self, backend: str, out: Path, keep_checkpoints: bool = False) -> None:
        self.backend, self.out, self.keep_checkpoints = backend, out, keep_checkpoints
        fields = dict(BACKENDS[backend])
        dynamo = fields.pop("dynamo", None)
        self.accelerator = Accelerator(parallelism_config=ParallelismConfig(**fields),
                                       dynamo_plugin=TorchDynamoPlugin(**dynamo) if dynamo else None)

    def check_ties(self, model, groups: list[list[str]]) -> bool:
        """Every tied group is one parameter object in what this process holds (pipelines: the stages' own)."""
        unwrapped = self.accelerator.unwrap_model(model)
        params = dict(unwrapped.named_parameters(remove_duplicate=False))
        for names in groups:
            held = [params[n] for n in names if n in params]
            if any(p is not held[0] for p in held[1:]):
                return False
        return True

    def train(self, name: str, start: int, checkpoint: Path | None) -> dict:
        acc = self.accelerator
        model = build(name)
        groups = tie_groups(model)
        optimizer, scheduler = make_optimizer(model)
        model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler, loss_fn=loss_fn)
        if start:
            acc.load_state(str(checkpoint))
        dp, dp_rank = acc.backend.data_parallel_size, acc.backend.data_parallel_rank
        part = GLOBAL_BATCH // dp
        losses, norms, ties = [], [], [self.check_ties(model, groups)]
        for step, batch in enumerate(batches()):
            if step < start:
                continue
            local = batch[dp_rank * part:(dp_rank + 1) * part].to(acc.device)
            loss = model(local, target=local)
            acc.backward(loss)
            norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).item())
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            losses.append(acc.reduce(loss.detach().float(), "mean").item())
            ties.append(self.check_ties(model, groups))
            if step + 1 == SAVE_AT and checkpoint is not None and not start:
                acc.save_state(str(checkpoint))
        weights = acc.get_state_dict(model)
        model.eval()
        with torch.no_grad():
            logits = _logits(model(input_ids=batches()[0].to(acc.device)))
        checkpointed = sum("_accel_checkpointed" in m.__dict__ for m in acc.unwrap_model(model).modules())
        compiled = sum(getattr(m, "_compiled_call_impl", None) is not None for m in acc.unwrap_model(model).modules())
        return {"model": model, "losses": losses, "norms": norms, "ties": all(ties), "weights": weights,
                "checkpointed": checkpointed, "compiled": compiled,
                "logits": logits.detach().float().cpu()}

    def run(self, name: str) -> dict:
        acc = self.accelerator
        tag = f"{self.backend}-{name}"
        checkpoint, folder = self.out / f"{tag}-ckpt", self.out / f"{tag}-model"
        torch._dynamo.reset()  # this process compiles many model classes: each starts within the recompile limit
        graphs = _compiled_graphs()
        full = self.train(name, 0, checkpoint)
        graphs = _compiled_graphs() - graphs
        acc.save_model(full["model"], str(folder))
        acc.free_memory()
        resumed = self.train(name, SAVE_AT, checkpoint)
        acc.free_memory()
        record = {"losses": full["losses"], "norms": full["norms"], "ties": full["ties"] and resumed["ties"],
                  "resumed_losses": resumed["losses"], "dp_size": acc.backend.data_parallel_size,
                  "checkpointed_blocks": full["checkpointed"], "compiled_blocks": full["compiled"],
                  "compiled_graphs": graphs}
        if acc.is_main_process:
            record["resume_mismatch"] = sorted(k for k, v in full["weights"].items()
                                               if not torch.equal(v, resumed["weights"][k]))
            record.update(from_pretrained(name, folder, full["logits"]))
            from safetensors.torch import save_file

            unique = {}
            for key, value in full["weights"].items():  # tied keys: the same tensor, saved once by save_model
                unique.setdefault(id(value), (key, value))
            save_file({k: v.contiguous() for k, v in unique.values()}, str(self.out / f"{tag}-weights.safetensors"))
            if not self.keep_checkpoints:
                shutil.rmtree(checkpoint)
        return record

    def load_only(self, name: str, checkpoint: Path) -> None:
        """Prepare a fresh model and load `checkpoint` into it; a CheckpointError is printed and exits 3."""
        from accel.checkpoint import CheckpointError

        model = build(name)
        optimizer, scheduler = make_optimizer(model)
        self.accelerator.prepare(model, optimizer, scheduler, loss_fn=loss_fn)
        try:
            self.accelerator.load_state(str(checkpoint))
        except CheckpointError as exc:
            if self.accelerator.is_main_process:  # every rank refuses; one prints (their lines would interleave)
                print(f"CheckpointError: {exc}", flush=True)
            raise SystemExit(3) from None


def _compiled_graphs() -> int:
    """How many graphs torch.compile has captured in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _logits(outputs):
    return outputs.logits if hasattr(outputs, "logits") else outputs


def from_pretrained(name: str, folder: Path, logits: torch.Tensor) -> dict:
    """transformers loads save_model's folder, and so does accel's load_checkpoint_in_model into a fresh model:
    same logits, ties intact, tied weights stored once."""
    from safetensors import safe_open

    from accel import load_checkpoint_in_model

    model = build(name)
    loaded = type(model).from_pretrained(str(folder))
    load_checkpoint_in_model(model, str(folder))
    diffs = []
    for candidate in (loaded, model):
        candidate.eval()
        with torch.no_grad():
            diffs.append((candidate(input_ids=batches()[0]).logits.float() - logits).abs().max().item())
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys, metadata = sorted(f.keys()), f.metadata()
    return {"logits_diff": max(diffs), "loaded_ties": tie_groups(loaded), "accel_loaded_ties": tie_groups(model),
            "saved_keys": keys, "saved_metadata": metadata}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backends", required=True, help="comma-separated names of BACKENDS")
    parser.add_argument("--models", default="gpt2,llama_tied,llama_untied,bert")
    parser.add_argument("--keep_checkpoints", action="store_true")
    parser.add_argument("--load_only", help="a checkpoint to load into each (backend, model), nothing else")
    args = parser.parse_args()
    import transformers as tf

    tf.GPT2LMHeadModel, tf.LlamaForCausalLM, tf.BertForMaskedLM  # noqa: B018  # transformers imports them lazily
    # free_memory's gc.collect between runs walks every object the imports made (0.3-0.4 s each, twice per model):
    # those stay alive anyway, so they are set aside, and each collection walks only what the runs make
    gc.freeze()
    out = Path(args.out)
    records = {}
    backends = args.backends.split(",")
    for i, backend in enumerate(backends):
        run = Run(backend, out, args.keep_checkpoints)
        if args.load_only:
            for name in args.models.split(","):
                run.load_only(name, Path(args.load_only))
            continue
        for name in args.models.split(","):
            if backend.startswith("pp") and name not in PP_MODELS:
                continue
            records[f"{backend}-{name}"] = run.run(name)
        if i < len(backends) - 1:  # what this backend imported (FSDP2, DTensor, pipelining, dynamo) lives on: set
            del run  # aside, the later collections skip it (gc.collect was 12 s of a 77 s rank)
            set_aside_survivors()
    if run.accelerator.is_main_process:
        (out / "records.json").write_text(json.dumps(records, indent=1))
    run.accelerator.end_training()


if __name__ == "__main__":
    main()
