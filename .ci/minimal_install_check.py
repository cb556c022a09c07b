"""Checks run by .ci/minimal_install inside a venv that has only accel's base dependencies: accel works there, every
probe answers a bool (never raises), and each optional feature is refused in one line naming the extra that
brings it. Prints one line per check; exits 1 naming the failed checks. Not a pytest file (it needs that venv)."""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.metadata
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

# probes of packages this venv lacks: each must answer False (the rest need only answer a bool)
ABSENT_PROBES = ("is_torchao_available", "is_fp8_available", "is_torchdata_available",
                 "is_torchdata_stateful_dataloader_available", "is_tensorboard_available", "is_matplotlib_available",
                 "is_transformers_available", "is_wandb_available", "is_mlflow_available", "is_peft_available",
                 "is_datasets_available", "is_deepspeed_available", "is_tqdm_available", "is_rich_available")
PRESENT_PROBES = ("is_numpy_available", "is_torch_distributed_available")


class CheckFailed(Exception):
    """A check's one-line reason for failing."""


class Checks:
    """Runs named checks, printing `ok` or `FAIL` with a detail line for each, in the order they were given. Those
    given to `start` run two at a time beside the rest (each a subprocess: on 2 cores this halves their wall time)."""

    def __init__(self):
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.started: list[tuple[str, concurrent.futures.Future]] = []

    def run(self, name: str, check, *args) -> None:
        self._report(name, *self._timed(check, *args))

    def start(self, name: str, check, *args) -> None:
        self.started.append((name, self.pool.submit(self._timed, check, *args)))

    def finish(self) -> None:
        for name, future in self.started:
            self._report(name, *future.result())
        self.pool.shutdown()

    @staticmethod
    def _timed(check, *args) -> tuple[bool, str, float]:
        began = time.monotonic()
        try:
            return True, check(*args), time.monotonic() - began
        except CheckFailed as exc:
            return False, str(exc), time.monotonic() - began
        except Exception as exc:  # the check itself broke: still a failure of this check, named
            return False, f"unexpected {type(exc).__name__}: {exc!s:.300}", time.monotonic() - began

    def _report(self, name: str, passed: bool, detail: str, seconds: float) -> None:
        (self.passed if passed else self.failed).append(name)
        print(f"{'ok  ' if passed else 'FAIL'}  {name} ({seconds:.1f} s): {detail}", flush=True)


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement).group(0).lower().replace("_", "-")


def _installed_names() -> set[str]:
    return {(dist.metadata["Name"] or "").lower().replace("_", "-") for dist in importlib.metadata.distributions()}


def declared_extras() -> set[str]:
    return set(importlib.metadata.metadata("accel-train").get_all("Provides-Extra") or ())


# -- the checks ------------------------------------------------------------------------------------------------
def check_import(venv: Path) -> str:
    import accel
    import accel.accelerator  # noqa: F401 (with torch)

    where = Path(accel.__file__).resolve()
    if venv not in where.parents:
        raise CheckFailed(f"accel imported from {where}, not from the venv's install under {venv}")
    return f"accel {accel.__version__} from {where.parent}"


def check_only_base_dependencies() -> str:
    """The venv holds no optional dependency of accel (so the refusals below are real)."""
    requires = importlib.metadata.requires("accel-train") or []
    base = {_name(r) for r in requires if "extra ==" not in r}
    optional = {_name(r) for r in requires if "extra ==" in r} - base
    present = sorted(optional & _installed_names())
    if present:
        raise CheckFailed(f"optional packages installed in the minimal venv: {', '.join(present)}")
    return f"base {', '.join(sorted(base))}; none of the {len(optional)} optional packages"


def probe_names() -> list[str]:
    """Every `is_*_available` accel.utils answers: its names, its lazy table, and the probes' own module."""
    import accel.utils

    names = {*dir(accel.utils), *getattr(accel.utils, "__all__", ()), *getattr(accel.utils, "_LAZY", {})}
    names |= set(dir(inspect.getmodule(accel.utils.is_torchao_available)))
    return sorted(n for n in names if n.startswith("is_") and n.endswith("_available"))


def check_probes() -> str:
    import accel.utils

    names = probe_names()
    if len(names) < 40:
        raise CheckFailed(f"only {len(names)} is_*_available probes found in accel.utils: {names}")
    answers, problems = {}, []
    for name in names:
        try:
            answers[name] = getattr(accel.utils, name)()
        except Exception as exc:
            problems.append(f"{name}() raised {type(exc).__name__}: {exc!s:.120}")
            continue
        if type(answers[name]) is not bool:
            problems.append(f"{name}() returned {answers[name]!r}, not a bool")
    problems += [f"{name}() is {answers.get(name)!r} without its package" for name in ABSENT_PROBES
                 if answers.get(name) is not False]
    problems += [f"{name}() is {answers.get(name)!r}" for name in PRESENT_PROBES if answers.get(name) is not True]
    if problems:
        raise CheckFailed("; ".join(problems))
    return f"{len(names)} probes, each a bool; {sum(answers.values())} True"


def _one_line_naming(message: str, extra: str) -> str:
    install = f"pip install 'accel-train[{extra}]'"
    if extra not in declared_extras():
        raise CheckFailed(f"extra {extra!r} is not in accel's [project.optional-dependencies]")
    if "\n" in message.strip() or "Traceback" in message:
        raise CheckFailed(f"more than one line: {message!r:.400}")
    if install not in message:
        raise CheckFailed(f"does not name {install}: {message!r:.300}")
    return message.strip()


def refused_in_python(extra: str, call) -> str:
    try:
        call()
    except Exception as exc:
        if isinstance(exc, ModuleNotFoundError):
            raise CheckFailed(f"a bare ModuleNotFoundError: {exc}") from None
        return _one_line_naming(f"{type(exc).__name__}: {exc}", extra)
    raise CheckFailed("no error: the feature ran without its package")


def run_accel(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    accel_script = Path(sys.executable).parent / "accel"  # the installed console script
    return subprocess.run([str(accel_script), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, stdin=subprocess.DEVNULL)


def refused_by_cli(extra: str, args: list[str], cwd: Path) -> str:
    proc = run_accel(args, cwd)
    if proc.returncode != 2 or "Traceback" in proc.stdout + proc.stderr:
        raise CheckFailed(f"`accel {' '.join(map(str, args))}` exit {proc.returncode} (expected 2, no traceback): "
                          f"{proc.stderr[-600:]!r}")
    return _one_line_naming(proc.stderr, extra)


def check_env(cwd: Path) -> str:
    proc = run_accel(["env"], cwd)
    if proc.returncode != 0 or "torch" not in proc.stdout.lower():
        raise CheckFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]!r}")
    return f"{len(proc.stdout.splitlines())} lines"


def check_shim_metadata(cwd: Path) -> str:
    """Without the real Accelerate, the shim answers as it: distribution metadata (what transformers, diffusers and
    TRL ask) and `accelerate.__version__`, while accel keeps its own version; the wheel must ship the dist-info."""
    path = subprocess.run([sys.executable, "-m", "accel.shim"], capture_output=True, text=True, timeout=60, cwd=cwd)
    code = ("import importlib.metadata as md, importlib.util, accelerate, accel\n"
            "print(md.version('accelerate'), accelerate.__version__, accel.__version__)")
    env = {**os.environ, "PYTHONPATH": path.stdout.strip()}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)
    from accel.shim import ACCELERATE_VERSION

    found = proc.stdout.split()
    if proc.returncode != 0 or found[:2] != [ACCELERATE_VERSION] * 2 or found[2] == ACCELERATE_VERSION:
        raise CheckFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-600:]!r}")
    if importlib.util.find_spec("accelerate") is not None:
        raise CheckFailed("the real accelerate package is installed in the minimal venv")
    return f"metadata and accelerate.__version__ {found[0]}, accel {found[2]}"


def check_quickstart(examples: Path, project_dir: Path, launch_flags: list[str], processes: int) -> str:
    """README's quickstart through `accel launch` on the embedded default config: it trains and logs its loss."""
    proc = run_accel(["launch", *launch_flags, examples / "quickstart.py", "--project_dir", project_dir],
                     project_dir.parent)
    if proc.returncode != 0:
        raise CheckFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]!r}")
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    if len(epochs) != 3 or not epochs[-1].endswith(f"on {processes} process(es)"):
        raise CheckFailed(f"expected 3 epoch lines on {processes} process(es): {proc.stdout[-600:]!r}")
    logs = sorted(project_dir.rglob("metrics.jsonl"))
    steps = [json.loads(line) for log in logs for line in log.read_text().splitlines() if line.strip()]
    if not any("loss" in json.dumps(step) for step in steps):
        raise CheckFailed(f"no loss logged under {project_dir} (found {[str(p) for p in logs]})")
    return f"{epochs[-1]}; {len(steps)} steps logged"


def check_accelerate_command(examples: Path, project_dir: Path) -> str:
    """An Accelerate user's command with accel alone: `eval "$(accel shim)"`, then `accelerate launch
    --num_processes 2 quickstart.py` (docs/shim.md) trains on 2 processes."""
    bin_dir = Path(sys.executable).parent
    script = (f'eval "$({bin_dir / "accel"} shim)" && accelerate launch --cpu --num_processes 2 '
              f'{examples / "quickstart.py"} --project_dir {project_dir}')
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=180, cwd=project_dir.parent,
                          env=env, stdin=subprocess.DEVNULL)
    epochs = [line for line in proc.stdout.splitlines() if line.startswith("epoch ")]
    if proc.returncode != 0 or not epochs or not epochs[-1].endswith("on 2 process(es)"):
        raise CheckFailed(f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-800:]!r}")
    return epochs[-1]


def check_plot_html(project_dir: Path) -> str:
    out = project_dir.parent / "curves.html"
    proc = run_accel(["plot", project_dir, "-o", out], project_dir.parent)
    if proc.returncode != 0 or not out.is_file():
        raise CheckFailed(f"exit {proc.returncode}: {proc.stderr[-600:]!r}")
    return f"{out.name}, {out.stat().st_size} bytes, without matplotlib"


# -- the features refused --------------------------------------------------------------------------------------
def fp8_accelerator():
    from accel import Accelerator

    Accelerator(cpu=True, mixed_precision="fp8")


def stateful_accelerator():
    from accel import Accelerator
    from accel.utils import DataLoaderConfiguration

    Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True))


def stateful_skip_loader():
    from accel.data_loader import SkipDataLoader

    SkipDataLoader(list(range(8)), batch_size=2, use_stateful_dataloader=True)


def tracker(name: str, project_dir: Path):
    def start():
        from accel import Accelerator

        Accelerator(cpu=True, log_with=name, project_dir=project_dir).init_trackers("minimal")

    return start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=Path, required=True, help="the repo's examples/ folder")
    parser.add_argument("--work", type=Path, required=True, help="an empty folder for runs and outputs")
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True)
    one, two = work / "runs_1", work / "runs_2"
    venv = Path(sys.prefix).resolve()
    events = work / "tb_run"
    events.mkdir()
    (events / "events.out.tfevents.0.host").write_bytes(b"")
    config = work / "config.json"
    config.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))

    checks = Checks()
    # first, alone: the venv was installed without byte-compiling, so this import writes the .pyc files of torch and
    # accel once, instead of each process below compiling them at the same time
    checks.run("import accel", check_import, venv)
    launch_two = ["--cpu", "--num_processes", "2"]
    checks.start("quickstart, 2 processes", check_quickstart, args.examples, two, launch_two, 2)
    checks.start("quickstart, 1 process", check_quickstart, args.examples, one, [], 1)
    checks.start("accel env", check_env, work)
    checks.start("accelerate launch (eval \"$(accel shim)\"), 2 processes", check_accelerate_command, args.examples,
                 work / "runs_accelerate")
    checks.start("shim without Accelerate: metadata and version", check_shim_metadata, work)
    checks.start("refused: accel estimate-memory gpt2", refused_by_cli, "transformers", ["estimate-memory", "gpt2"],
                 work)
    checks.start("refused: accel plan config.json", refused_by_cli, "transformers", ["plan", config], work)
    checks.start("refused: accel launch --mixed_precision fp8", refused_by_cli, "fp8",
                 ["launch", "--cpu", "--mixed_precision", "fp8", args.examples / "quickstart.py"], work)
    checks.start("refused: accel plot (TensorBoard events)", refused_by_cli, "tensorboard", ["plot", events], work)
    checks.run("only base dependencies", check_only_base_dependencies)
    checks.run("is_*_available probes", check_probes)
    checks.run("refused: fp8 (Accelerator)", refused_in_python, "fp8", fp8_accelerator)
    checks.run("refused: stateful loader (DataLoaderConfiguration)", refused_in_python, "torchdata",
               stateful_accelerator)
    checks.run("refused: stateful loader (SkipDataLoader)", refused_in_python, "torchdata", stateful_skip_loader)
    for name in ("tensorboard", "wandb", "mlflow"):
        checks.run(f"refused: log_with={name!r}", refused_in_python, name, tracker(name, work / f"{name}_runs"))
    checks.finish()
    # these read the 1-process quickstart's logs
    checks.run("accel plot -o curves.html", check_plot_html, one)
    checks.run("refused: accel plot -o x.png", refused_by_cli, "plot", ["plot", one, "-o", work / "x.png"], work)

    print(f"minimal_install: {len(checks.passed)} passed, {len(checks.failed)} failed", flush=True)
    if checks.failed:
        print(f"minimal_install: FAILED: {'; '.join(checks.failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
