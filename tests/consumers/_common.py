"""What the consumer workers share: a word-level tokenizer built in memory (no hub), seeded word sentences, and the
scenario loop that writes each scenario's records and weights as soon as it ends.

The workers run unchanged on the real Accelerate (plain `python` / `accelerate launch`) and on accel (`accel launch
--accelerate_shim`): they import `accelerate` only, never `accel`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

# topics of words: sentences drawn from one topic are "similar" (the sentence-transformers data, the classifier's
# labels, the reward of the GRPO scenario)
TOPICS = [
    ["cat", "dog", "horse", "bird", "fish", "mouse", "cow", "sheep"],
    ["red", "blue", "green", "black", "white", "pink", "gray", "gold"],
    ["run", "jump", "swim", "walk", "fly", "sing", "read", "draw"],
    ["one", "two", "three", "four", "five", "six", "seven", "eight"],
]
WORDS = [w for topic in TOPICS for w in topic] + ["the", "a", "and", "is", "of", "yes", "no"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<s>", "</s>"]


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def tokenizer(bert: bool = False, padding_side: str = "right"):
    """A `PreTrainedTokenizerFast` over WORDS, split on whitespace; `bert`: [CLS] ... [SEP] around each text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bert:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", bos_token="<s>", eos_token="</s>",
                                   model_max_length=64, padding_side=padding_side)


def shared_folder(folder, write) -> str:
    """`write(folder)` on the main process, the others waiting: a model saved once, then loaded by every process
    from its path (transformers' `save_pretrained` writes config.json on the main process only once
    torch.distributed is up)."""
    from accelerate import PartialState

    state = PartialState(cpu=True)  # (the workers train on CPU; a bare PartialState() on a machine without GPUs
    # under `accelerate launch --multi_gpu` would see one process)
    if state.is_main_process:
        write(Path(folder))
    state.wait_for_everyone()
    return str(folder)


def vocab_size() -> int:
    return len(SPECIAL) + len(WORDS)


class Sentences:
    """Seeded sentences of 3-7 words from one topic (plus filler words)."""

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)

    def topic(self) -> int:
        return self.rng.randrange(len(TOPICS))

    def sentence(self, topic: int, lo: int = 3, hi: int = 7) -> str:
        words = [self.rng.choice(TOPICS[topic]) for _ in range(self.rng.randint(lo, hi))]
        words.insert(self.rng.randrange(len(words) + 1), self.rng.choice(["the", "a", "and", "is", "of"]))
        return " ".join(words)


def numbers(entry: dict) -> dict:
    """The numeric items of a log entry (floats and ints; bools and strings left out)."""
    return {k: v for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def impl() -> dict:
    import accelerate

    from accelerate import PartialState

    where = Path(accelerate.__file__).resolve().parts
    state = PartialState()  # the processes the run really trained on (initialized by then)
    return {"impl": "accel" if "shim" in where else "accelerate", "accelerate_version": accelerate.__version__,
            "world": int(os.environ.get("WORLD_SIZE", "1")), "num_processes": state.num_processes,
            "distributed_type": str(state.distributed_type).split(".")[-1]}


def listing(folder: Path) -> list:
    """Every file and folder under `folder`, relative, sorted (folders end in /)."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) + ("/" if p.is_dir() else "") for p in folder.rglob("*"))


def run_scenarios(scenarios: dict, doc: str) -> None:
    """`--out DIR --scenarios a,b,...`: each scenario `fn(out) -> (record, {suffix: tensors})` runs in turn; rank 0
    rewrites DIR/records.json after each one and writes DIR/<name><suffix>.safetensors. A scenario that raises is
    recorded as {"error": ...} (and its traceback printed) and the next one runs."""
    from safetensors.torch import save_file

    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", default=",".join(scenarios))
    cli = parser.parse_args()
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    records: dict = {}
    for name in cli.scenarios.split(","):
        start = time.perf_counter()
        try:
            record, weights = scenarios[name](out / name)
        except Exception as exc:  # noqa: BLE001 - recorded and reported by the test, the next scenario still runs
            traceback.print_exc()
            record, weights = {"error": f"{type(exc).__name__}: {exc}"[:2000]}, {}
        record = {**impl(), **record, "seconds": round(time.perf_counter() - start, 2)}
        records[name] = record
        if rank() == 0:
            for suffix, tensors in weights.items():
                save_file({k: v.detach().float().cpu().clone().contiguous() for k, v in tensors.items()},
                          str(out / f"{name}{suffix}.safetensors"))
            (out / "records.json").write_text(json.dumps(records, indent=1))
        print(f"{Path(sys.argv[0]).stem}: {name} {'FAILED ' + record['error'] if 'error' in record else 'done'} "
              f"in {record['seconds']} s", flush=True)
