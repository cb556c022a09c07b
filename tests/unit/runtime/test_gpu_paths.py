"""The GPU paths read as NCCL runs them, checked on the CPU: the default group's backend, CPU offload with a
group made before Accelerator, the NVML probe that keeps forks usable, the expert norm's device on a rank without
expert gradients, and the collective-device check itself (a host tensor sent where NCCL would refuse it fails)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from accel.runtime.state import process_group_backend

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("backend,device,offload,expected", [
    (None, "cuda", False, "nccl"),  # accel's own collectives send device tensors: NCCL alone
    (None, "cuda", True, "cuda:nccl,cpu:gloo"),  # FSDP2's offloaded gradients reduce CPU tensors
    ("nccl", "cuda", True, "cuda:nccl,cpu:gloo"),  # the user's plain nccl would fail on the first clipped step
    ("cuda:nccl", "cuda", True, "cuda:nccl,cpu:gloo"),
    ("gloo", "cuda", True, "gloo"),  # a backend that takes CPU tensors is kept
    (None, "cpu", True, "gloo"),
    ("cuda:nccl,cpu:gloo", "cuda", False, "cuda:nccl,cpu:gloo"),
])
def test_process_group_backend(backend, device, offload, expected):
    assert process_group_backend(backend, device, offload) == expected


def test_offload_refused_in_one_line_when_the_group_lacks_a_cpu_backend(monkeypatch):
    """A GPU job's group made before Accelerator() with plain NCCL cannot reduce offloaded gradients: refused at
    Accelerator(), naming what to do, instead of failing on the first clipped step."""
    import torch.distributed as dist

    from accel.runtime.state import PartialState

    state = object.__new__(PartialState)
    state.__dict__.update(num_processes=2, device=torch.device("cuda", 0), backend="nccl")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl")
    with pytest.raises(ValueError, match=r"CPU offload .* on a cuda job needs a process group with a CPU backend.*"
                                         r"backend 'nccl'; allowed: .*cuda:nccl,cpu:gloo"):
        state.check_cpu_collectives(offload=True)
    state.check_cpu_collectives(offload=False)  # nothing offloaded: nothing needed
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: "cuda:nccl,cpu:gloo")
    state.check_cpu_collectives(offload=True)


def _nvml_recorder(monkeypatch) -> list:
    seen: list = []

    def is_available():
        seen.append(os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))
        return False

    monkeypatch.setattr(torch.cuda, "is_available", is_available)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    return seen


def test_probes_ask_nvml_so_forked_workers_can_use_cuda(monkeypatch, tmp_path):
    """`torch.cuda.is_available()` without NVML initialises the CUDA driver, after which every worker
    notebook_launcher forks fails ("Cannot re-initialize CUDA in forked subprocess"). accel's probe, set_seed and
    write_basic_config (what a notebook calls before launching) and notebook_launcher itself ask through NVML."""
    from accel import launchers
    from accel.compat.environment import write_basic_config
    from accel.core.probes import is_cuda_available
    from accel.core.seeding import set_seed

    seen = _nvml_recorder(monkeypatch)
    assert is_cuda_available() is False
    set_seed(0)
    write_basic_config(save_location=str(tmp_path / "config.yaml"))
    launched: list = []
    monkeypatch.setattr(launchers, "_launch", lambda function, args, cfg, *rest, **kw: launched.append(
        (cfg, kw, os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK"))))
    launchers.notebook_launcher(print, num_processes=2)
    assert seen and set(seen) == {"1"}, seen
    cfg, options, during = launched[0]
    assert cfg.use_cpu is True and options == {"preload": True}
    assert during == "1"  # the whole launch, until the workers are forked, asks NVML
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine: no preloaded imports
    launchers.notebook_launcher(print, num_processes=2)
    assert launched[1][0].use_cpu is False and launched[1][1] == {"preload": False}
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ  # set only while asking


def test_expert_norm_reduces_on_the_job_device_without_expert_gradients(monkeypatch):
    """A rank whose experts got no gradient still takes part in the ep all-reduce, with a tensor on the job's
    device (it fell back to the CPU, which NCCL refuses)."""
    from accel.parallel import expert

    sent: list = []
    monkeypatch.setattr(expert.dist, "all_reduce", lambda tensor, **kw: sent.append(tensor.device))
    layout = expert.ExpertLayout(params={"w": torch.nn.Parameter(torch.ones(2, device="meta"))})
    for norm_type in (2.0, float("inf")):
        expert.expert_norm_power(layout, norm_type, None, torch.device("meta"))
    assert sent == [torch.device("meta")] * 2


CHECK_SCRIPT = """
import os, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo", rank=0, world_size=1)
from accel.core import collective_check as cc
cc.activate(default_has_cpu=False)
device = cc.ACCELERATOR
def attempt(name, fn):
    try:
        fn()
        print(name, "ok")
    except RuntimeError as error:
        print(name, "refused" if "collective-device check" in str(error) else f"error {error}")
on_device = torch.ones(3, device=device)
attempt("device", lambda: dist.all_reduce(on_device))
attempt("derived", lambda: dist.all_reduce((on_device * 2).sum().reshape(1)))
attempt("like", lambda: dist.all_reduce(torch.zeros(1, device=on_device.device)))
attempt("default-device", lambda: dist.all_reduce(torch.tensor([1.0])))
attempt("explicit-cpu", lambda: dist.all_reduce(torch.zeros(1, device=torch.device("cpu"))))
attempt("moved-off", lambda: dist.all_reduce(on_device.cpu()))
attempt("moved-on", lambda: dist.all_reduce(torch.tensor([1.0]).to(device)))
attempt("host-math", lambda: dist.all_reduce(torch.tensor([1.0]) + 1))
attempt("functional", lambda: torch.distributed._functional_collectives.all_reduce(
    torch.tensor([1.0]), "sum", dist.group.WORLD).wait())
attempt("object", lambda: dist.all_gather_object([None], {"a": 1}))
gloo = dist.new_group(backend="gloo")
cc.note_cpu_group(gloo)
attempt("cpu-group", lambda: dist.all_reduce(torch.tensor([1.0]), group=gloo))
print("reported", str(on_device.device), str(torch.tensor([1.0]).device))
cc.set_default_has_cpu(True)
attempt("offload-group", lambda: dist.all_reduce(torch.tensor([1.0])))
dist.destroy_process_group()
"""


def test_collective_device_check_refuses_what_nccl_would(tmp_path):
    """The check the multi-process tests run under (ACCEL_CHECK_COLLECTIVE_DEVICES=cuda): tensors on the pretended
    accelerator pass, a host tensor (no device, "cpu", .cpu(), computed from host tensors) fails in torch's and the
    functional collectives unless the group has a CPU backend; object collectives carry their own bytes."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PORT": str(port), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHECK_SCRIPT)], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    assert lines == {
        "device": "ok", "derived": "ok", "like": "ok", "default-device": "refused", "explicit-cpu": "refused",
        "moved-off": "refused", "moved-on": "ok", "host-math": "refused", "functional": "refused", "object": "ok",
        "cpu-group": "ok", "reported": "cpu:0 cpu", "offload-group": "ok"}, out.stdout + out.stderr


def test_every_collective_in_the_package_goes_through_the_checked_module_functions():
    """The check wraps torch.distributed's functions at call time; a name imported directly (`from
    torch.distributed import all_reduce`) would bypass it, so no module of the package does that."""
    from accel.core.collective_check import _COLLECTIVES

    bypass = []
    for path in (ROOT / "accel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
                names = {alias.name for alias in node.names} & set(_COLLECTIVES)
                if names and node.module in ("torch.distributed", "torch.distributed.distributed_c10d"):
                    bypass.append(f"{path.relative_to(ROOT)}:{node.lineno} {sorted(names)}")
    assert not bypass, bypass


def test_hang_headline_on_one_machine_names_no_missing_rank():
    """Seen on a one-rank NCCL job whose stream a long kernel held (benchmarks/gpu_check.py, hang-report): every rank
    waited in the collective, so on one machine no rank is missing elsewhere; on several, one may be."""
    from accel.cli.hang_report import RankOutcome, headline

    waiting = [RankOutcome(rank=0, local_rank=0, pid=1, exitcode=-6, role="waiting", op="all_reduce")]
    alone = headline([], [], waiting, 15, whole_job=True)
    assert "every rank of the job was in it: the collective itself did not complete" in alone
    assert "another machine" not in alone
    assert "runs on another machine" in headline([], [], waiting, 15, whole_job=False)


def test_background_staging_copies_tensors_with_torch_and_other_leaves_with_python():
    """torch's stager gets plain tensors only (torch 2.11's failed at the second save on an H200, KeyError: <class
    'type'>, on a leaf whose pickle arguments name a class); the other leaves are deep copies made at the save, the
    structure the same, a Parameter staged as a plain tensor."""
    from accel.checkpoint.async_save import BackgroundStager

    class Registered:  # an object of registered state, its class in its pickle arguments
        def __init__(self):
            self.kind, self.values = int, [1, 2]

    stager = BackgroundStager(pinned=False, shared=False)
    try:
        state = {"model": {"w": torch.ones(3), "p": torch.nn.Parameter(torch.zeros(2))},
                 "optimizer": {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}, "kind": int,
                 "object": Registered()}
        for _ in range(2):  # the second save reuses torch's staging buffers
            staged = stager.stage(state).result()
            state["object"].values.append(3)  # changed after the save: the copy keeps the value at the save
            state["model"]["w"].add_(1)
            assert staged["kind"] is int and staged["optimizer"] == {"param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}
            assert staged["object"].values == state["object"].values[:-1]
            assert torch.equal(staged["model"]["w"], state["model"]["w"] - 1)
            assert type(staged["model"]["p"]) is torch.Tensor and torch.equal(staged["model"]["p"], torch.zeros(2))
            stager.close()  # what torch 2.11's async_save does after each save with the stager it was given
            stager._stager.close()  # and a stager closed underneath (its deepcopy table emptied): a new one is made
    finally:
        stager.release()


def test_a_bad_check_variable_is_one_line(monkeypatch):
    from accel.core import collective_check

    monkeypatch.setenv("ACCEL_CHECK_COLLECTIVE_DEVICES", "gpu")
    with pytest.raises(ValueError, match=r"^environment variable ACCEL_CHECK_COLLECTIVE_DEVICES='gpu'; allowed: cuda"):
        collective_check.requested()
    monkeypatch.setenv("ACCEL_CHECK_COLLECTIVE_DEVICES", "")
    assert collective_check.requested() is False
