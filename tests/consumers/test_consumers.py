"""The consumer matrix: libraries built on Accelerate, unchanged, on accel through the shim, each against the real
Accelerate 1.15 running the same script with the same seed, on 1 and 2 CPU processes.

Two Python environments (.ci/consumers builds both): the *shim* one has accel and the consumers but no `accelerate`
package at all (so every `import accelerate` there is accel's shim), the *reference* one has the real
accelerate==1.15.0 and the same consumer versions. Their interpreters come from ACCEL_CONSUMER_SHIM_PYTHON and
ACCEL_CONSUMER_REF_PYTHON; without them this file is skipped.

One launch per (worker, implementation, processes): 4 workers x 2 x 2 = 16 launches, run two at a time, each running
all of its worker's scenarios one after another (process start-up and imports cost more than the tiny runs):
  reference, 1 process   ref-python worker.py
  reference, 2 processes ref-python -m accelerate.commands.accelerate_cli launch --multi_gpu --num_processes 2
                         (ACCELERATE_USE_CPU=true: its `--cpu --num_processes 2` would run one process)
  accel, N processes     shim-python -m accel.cli.main launch --accelerate_shim --cpu --num_processes N
  workers: st_worker.py (sentence-transformers), diffusers_worker.py (train_unconditional's shape), trl_worker.py
  (SFT, DPO, GRPO), no_trainer_worker.py (run_glue_no_trainer's shape); each docstring lists its scenarios.

Compared, per scenario: every record the worker wrote (each logged step's numbers: losses, gradient norms, learning
rates, eval metrics, rewards, EMA decay; the epochs; the checkpoint folders and the files in them), walked as a tree:
the same keys and lengths, strings and flags equal, numbers within rtol 1e-6 (+ atol 1e-7 for values near zero),
timings left out; and every final weight file within atol 1e-6. Measured on 1 and 2 processes where a scenario runs
through: bit-equal (max |diff| 0 for every logged number and weight). Also: the shim environment has no accelerate
package, the reference launches ran every scenario, and diffusers' checkpoints under accel contain the same files and
folders (unet/, unet_ema/, optimizer, scheduler, random states) as under Accelerate."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SHIM = os.environ.get("ACCEL_CONSUMER_SHIM_PYTHON")
REF = os.environ.get("ACCEL_CONSUMER_REF_PYTHON")
if not (SHIM and REF):
    pytest.skip("consumer matrix: ACCEL_CONSUMER_SHIM_PYTHON / ACCEL_CONSUMER_REF_PYTHON not set (.ci/consumers)",
                allow_module_level=True)

HERE = Path(__file__).resolve().parent
WORKERS = {  # family -> (script, scenarios)
    "st": ("st_worker.py", ["mnrl_nodup", "cosine", "triplet", "contrastive"]),
    "diffusers": ("diffusers_worker.py", ["ddpm", "ddpm_accum"]),
    "trl": ("trl_worker.py", ["sft", "sft_completion", "dpo", "grpo"]),
    "no_trainer": ("no_trainer_worker.py", ["epochs", "steps", "accum"]),
}
IMPLS = ("accelerate", "accel")
PROCS = (1, 2)
RTOL, ATOL, WEIGHT_ATOL = 1e-6, 1e-7, 1e-6
TIMEOUT = int(os.environ.get("ACCEL_CONSUMER_TIMEOUT", "300"))  # seconds per launch: a hang fails, never blocks
IGNORED = ("seconds", "impl", "accelerate_version", "runtime", "per_second", "step_time")
HOOK_FOLDERS = ("unet/", "unet_ema/")  # what diffusers' save hook writes into each checkpoint
# each implementation's own checkpoint format beside what the hooks write (a deliberate difference: accel writes
# safetensors + JSON with a checksummed manifest, never pickle, where Accelerate writes optimizer.bin, scheduler.bin
# and random_states_<r>.pkl); compared as "the rest", which must be equal (docs/accelerate_compat.md)
OWN_FORMAT = {"accel": ("accel_checkpoint.json", "rng/", "state/"),
              "accelerate": ("optimizer", "scheduler", "random_states_", "sampler", "scaler.pt")}


def without_own_format(checkpoints: dict, impl: str) -> dict:
    return {name: [f for f in files if not f.startswith(OWN_FORMAT[impl])] for name, files in checkpoints.items()}


def _format_free(record: dict, impl: str) -> dict:
    """A diffusers record with each checkpoint listing reduced to what the hooks and the user wrote."""
    full = record.get("full")
    if not isinstance(full, dict) or not isinstance(full.get("checkpoints"), dict):  # diffusers' {folder: files}
        return record
    return {**record, "full": {**full, "checkpoints": without_own_format(full["checkpoints"], impl)}}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ACCELERATE_", "MASTER_", "TORCHELASTIC"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HOME=str(home), HF_HOME=str(home / "hf"), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", WANDB_DISABLED="true")
    return env


def _command(impl: str, procs: int, script: Path, out: Path) -> tuple[list, dict]:
    args = [str(script), "--out", str(out)]
    if impl == "accel":
        return [SHIM, "-m", "accel.cli.main", "launch", "--accelerate_shim", "--cpu", "--num_processes", str(procs),
                *args], {}
    if procs == 1:
        return [REF, *args], {}
    return [REF, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu", "--num_processes", str(procs),
            "--main_process_port", str(_free_port()), *args], {"ACCELERATE_USE_CPU": "true"}


class Launch:
    """One launch's outcome: its records (those written before it ended), return code, output tail, seconds."""

    def __init__(self, impl: str, procs: int, family: str, root: Path) -> None:
        self.impl, self.procs, self.family = impl, procs, family
        self.out = root / f"{family}-{impl}-{procs}p"
        self.out.mkdir()
        cmd, extra = _command(impl, procs, HERE / WORKERS[family][0], self.out)
        start = time.perf_counter()
        try:
            # run from the output folder: from the checkout's root, `accel` would be its accel/ folder, not the package the shim environment has
            proc = subprocess.run(cmd, cwd=self.out, env={**_env(root / "home"), **extra}, capture_output=True,
                                  text=True, timeout=TIMEOUT, start_new_session=True)
            self.rc, output = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as exc:
            self.rc = "timeout"
            output = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (exc.stdout, exc.stderr))
            output += f"\n[killed after {TIMEOUT} s]"
        self.seconds = time.perf_counter() - start
        self.tail = output[-6000:]
        (self.out / "output.txt").write_text(output)
        records = self.out / "records.json"
        self.records = json.loads(records.read_text()) if records.exists() else {}

    def record(self, scenario: str) -> dict:
        where = f"{self.family}/{scenario} on {self.impl}, {self.procs} process(es)"
        if scenario not in self.records:
            pytest.fail(f"{where}: not reached (launch rc {self.rc}); output tail:\n{self.tail}")
        record = self.records[scenario]
        if "error" in record:
            pytest.fail(f"{where}: {record['error']}\n(launch rc {self.rc}); output tail:\n{self.tail}")
        return record


@pytest.fixture(scope="module")
def launches(tmp_path_factory) -> dict:
    """(impl, procs, family) -> Launch, all 16 launched two at a time, the 2-process ones first."""
    keep = os.environ.get("ACCEL_CONSUMER_KEEP")  # a folder: the launches' outputs are written there and kept
    if keep:
        root = Path(keep).resolve()
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    else:
        root = tmp_path_factory.mktemp("consumers")
    (root / "home").mkdir()
    keys = [(impl, procs, family) for procs in sorted(PROCS, reverse=True) for family in WORKERS for impl in IMPLS]
    with ThreadPoolExecutor(max_workers=int(os.environ.get("ACCEL_CONSUMER_PARALLEL", "2"))) as pool:
        futures = {key: pool.submit(Launch, *key, root) for key in keys}
        done = {key: f.result() for key, f in futures.items()}
    summary = ", ".join(f"{f}-{i}-{p}p {done[(i, p, f)].seconds:.0f}s" for i, p, f in keys)
    print(f"\nconsumer launches: {summary}")
    yield done
    if not keep:
        shutil.rmtree(root, ignore_errors=True)


def _ignored(key: str) -> bool:
    return any(part in key for part in IGNORED)


def compare(mine, theirs, where: str, worst: list) -> None:
    """Walk two records: same structure, equal strings/flags/None, numbers within RTOL/ATOL (worst[0]: the largest
    relative difference seen)."""
    if isinstance(theirs, dict):
        assert isinstance(mine, dict), f"{where}: {mine!r} where Accelerate has a dict"
        keys = {k for k in theirs if not _ignored(k)}
        mine_keys = {k for k in mine if not _ignored(k)}
        assert mine_keys == keys, f"{where}: keys {sorted(mine_keys ^ keys)} differ (accel {sorted(mine_keys)})"
        for k in sorted(keys):
            compare(mine[k], theirs[k], f"{where}.{k}", worst)
    elif isinstance(theirs, list):
        assert isinstance(mine, list) and len(mine) == len(theirs), (
            f"{where}: {len(mine) if isinstance(mine, list) else mine!r} entries, Accelerate {len(theirs)}"
            f"\naccel:      {mine!r}"[:3000] + f"\naccelerate: {theirs!r}"[:3000])
        for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
            compare(a, b, f"{where}[{i}]", worst)
    elif isinstance(theirs, float) or isinstance(mine, float):
        assert isinstance(mine, (int, float)) and isinstance(theirs, (int, float)), f"{where}: {mine!r} vs {theirs!r}"
        if math.isnan(theirs):
            assert math.isnan(mine), f"{where}: {mine} where Accelerate has nan"
            return
        diff = abs(mine - theirs)
        worst[0] = max(worst[0], diff / max(abs(theirs), 1e-30) if diff else 0.0)
        assert diff <= ATOL + RTOL * abs(theirs), f"{where}: accel {mine!r}, Accelerate {theirs!r} (diff {diff:.3g})"
    else:
        assert mine == theirs, f"{where}: accel {mine!r}, Accelerate {theirs!r}"


def compare_weights(mine: Path, theirs: Path, scenario: str, family: str) -> float:
    from safetensors.torch import load_file

    longer = [s for s in WORKERS[family][1] if s != scenario and s.startswith(scenario)]  # ddpm vs ddpm_accum
    files = sorted(p.name for p in theirs.glob(f"{scenario}*.safetensors")
                   if p.name[len(scenario):len(scenario) + 1] in (".", "_") and not p.name.startswith(tuple(longer)))
    assert files, f"no weights from Accelerate for {scenario}"
    worst = 0.0
    for name in files:
        assert (mine / name).exists(), f"{name}: not written on accel"
        a, b = load_file(mine / name), load_file(theirs / name)
        assert a.keys() == b.keys(), f"{name}: tensors {sorted(set(a) ^ set(b))[:10]} differ"
        for k in b:
            assert a[k].shape == b[k].shape, f"{name}:{k}: shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
            diff = float((a[k] - b[k]).abs().max()) if b[k].numel() else 0.0
            assert diff <= WEIGHT_ATOL, f"{name}:{k}: max |diff| {diff:.3g}"
            worst = max(worst, diff)
    return worst


def test_shim_environment_has_no_accelerate():
    """Without the shim on the path, the shim environment finds no `accelerate` (so nothing there runs the real
    one); the reference environment has the real 1.15.0."""
    probe = "import importlib.util as u; s = u.find_spec('accelerate'); print(s.origin if s else None)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    shim = subprocess.run([SHIM, "-c", probe], capture_output=True, text=True, env=env, timeout=60, cwd="/")
    assert shim.returncode == 0 and shim.stdout.strip() == "None", shim.stdout + shim.stderr
    ref = subprocess.run([REF, "-c", "import accelerate; print(accelerate.__version__)"], capture_output=True,
                         text=True, env=env, timeout=60, cwd="/")
    assert ref.stdout.strip() == "1.15.0", ref.stdout + ref.stderr


@pytest.mark.parametrize("procs", PROCS)
@pytest.mark.parametrize("family", list(WORKERS))
def test_reference_runs(launches, family, procs):
    """The harness itself: on the real Accelerate every scenario ran (and it was the real one)."""
    launch = launches[("accelerate", procs, family)]
    for scenario in WORKERS[family][1]:
        record = launch.record(scenario)
        kind = "NO" if procs == 1 else "MULTI_CPU"
        assert (record["impl"], record["accelerate_version"], record["world"], record["num_processes"],
                record["distributed_type"]) == ("accelerate", "1.15.0", procs, procs, kind)
    assert launch.rc == 0, launch.tail


CASES = [(family, procs, s) for family, (_, scenarios) in WORKERS.items() for procs in PROCS for s in scenarios]


@pytest.mark.parametrize("family,procs,scenario", CASES, ids=[f"{f}-{p}p-{s}" for f, p, s in CASES])
def test_matches_accelerate(launches, family, procs, scenario):
    ref = launches[("accelerate", procs, family)]
    theirs = ref.record(scenario)
    mine = launches[("accel", procs, family)].record(scenario)
    # the shim was in use, on that many processes
    assert (mine["impl"], mine["world"], mine["num_processes"]) == ("accel", procs, procs)
    worst = [0.0]
    compare(_format_free(mine, "accel"), _format_free(theirs, "accelerate"), f"{family}/{scenario}", worst)
    weights = compare_weights(launches[("accel", procs, family)].out, ref.out, scenario, family)
    print(f"{family}-{procs}p-{scenario}: logged numbers max rel diff {worst[0]:.3g}, weights max |diff| {weights:.3g}")


@pytest.mark.parametrize("procs", PROCS)
def test_shim_reports_accelerate_version(launches, procs):
    """`accelerate.__version__` under the shim is the version it stands for: diffusers registers its save/load
    hooks only when it is >= 0.16.0, and transformers/TRL check it."""
    record = launches[("accel", procs, "diffusers")].record("ddpm")
    assert record["accelerate_version"] == "1.15.0"


@pytest.mark.parametrize("procs", PROCS)
@pytest.mark.parametrize("scenario", WORKERS["diffusers"][1])
def test_diffusers_checkpoints_contain_the_same(launches, procs, scenario):
    """What `save_state` (main process only) wrote: the same checkpoint folders after rotation, and in each, file by
    file, the same files and folders as under Accelerate (the hooks' unet/ and unet_ema/ included) beside each
    implementation's own format (OWN_FORMAT), which holds the optimizer, scheduler and RNG states in both."""
    theirs_all = launches[("accelerate", procs, "diffusers")].record(scenario)["full"]["checkpoints"]
    mine_all = launches[("accel", procs, "diffusers")].record(scenario)["full"]["checkpoints"]
    for name, files in mine_all.items():  # accel's: its manifest, the state and the main process's RNG states
        assert {"accel_checkpoint.json", "rng/rank_0.json", "rng/rank_0.safetensors"} <= set(files), (name, files)
        assert any(f.startswith("state/") for f in files), (name, files)
    for name, files in theirs_all.items():
        assert {"optimizer.bin", "scheduler.bin", "random_states_0.pkl"} <= set(files), (name, files)
    theirs, mine = without_own_format(theirs_all, "accelerate"), without_own_format(mine_all, "accel")
    assert all({"unet/", "unet_ema/", "unet/diffusion_pytorch_model.safetensors"} <= set(files)
               for files in theirs.values()), theirs
    assert sorted(mine) == sorted(theirs), "the checkpoints kept by the rotation differ"
    for name, files in theirs.items():
        hooks = [f for f in files if f.startswith(HOOK_FOLDERS)]
        assert [f for f in mine[name] if f.startswith(HOOK_FOLDERS)] == hooks, f"{name}: the hooks' folders differ"
        assert mine[name] == files, f"{name}: accel {mine[name]}, Accelerate {files}"
