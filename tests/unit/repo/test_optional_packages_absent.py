"""Without the optional packages, every `is_*_available()` returns False (never raises), each optional feature asked
for is refused in one line naming its extra, and accel still imports and builds an Accelerator. The test extras
install those packages, so a subprocess hides them from the import system (.ci/minimal_install checks a real venv
without them)."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT

# optional packages accel or Accelerate's probes look for; the required ones (torch, numpy, safetensors, yaml) stay
HIDDEN = ("torchdata", "torchao", "tensorboard", "matplotlib", "peft", "wandb", "mlflow", "transformers", "datasets",
          "deepspeed", "timm", "bitsandbytes", "triton", "accelerate", "tqdm", "rich", "pandas", "comet_ml", "aim",
          "clearml", "dvclive", "swanlab", "trackio", "boto3", "sagemaker", "schedulefree", "lomo_optim", "msamp",
          "transformer_engine", "megatron", "torchvision", "pynvml", "amdsmi", "tensorboardX", "psutil")

SCRIPT = r"""
import importlib.abc, importlib.metadata, json, sys

HIDDEN = set(sys.argv[1].split(","))


class Hide(importlib.abc.MetaPathFinder):
    '''The other finders, blind to the hidden packages (as if they were not installed: find_spec gives None).'''

    def __init__(self, finders):
        self.finders = finders

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HIDDEN:
            return None
        for finder in self.finders:
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                return spec
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        for finder in self.finders:
            for dist in getattr(finder, "find_distributions", lambda *a: ())(context):
                if (dist.metadata["Name"] or "").lower().replace("-", "_") not in HIDDEN:
                    yield dist


for name in list(sys.modules):
    if name.split(".")[0] in HIDDEN:
        del sys.modules[name]
sys.meta_path[:] = [Hide(list(sys.meta_path))]

import accel, accel.utils, accel.utils.imports as imports

found, errors = {}, {}
names = sorted({n for n in [*dir(imports), *accel.utils.__all__] if n.startswith("is_") and n.endswith("_available")})
for name in names:
    probe = getattr(accel.utils, name)
    try:
        found[name] = probe()
    except Exception as exc:
        errors[name] = f"{type(exc).__name__}: {exc}"
import torch
from accel.data_loader import SkipDataLoader
from accel.utils import DataLoaderConfiguration


def refusal(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


# each optional feature asked for: (the extra that brings it, the error), before any Accelerator is built
refused = [
    ("fp8", refusal(lambda: accel.Accelerator(cpu=True, mixed_precision="fp8"))),
    ("torchdata", refusal(lambda: accel.Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)))),
    ("torchdata", refusal(lambda: SkipDataLoader(list(range(8)), batch_size=2, use_stateful_dataloader=True))),
    ("tensorboard", refusal(lambda: accel.Accelerator(cpu=True, log_with="tensorboard", project_dir=sys.argv[2]))),
]
accelerator = accel.Accelerator(cpu=True)
model, optimizer = accelerator.prepare(torch.nn.Linear(4, 2), torch.optim.SGD(torch.nn.Linear(4, 2).parameters()))
leaked = sorted(n for n in sys.modules if n.split(".")[0] in HIDDEN)
print(json.dumps({"found": found, "errors": errors, "leaked": leaked, "refused": refused}))
"""


def test_probes_without_optional_packages(isolated_env, tmp_path):
    proc = subprocess.run([sys.executable, "-c", SCRIPT, ",".join(HIDDEN), str(tmp_path / "runs")], capture_output=True,
                          text=True, timeout=120, cwd=REPO_ROOT, env=isolated_env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["errors"] == {}, result["errors"]
    assert result["leaked"] == [], result["leaked"]
    for name in ("is_torchdata_stateful_dataloader_available", "is_torchdata_available", "is_torchao_available",
                 "is_tensorboard_available", "is_matplotlib_available", "is_peft_available", "is_wandb_available",
                 "is_mlflow_available", "is_transformers_available", "is_fp8_available", "is_rich_available",
                 "is_tqdm_available", "is_bnb_available", "is_datasets_available"):
        assert result["found"][name] is False, name
    assert len(result["found"]) > 40  # every probe was called
    for extra, error in result["refused"]:  # one line naming the extra, never a bare ModuleNotFoundError
        assert f"pip install 'accel-train[{extra}]'" in error and "\n" not in error, (extra, error)
        assert not error.startswith("ModuleNotFoundError"), error
