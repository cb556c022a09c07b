"""Accelerate's own examples (`examples/nlp_example.py`, `complete_nlp_example.py`, `by_feature/*.py` of Accelerate
1.15.0), unchanged, on 1 and 2 CPU processes: each runs once with the real Accelerate and once on accel through the
shim, on the same offline stand-ins, and their printed metrics must be equal.

    ACCEL_ACCELERATE_EXAMPLES=/path/to/accelerate/examples python tests/accelerate_compat/examples_harness.py [NAME ...]

The examples are not in Accelerate's PyPI distribution, so they come from $ACCEL_ACCELERATE_EXAMPLES (a folder
holding nlp_example.py and by_feature/), or else are downloaded from GitHub at the pinned tag (TAG) into a temp folder;
when neither works, `examples_dir()` returns the one-line reason to skip. They are never copied into this repository.

Stand-ins (test fixtures, built once per run in a temp folder, not accel features):
- "bert-base-cased": a tiny BertForSequenceClassification and a WordPiece tokenizer over the stand-in sentences'
  words, saved with save_pretrained into a Hugging Face hub cache layout (HF_HOME of the runs, HF_HUB_OFFLINE=1), so
  the examples' `from_pretrained("bert-base-cased")` loads them through transformers' ordinary offline cache lookup;
- `datasets` and `evaluate`: the modules in example_standins/ (put on the examples' PYTHONPATH) with a synthetic
  GLUE-MRPC-shaped dataset (sentence1, sentence2, label, idx; TRAIN_ROWS / VALIDATION_ROWS rows) and GLUE MRPC's
  metric (accuracy, F1).

What is compared: the lines an example prints with its metrics (`epoch N: {...}`, `Resumed from checkpoint: ...`,
`Average test metrics ...`) in order, and nlp_example.py's per-batch `=====  tensor(...)` prediction lines (printed by
every process, so compared as a sorted list). Equality is exact: the same ops run in the same order on one CPU thread
per process, so any difference is a behaviour difference, not rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

try:  # under pytest (tests/multiproc is on its path): commands from a warm interpreter
    import warm_python
    run_python = warm_python.run
except ImportError:  # run as a script
    def run_python(cmd, **kwargs):
        return subprocess.run(cmd, capture_output=True, text=True, **kwargs)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STANDINS = HERE / "example_standins"
TAG = "v1.15.0"
ENV = "ACCEL_ACCELERATE_EXAMPLES"
RAW = "https://raw.githubusercontent.com/huggingface/accelerate/{tag}/examples/{path}"
SKIP_REASON = f"Accelerate's examples are not on PyPI and GitHub is unreachable: set {ENV}"
TRAIN_ROWS, VALIDATION_ROWS = 96, 40  # validation: 40 rows in batches of 32, so gather_for_metrics drops padding


@dataclass
class Case:
    """One comparison: an example run with ARGS (a second list: resumed from a checkpoint the first run saved)."""
    name: str
    script: str
    args: list[str] = field(default_factory=list)
    resume: list[str] | None = None  # arguments of a second run in the same folder ("{ckpt}" = the first run's)


CASES = {
    "nlp_example": Case("nlp_example", "nlp_example.py"),
    "complete_nlp_example": Case("complete_nlp_example", "complete_nlp_example.py",
                                 ["--checkpointing_steps", "epoch", "--output_dir", "out"],
                                 ["--resume_from_checkpoint", "out/epoch_0", "--output_dir", "out2"]),
    # saves every 2 steps, then resumes from step_4: mid-epoch (skip_first_batches) on 1 and on 2 processes
    "checkpointing": Case("checkpointing", "by_feature/checkpointing.py",
                          ["--checkpointing_steps", "2", "--output_dir", "out"],
                          ["--resume_from_checkpoint", "out/step_4", "--output_dir", "out2"]),
    "automatic_gradient_accumulation": Case("automatic_gradient_accumulation",
                                            "by_feature/automatic_gradient_accumulation.py"),
    "ddp_comm_hook": Case("ddp_comm_hook", "by_feature/ddp_comm_hook.py"),
    "early_stopping": Case("early_stopping", "by_feature/early_stopping.py"),
    "gradient_accumulation": Case("gradient_accumulation", "by_feature/gradient_accumulation.py",
                                  ["--gradient_accumulation_steps", "2"]),
    "local_sgd": Case("local_sgd", "by_feature/local_sgd.py", ["--local_sgd_steps", "2"]),
    "memory": Case("memory", "by_feature/memory.py"),
    "multi_process_metrics": Case("multi_process_metrics", "by_feature/multi_process_metrics.py"),
    "profiler": Case("profiler", "by_feature/profiler.py"),
    "tracking": Case("tracking", "by_feature/tracking.py"),
}

# Examples in scope that do not run here, and why (docs/accelerate_compat.md lists them too).
NOT_RUN = {
    "by_feature/fsdp_with_peak_mem_tracking.py": "cannot run on a CPU: its memory tracker calls torch.cuda's memory "
                                                  "statistics (torch.cuda.memory_allocated/reset_peak_memory_stats)",
    "by_feature/deepspeed_with_config_support.py": "cannot run on a CPU: DeepSpeed's ZeRO engine needs an accelerator "
                                                    "(and a causal LM checkpoint and a text dataset from the hub)",
    "by_feature/megatron_lm_gpt_pretraining.py": "cannot run on a CPU: Megatron-LM needs CUDA GPUs",
    "by_feature/gradient_accumulation_for_autoregressive_models.py": "not tried: it loads HuggingFaceTB/SmolLM-360M "
                                                                      "and wikitext-2, which have no stand-ins here",
    "by_feature/cross_validation.py": "not tried: it needs scikit-learn (StratifiedKFold), not a test extra",
    "by_feature/schedule_free.py": "not tried: it needs the schedulefree package, not a test extra",
}


# ---------------------------------------------------------------------------------------------------- the examples

def examples_dir(cache: Path | None = None) -> tuple[Path | None, str]:
    """(folder holding the examples, "") or (None, reason to skip)."""
    given = os.environ.get(ENV)
    if given:
        folder = Path(given)
        if not (folder / "nlp_example.py").is_file():
            return None, f"{ENV}={given} holds no nlp_example.py"
        return folder, ""
    folder = (cache or Path(tempfile.mkdtemp(prefix="accelerate-examples-"))) / TAG
    wanted = ["nlp_example.py"] + sorted({case.script for case in CASES.values()} - {"nlp_example.py"})
    try:
        for path in wanted:
            target = folder / path
            if not target.is_file():
                with urllib.request.urlopen(RAW.format(tag=TAG, path=path), timeout=5) as response:
                    data = response.read()
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
    except OSError:
        return None, SKIP_REASON
    return folder, ""


# ---------------------------------------------------------------------------------------------------- the stand-ins

WORDS = ("the company said its shares rose fell sharply on monday after report that profits were higher lower than "
         "analysts expected market investors bank government officials told reporters new plan would cut costs "
         "jobs year quarter sales").split()


def _sentence(rng: random.Random) -> list[str]:
    return [rng.choice(WORDS) for _ in range(rng.randint(5, 12))]


def mrpc_rows(n: int, seed: int) -> dict[str, list]:
    """GLUE MRPC's columns; label 1 (a paraphrase) when sentence2 is sentence1 with at most two words changed."""
    rng = random.Random(seed)
    columns: dict[str, list] = {"sentence1": [], "sentence2": [], "label": [], "idx": []}
    for i in range(n):
        first = _sentence(rng)
        label = rng.random() < 0.6
        second = list(first) if label else _sentence(rng)
        for _ in range(rng.randint(0, 2)):
            second[rng.randrange(len(second))] = rng.choice(WORDS)
        columns["sentence1"].append(" ".join(first).capitalize() + ".")
        columns["sentence2"].append(" ".join(second).capitalize() + ".")
        columns["label"].append(int(label))
        columns["idx"].append(i)
    return columns


def build_standins(root: Path) -> dict[str, str]:
    """Writes the stand-ins under ROOT; returns the environment variables the examples run with."""
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    for module in ("datasets.py", "evaluate.py"):
        shutil.copy(STANDINS / module, site / module)
    data = {"train": mrpc_rows(TRAIN_ROWS, 0), "validation": mrpc_rows(VALIDATION_ROWS, 1)}
    (site / "mrpc.json").write_text(json.dumps(data))

    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    hf_home = root / "hf"
    snapshot = hf_home / "hub" / "models--bert-base-cased" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True, exist_ok=True)
    (snapshot.parents[1] / "refs").mkdir(exist_ok=True)
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "."] + sorted({w for w in WORDS} | {w.capitalize()
                                                                                                 for w in WORDS})
    (root / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizer(str(root / "vocab.txt"), do_lower_case=False, model_max_length=64)
    tokenizer.save_pretrained(snapshot)
    import torch

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, num_labels=2, initializer_range=0.5)
    model = BertForSequenceClassification(config).eval()
    # The examples take a few steps at a warm-up learning rate (2e-5 * step / 100): put the logits' difference near
    # the decision boundary (centred on its median over the validation rows, spread about 1e-3), so those small
    # steps change predictions and the printed metrics depend on them.
    rows = data["validation"]
    with torch.no_grad():
        logits = model(**tokenizer(rows["sentence1"], rows["sentence2"], padding=True, return_tensors="pt")).logits
        margin = logits[:, 1] - logits[:, 0]
        scale = 1e-3 / margin.std()
        model.classifier.bias[1] -= margin.median()
        model.classifier.weight.mul_(scale)
        model.classifier.bias.mul_(scale)
    model.save_pretrained(snapshot)
    return {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1", "PYTHONPATH": str(site)}


# ---------------------------------------------------------------------------------------------------- the runs

def free_port() -> int:
    """A free TCP port for torchrun's rendezvous (its default, 29500, may be another test's)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch_cmd(impl: str, num_processes: int, script: Path, args: list[str]) -> list[str]:
    """accel through the shim, or the real Accelerate's `accelerate launch` (its --cpu launches one process; two
    CPU processes are its --multi_gpu launcher, torchrun, with no GPU visible)."""
    if impl == "accel":
        return [sys.executable, "-m", "accel.cli.main", "launch", "--accelerate_shim", "--cpu", "--num_processes",
                str(num_processes), str(script), "--cpu", *args]
    launch = ["--cpu"] if num_processes == 1 else ["--multi_gpu", "--num_machines", "1", "--main_process_port",
                                                   str(free_port())]
    return [sys.executable, "-m", "accelerate.commands.launch", *launch, "--num_processes", str(num_processes),
            "--mixed_precision", "no", "--dynamo_backend", "no", str(script), "--cpu", *args]


def run(impl: str, num_processes: int, script: Path, args: list[str], cwd: Path, env: dict[str, str],
        timeout: int = 240) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    full = {**os.environ, **env, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONHASHSEED": "0"}
    full["PYTHONPATH"] = os.pathsep.join(p for p in (env["PYTHONPATH"], os.environ.get("PYTHONPATH")) if p)
    full.pop("ACCEL_ACCELERATE_VERSION", None)
    return run_python(launch_cmd(impl, num_processes, script, args), cwd=cwd, env=full, timeout=timeout)


METRIC = re.compile(r"epoch \d+: \{[^}]*\}|Resumed from checkpoint: \S+|Average test metrics[^{\n]*\{[^}]*\}")
PREDICTIONS = re.compile(r"=====\s+tensor\(\[[^\]]*\]\)")


def printed(stdout: str) -> list[str]:
    """The metric lines in order, then every process's `=====  tensor(...)` prediction prints, whitespace
    normalized, sorted (two processes' prints share the pipe: one's line can end inside the other's)."""
    return METRIC.findall(stdout) + sorted(" ".join(p.split()) for p in PREDICTIONS.findall(stdout))


@dataclass
class Result:
    name: str
    num_processes: int
    status: str  # "equal", "differs", "failed"
    detail: str = ""
    lines: dict[str, list[str]] = field(default_factory=dict)


def _tail(proc: subprocess.CompletedProcess) -> str:
    return "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])


def compare(case: Case, num_processes: int, examples: Path, work: Path, env: dict[str, str]) -> Result:
    """Runs CASE with both implementations (and its resume, if any) and compares what they print."""
    script = examples / case.script
    outputs: dict[str, list[str]] = {}
    for impl in ("accelerate", "accel"):
        cwd = work / f"{case.name}-{num_processes}-{impl}"
        shutil.rmtree(cwd, ignore_errors=True)
        lines = []
        for phase, args in (("run", case.args), ("resume", case.resume)):
            if args is None:
                continue
            try:
                proc = run(impl, num_processes, script, args, cwd, env)
            except subprocess.TimeoutExpired as err:
                return Result(case.name, num_processes, "failed", f"{impl} {phase}: ran past {err.timeout}s", outputs)
            (cwd / f"{phase}.log").write_text(proc.stdout + "\n---- stderr\n" + proc.stderr)
            if proc.returncode:
                return Result(case.name, num_processes, "failed",
                              f"{impl} {phase}: rc {proc.returncode}\n{_tail(proc)}", outputs)
            got = printed(proc.stdout)
            if not got:
                return Result(case.name, num_processes, "failed", f"{impl} {phase}: printed no metrics\n"
                              + _tail(proc), outputs)
            lines += [f"[{phase}] {line}" for line in got]
        outputs[impl] = lines
    if outputs["accel"] == outputs["accelerate"]:
        return Result(case.name, num_processes, "equal", "", outputs)
    pairs = zip(outputs["accelerate"], outputs["accel"], strict=False)  # a length difference is reported below
    diff = [f"accelerate: {a}\naccel:      {b}" for a, b in pairs if a != b]
    if len(outputs["accel"]) != len(outputs["accelerate"]):
        diff.append(f"{len(outputs['accelerate'])} lines from accelerate, {len(outputs['accel'])} from accel")
    return Result(case.name, num_processes, "differs", "\n".join(diff[:6]), outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"cases to run (default all: {', '.join(CASES)})")
    parser.add_argument("--num_processes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work", type=Path, help="folder for the stand-ins and runs (default a temp folder)")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="accelerate-examples-run-"))
    examples, reason = examples_dir(work)
    if examples is None:
        print(reason)
        return 2
    env = build_standins(work / "standins")
    failed = 0
    for name in args.names or list(CASES):
        for n in args.num_processes:
            result = compare(CASES[name], n, examples, work / "runs", env)
            failed += result.status != "equal"
            first = next(iter(result.lines.get("accelerate", [])), "")
            print(f"{name:34} {n} proc  {result.status:8} {first}", flush=True)
            if result.detail:
                print("    " + result.detail.replace("\n", "\n    "), flush=True)
    for script, why in NOT_RUN.items():
        print(f"{script}: {why}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
