"""Big-model inference on CPU: empty init, device maps, cpu/disk offload, streaming load_checkpoint_and_dispatch.

Outputs of dispatched models are compared with the plain model's with torch.equal (atol 0): the hooks only
move tensors, the arithmetic is the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from accel import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    init_on_device,
    load_checkpoint_and_dispatch,
)
from accel.checkpoint.model_io import save_state_dict_sharded
from accel.hooks import (
    AlignDevicesHook,
    ModelHook,
    add_hook_to_module,
    remove_hook_from_module,
    remove_hook_from_submodules,
)
from accel.big_model import device_map, modeling
from accel.utils.modeling import (
    clean_device_map,
    compute_module_sizes,
    find_tied_parameters,
    get_balanced_memory,
    get_max_memory,
)
from accel.utils.offload import load_offloaded_weight

D = 32  # width: a Block holds 2 * (D*4D + bias) floats ~ 33 KB


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(D, 4 * D)
        self.down = nn.Linear(4 * D, D)
        self.register_buffer("scale", torch.full((D,), 0.5))

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x))) * self.scale


class Net(nn.Module):
    """Embedding tied to the output head, a stack of blocks, a direct parameter and a non-persistent buffer."""

    def __init__(self, n_blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(50, D)
        self.blocks = nn.ModuleList(Block() for _ in range(n_blocks))
        self.bias = nn.Parameter(torch.zeros(D))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, 50, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("offset", torch.arange(D, dtype=torch.float32) / D, persistent=False)

    def forward(self, ids):
        x = self.embed(ids) + self.bias + self.offset
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def randomized(model: nn.Module) -> nn.Module:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture
def ids():
    return torch.randint(0, 50, (3, 7), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def saved(tmp_path):
    """A randomized Net, its checkpoint folder (several safetensors shards) and its reference output function."""
    torch.manual_seed(0)
    model = randomized(Net())
    folder = tmp_path / "ckpt"
    save_state_dict_sharded(model.state_dict(), folder, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    return model, folder


def empty_net(n_blocks: int = 4) -> Net:
    with init_empty_weights():
        return Net(n_blocks)


def meta_names(model: nn.Module) -> set[str]:
    return {n for n, p in model.named_parameters(remove_duplicate=False) if p.device.type == "meta"}


# --------------------------------------------------------------------------------------------- empty init


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_init_empty_weights_allocates_nothing():
    before = _rss_kb()
    with init_empty_weights():
        big = nn.Sequential(nn.Linear(4096, 8192), nn.Linear(8192, 4096))  # 512 MB in fp32
    grown_mb = (_rss_kb() - before) / 1024
    assert all(p.device.type == "meta" for p in big.parameters())
    assert grown_mb < 64, f"RSS grew by {grown_mb:.0f} MB building a 512 MB model under init_empty_weights"
    assert nn.Module.register_parameter.__qualname__ == "Module.register_parameter"  # patch undone

    model = empty_net()
    assert meta_names(model) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert model.head.weight is model.embed.weight  # ties survive
    assert model.offset.device.type == "cpu" and model.offset[1].item() == 1 / D  # buffers keep their values
    with init_empty_weights(include_buffers=True):
        all_meta = Net()
    assert all(t.device.type == "meta" for t in [*all_meta.parameters(), *all_meta.buffers()])
    with init_on_device("cpu"):
        on_cpu = Net()
    assert all(p.device.type == "cpu" for p in on_cpu.parameters())


# --------------------------------------------------------------------------------------------- dispatch


def test_dict_map_with_cpu_and_disk_matches_plain_model(saved, ids, tmp_path):
    model, folder = saved
    expected = model(ids)
    device_map = {"embed": "cpu", "bias": "disk", "blocks.0": "cpu", "blocks.1": "disk", "blocks.2": "cpu",
                  "blocks.3": "disk", "norm": "disk", "head": "disk"}
    offload = tmp_path / "offload"
    dispatched = load_checkpoint_and_dispatch(empty_net(), folder, device_map=device_map, offload_folder=offload)

    assert dispatched.hf_device_map == device_map
    disk = {n for n in meta_names(dispatched)}
    assert disk == {"blocks.1.up.weight", "blocks.1.up.bias", "blocks.1.down.weight", "blocks.1.down.bias",
                    "blocks.3.up.weight", "blocks.3.up.bias", "blocks.3.down.weight", "blocks.3.down.bias",
                    "norm.weight", "norm.bias", "head.weight", "bias"}  # "bias": a direct parameter of the root
    for _ in range(2):
        assert torch.equal(dispatched(ids), expected)
        assert meta_names(dispatched) == disk  # read for the call, released after it
    assert dispatched.embed.weight.device.type == "cpu"  # tied to the disk head, resident with the embedding
    assert dispatched.blocks[1].scale.device.type == "cpu"  # buffers stay resident without offload_buffers
    # same dtype: nothing copied, the index points into the checkpoint's own shards
    index = json.loads((offload / "index.json").read_text())
    assert set(index) == disk
    assert all(Path(e["safetensors_file"]).parent == folder.resolve() for e in index.values())
    assert not list(offload.glob("*.safetensors"))


def test_auto_with_small_cpu_budget_offloads_to_disk(saved, ids, tmp_path):
    model, folder = saved
    sizes = compute_module_sizes(model)
    budget = sizes["embed"] + 3 * sizes["blocks.0"]  # minus the reserved largest layer: about 2 blocks fit
    dispatched = load_checkpoint_and_dispatch(
        empty_net(), folder, device_map="auto", max_memory={"cpu": budget}, no_split_module_classes=["Block"],
        offload_folder=tmp_path / "offload",
    )
    device_map = dispatched.hf_device_map
    assert set(device_map.values()) == {"cpu", "disk"}
    assert device_map["embed"] == device_map["head"] == "cpu"  # tied: kept together
    assert device_map["blocks.3"] == "disk"
    assert torch.equal(dispatched(ids), model(ids))
    assert "blocks.3.up.weight" in meta_names(dispatched)


def test_disk_offload_writes_converted_and_bin_weights(tmp_path, ids):
    torch.manual_seed(0)
    model = randomized(Net())
    save_state_dict_sharded(model.state_dict(), tmp_path / "bin", max_shard_size="40KB", safe_serialization=False)
    device_map = {"": "disk"}
    dispatched = load_checkpoint_and_dispatch(empty_net(), tmp_path / "bin", device_map=device_map,
                                              offload_folder=tmp_path / "off")
    assert torch.equal(dispatched(ids), model(ids))
    assert (tmp_path / "off" / "blocks.0.up.weight.safetensors").is_file()  # .bin: copied out as safetensors

    save_state_dict_sharded(model.state_dict(), tmp_path / "st", max_shard_size="40KB")
    half = load_checkpoint_and_dispatch(empty_net(), tmp_path / "st", device_map={"": "disk"}, dtype=torch.float16,
                                        offload_folder=tmp_path / "off16")
    index = json.loads((tmp_path / "off16" / "index.json").read_text())
    assert index["blocks.0.up.weight"]["safetensors_file"] == "blocks.0.up.weight.safetensors"  # converted: copied
    stored = load_offloaded_weight(index["blocks.0.up.weight"], tmp_path / "off16")
    assert stored.dtype == torch.float16 and torch.equal(stored, model.blocks[0].up.weight.detach().half())
    half.blocks[0](torch.ones(2, D, dtype=torch.float16))  # runs in float16 with weights read from disk

    with_buffers = load_checkpoint_and_dispatch(empty_net(), tmp_path / "st", device_map={"": "disk"},
                                                offload_folder=tmp_path / "offb", offload_buffers=True)
    assert with_buffers.blocks[0].scale.device.type == "meta"  # buffers offloaded too
    assert torch.equal(with_buffers(ids), model(ids))
    assert with_buffers.blocks[0].scale.device.type == "meta"


def test_dispatch_model_cpu_offload_disk_offload_and_hook_removal(ids, tmp_path):
    torch.manual_seed(0)
    model = randomized(Net())
    expected = model(ids)

    # dispatch a live model: disk entries are written to offload_dir first
    dispatched = dispatch_model(randomized(Net()), {"embed": "cpu", "blocks": "disk", "bias": "cpu", "norm": "cpu",
                                                    "head": "cpu"}, offload_dir=tmp_path / "a")
    assert torch.equal(dispatched(ids), expected)
    assert dispatched.blocks[0].up.weight.device.type == "meta"
    assert (tmp_path / "a" / "blocks.2.down.weight.safetensors").is_file()

    offloaded = cpu_offload(randomized(Net()))
    assert torch.equal(offloaded(ids), expected)
    assert offloaded.blocks[0].up.weight.device.type == "meta"
    remove_hook_from_submodules(offloaded)
    assert "forward" not in offloaded.__dict__ and not hasattr(offloaded, "_hf_hook")
    assert offloaded.blocks[0].up.weight.device.type == "cpu"  # put back from the CPU state dict
    assert torch.equal(offloaded(ids), expected)

    on_disk = disk_offload(randomized(Net()), tmp_path / "b")
    assert meta_names(on_disk) == {n for n, _ in on_disk.named_parameters(remove_duplicate=False)}
    assert torch.equal(on_disk(ids), expected)
    assert torch.equal(on_disk(ids), expected)


def test_single_resident_device_moves_without_hooks(saved, ids):
    model, folder = saved
    loaded = load_checkpoint_and_dispatch(empty_net(), folder, device_map={"": "cpu"})
    assert not hasattr(loaded, "_hf_hook") and loaded.hf_device_map == {"": "cpu"}
    assert torch.equal(loaded(ids), model(ids))
    plain = load_checkpoint_and_dispatch(empty_net(), folder)  # no device_map: loaded on the CPU, no hooks
    assert torch.equal(plain(ids), model(ids)) and not hasattr(plain, "hf_device_map")


def test_hooks_wrap_and_restore_forward():
    calls = []

    class Record(ModelHook):
        def pre_forward(self, module, *args, **kwargs):
            calls.append("pre")
            return (args[0] * 2,), kwargs

        def post_forward(self, module, output):
            calls.append("post")
            return output + 1

    layer = nn.Identity()
    add_hook_to_module(layer, Record())
    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 3.0)) and calls == ["pre", "post"]
    add_hook_to_module(layer, Record(), append=True)
    assert torch.equal(layer(torch.ones(2)), torch.full((2,), 6.0))  # (1*2*2)+1+1
    remove_hook_from_module(layer)
    assert torch.equal(layer(torch.ones(2)), torch.ones(2)) and "forward" not in layer.__dict__

    io = nn.Linear(2, 2)
    add_hook_to_module(io, AlignDevicesHook(execution_device="cpu", io_same_device=True))
    assert io(torch.ones(1, 2)).device.type == "cpu"


def test_set_module_tensor_to_device():
    model = empty_net()
    with pytest.raises(ValueError, match=r"'blocks.0.up.weight' is on the meta device: a value is needed"):
        modeling.set_module_tensor_to_device(model, "blocks.0.up.weight", "cpu")
    value = torch.ones(4 * D, D, dtype=torch.float64)
    modeling.set_module_tensor_to_device(model, "blocks.0.up.weight", "cpu", value=value)
    weight = model.blocks[0].up.weight
    assert isinstance(weight, nn.Parameter) and weight.requires_grad and weight.dtype == torch.float32
    assert torch.equal(weight, value.float())
    modeling.set_module_tensor_to_device(model, "blocks.0.scale", "meta")
    assert model.blocks[0].scale.device.type == "meta"


# --------------------------------------------------------------------------------------------- device maps


def test_tied_parameters_stay_together():
    model = empty_net()
    assert find_tied_parameters(model) == [["embed.weight", "head.weight"]]
    sizes = compute_module_sizes(model)
    assert sizes[""] == sum(p.numel() * 4 for p in model.parameters()) + sum(b.numel() * 4 for b in model.buffers())
    # room for the embedding alone on the CPU but not for it and the head: both go to disk, together
    budget = sizes["embed"] + sizes["blocks.0"] + 100
    device_map = infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    assert device_map.get("head", device_map.get("")) == device_map.get("embed", device_map.get(""))


def test_no_split_module_classes_respected():
    model = empty_net()
    sizes = compute_module_sizes(model)
    budget = sizes["embed"] + int(2.5 * sizes["blocks.0"])
    split = infer_auto_device_map(model, max_memory={"cpu": budget}, clean_result=False)
    assert any(k.count(".") >= 2 for k in split)  # without the constraint a block is cut in two
    whole = infer_auto_device_map(model, max_memory={"cpu": budget}, no_split_module_classes=["Block"])
    assert all(k.count(".") <= 1 for k in whole), whole
    assert set(whole.values()) == {"cpu", "disk"}
    # filled in order: the first blocks on the CPU, the rest on disk; the head goes with its tied embedding
    assert [whole[f"blocks.{i}"] for i in range(4)] == ["cpu", "cpu", "disk", "disk"] or [
        whole[f"blocks.{i}"] for i in range(4)] == ["cpu", "disk", "disk", "disk"]
    assert whole["head"] == whole["embed"] == "cpu"


def test_gpu_maps_sequential_and_balanced(monkeypatch):
    """Two GPUs pretended (placement only, nothing runs): sequential fills GPU 0 first, balanced spreads."""
    monkeypatch.setattr(device_map, "_gpu_count", lambda: 2)
    model = empty_net(8)
    sizes = compute_module_sizes(model)
    budget = {0: sizes[""], 1: sizes[""], "cpu": sizes[""]}
    sequential = infer_auto_device_map(model, max_memory=budget, no_split_module_classes=["Block"])
    assert sequential == {"": 0}
    balanced_memory = get_balanced_memory(model, max_memory=budget, no_split_module_classes=["Block"])
    assert balanced_memory[0] < sizes[""] and balanced_memory[1] == sizes[""]
    balanced = infer_auto_device_map(model, max_memory=balanced_memory, no_split_module_classes=["Block"])
    on = {d: [k for k, v in balanced.items() if v == d] for d in (0, 1)}
    assert on[0] and on[1] and "cpu" not in balanced.values()
    low0 = get_balanced_memory(model, max_memory=budget, no_split_module_classes=["Block"], low_zero=True)
    assert low0[0] < balanced_memory[0]
    # GPU 0 keeps room for the largest layer when something is offloaded to the CPU
    tight = infer_auto_device_map(model, max_memory={0: 4 * sizes["blocks.0"], "cpu": sizes[""]},
                                  no_split_module_classes=["Block"])
    on_gpu = sum(sizes.get(k, 0) for k, v in tight.items() if v == 0)
    assert on_gpu <= 3 * sizes["blocks.0"] and "cpu" in tight.values()


def test_get_max_memory_and_clean_device_map():
    assert get_max_memory({"cpu": "1.5GB", "disk": 10}) == {"cpu": 1_500_000_000, "disk": 10}
    assert get_max_memory({"disk": "2GiB", "cpu": "500MB"}) == {"cpu": 500_000_000, "disk": 2 * 2**30}
    assert set(get_max_memory()) == {"cpu"} and get_max_memory()["cpu"] > 0
    assert clean_device_map({"a.x": "cpu", "a.y": "cpu", "b.x": "disk", "b.y": "cpu"}) == {
        "a": "cpu", "b.x": "disk", "b.y": "cpu"}
    assert clean_device_map({"a": "cpu", "b": "cpu"}) == {"": "cpu"}


# --------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("device_map", "message"),
    [
        ({"embed": "cpu", "blocks": "cpu", "head": "cpu"}, r"leaves 3 key\(s\): bias, norm.weight, norm.bias without a device"),
        ({"": "cuda:7"}, r"device_map\[''\] = 'cuda:7' is not a device this machine has: allowed are 'cpu', 'disk'"),
        ({"": "tpu"}, r"'tpu' is not a known device"),
        ({"": 3}, r"device_map\[''\] = 3 is not a device this machine has.*no GPU"),
        ({"": "cpu", "head": "disk"}, r"keys '' and 'head' overlap"),
        ({"nothing": "cpu"}, r"device_map key 'nothing' names no module"),
        ("fastest", r"device_map='fastest' is not a known strategy: use one of 'auto', 'balanced'"),
    ],
)
def test_bad_device_maps_raise(saved, device_map, message):
    _, folder = saved
    with pytest.raises(ValueError, match=message):
        load_checkpoint_and_dispatch(empty_net(), folder, device_map=device_map)


def test_missing_offload_folder_and_weights_and_bad_sizes_raise(saved, tmp_path):
    model, folder = saved
    with pytest.raises(ValueError, match=r"sends .*blocks.0.up.weight.* to 'disk'.*offload_folder="):
        load_checkpoint_and_dispatch(empty_net(), folder, device_map={"": "disk"})
    with pytest.raises(ValueError, match=r"sends \['blocks'\] to 'disk'.*offload_dir="):
        dispatch_model(randomized(Net()), {"embed": "cpu", "blocks": "disk", "bias": "cpu", "norm": "cpu",
                                           "head": "cpu"})
    partial = {k: v for k, v in model.state_dict().items() if not k.startswith("blocks.2.")}
    save_state_dict_sharded(partial, tmp_path / "partial")
    with pytest.raises(ValueError, match=r"lacks weights .*: 4 key\(s\): blocks.2.up.weight, blocks.2.up.bias"):
        load_checkpoint_and_dispatch(empty_net(), tmp_path / "partial", device_map={"": "cpu"})
    with pytest.raises(ValueError, match=r"max_memory\['cpu'\]: Invalid size '2 gigs'"):
        load_checkpoint_and_dispatch(empty_net(), folder, device_map="auto", max_memory={"cpu": "2 gigs"})
    with pytest.raises(ValueError, match=r"max_memory key 'gpu' = 'gpu' is not a known device"):
        get_max_memory({"gpu": "1GB"})


# --------------------------------------------------------------------------------------------- memory

_PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from torch import nn
    from accel import init_empty_weights, load_checkpoint_and_dispatch

    def status_kb(field):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(1024, 4096) if i % 2 == 0 else nn.Linear(4096, 1024) for i in range(8)])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status_kb("VmRSS")
    model = load_checkpoint_and_dispatch(model, sys.argv[1], device_map="auto", max_memory={"cpu": "40MB"},
                                         offload_folder=sys.argv[2])
    load_peak = status_kb("VmHWM") - before
    with torch.no_grad():  # with autograd on, the graph would keep every streamed weight alive
        out = model(torch.ones(2, 1024))  # touches every weight: safetensors maps tensors lazily
    peak = status_kb("VmHWM") - before
    print(json.dumps({"load_peak_kb": load_peak, "peak_kb": peak, "map": model.hf_device_map,
                      "finite": bool(torch.isfinite(out).all())}))
""")


def test_streaming_load_peak_memory_below_model_size(tmp_path):
    """A 134 MB model in 8 safetensors shards, 40 MB CPU budget: loading it and running one forward (which reads
    every offloaded weight once) grow RSS (VmHWM, file pages included) by far less than the model's size."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak-RSS counter")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = nn.Sequential(*[nn.Linear(1024, 4096) if i % 2 == 0 else nn.Linear(4096, 1024) for i in range(8)])
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    save_state_dict_sharded(model.state_dict(), tmp_path / "ckpt", max_shard_size="20MB")
    del model
    result = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "ckpt"), str(tmp_path / "off")],
                            check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["map"].values()) == {"cpu", "disk"} and report["finite"]
    peak = report["peak_kb"] * 1024  # measured here: ~38 MB (one resident and one streamed 16.8 MB layer)
    assert report["load_peak_kb"] <= report["peak_kb"]
    assert peak < model_bytes / 2, f"peak grew RSS by {peak / 1e6:.0f} MB for a {model_bytes / 1e6:.0f} MB model"


def test_cpu_offload_with_hook_keeps_the_model_on_the_execution_device_until_offload():
    """Accelerate's cpu_offload_with_hook: the model waits on the CPU, moves to the execution device at its forward
    and stays there; the hook's offload() brings it back; a later model's forward offloads the previous one first."""
    from accel import cpu_offload_with_hook

    torch.manual_seed(0)
    first, second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    x = torch.randn(2, 3)
    expected = first(x)
    first, hook1 = cpu_offload_with_hook(first, "cpu")
    assert torch.equal(first(x), expected) and first.weight.device.type == "cpu"
    calls = []
    hook1.offload = lambda: calls.append("offload")  # the CPU has no second device to come back from
    hook1.model.to("meta")  # as if the first model still sat on the execution device
    second, hook2 = cpu_offload_with_hook(second, "meta", prev_module_hook=hook1)
    out = second(torch.randn(2, 3))
    assert calls == ["offload"] and out.device.type == "meta" and second.weight.device.type == "meta"
    hook2.remove()
    assert not hasattr(second, "_hf_hook")


# --------------------------------------------------------------------------------------------- Accelerate 1.15 names
# Each is compared with the real Accelerate's function on the same input where it is installed.

def _real(name: str):
    """The real Accelerate's function (this test runs without the shim), or a skip."""
    accelerate = pytest.importorskip("accelerate")
    from accel.shim import PATH

    if Path(accelerate.__file__).resolve().is_relative_to(Path(PATH).resolve()) or accelerate.__name__ != "accelerate":
        pytest.skip("the shim is on: no real Accelerate to compare with")
    import accelerate.utils.modeling as real_modeling

    return getattr(real_modeling, name)


class Small(nn.Module):
    """Accelerate's planning example shape: 64 + 72 + 100 bytes of parameters, plus buffers."""

    def __init__(self):
        super().__init__()
        self.linear1 = nn.Linear(3, 4)
        self.batchnorm = nn.BatchNorm1d(4)
        self.linear2 = nn.Linear(4, 5)


def _planning_cases():
    tied = nn.Sequential(*[Small() for _ in range(3)])
    tied[2].linear2.weight = tied[0].linear2.weight
    buffers = Small()
    buffers.linear1.register_buffer("b1", torch.zeros(10, 2))
    buffers.batchnorm.register_buffer("b2", torch.zeros(10, 3))
    buffers.linear2.register_buffer("b3", torch.zeros(10, 3))
    nested = nn.Sequential(nn.Sequential(nn.Linear(10, 4), nn.Linear(4, 4), nn.Linear(4, 8)))
    return [
        (Small(), dict(max_memory={0: 200, 1: 200})),
        (Small(), dict(max_memory={0: 200, 1: 172, 2: 200})),
        (nn.Sequential(Small(), Small(), Small()), dict(max_memory={0: 500, 1: 500})),
        (nn.Sequential(Small(), Small(), Small()),
         dict(max_memory={0: 500, 1: 500}, no_split_module_classes=["Small"])),
        (tied, dict(max_memory={0: 400, 1: 500})),
        (buffers, dict(max_memory={0: 400, "cpu": "1GB"})),
        (buffers, dict(max_memory={0: 400, "cpu": "1GB"}, offload_buffers=True)),
        (nested, dict(max_memory={0: 256})),
        (nested, dict(max_memory={0: 256}, fallback_allocation=True)),
        (nn.Sequential(Small(), Small()), dict(max_memory={"cpu": 300}, fallback_allocation=True)),
        (Net(), dict(max_memory={"cpu": 40_000}, no_split_module_classes=["Block"])),
        (Net(), dict(max_memory={0: 30_000, "cpu": 60_000}, dtype=torch.float16)),
    ]


@pytest.mark.parametrize("case", range(len(_planning_cases())))
def test_infer_auto_device_map_matches_accelerate(case):
    """Same map, and the same offloaded-buffer warning (or none), as Accelerate for GPU indices this CPU machine
    lacks (planning only), tied weights, buffers, no-split classes, dtypes and fallback_allocation."""
    real = _real("infer_auto_device_map")
    model, kwargs = _planning_cases()[case]
    results = []
    for function in (real, infer_auto_device_map):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            device_map = function(model, **dict(kwargs, max_memory=dict(kwargs["max_memory"])))
        buffer_warnings = [str(w.message) for w in caught if "offload_buffers" in str(w.message)]
        results.append((dict(device_map), len(buffer_warnings)))
    assert results[1] == results[0]


def test_small_planning_helpers_match_accelerate():
    model = Small()
    model.linear1.register_buffer("extra", torch.zeros(10, 10))
    model.register_buffer("top", torch.zeros(20, 10), persistent=False)
    model.batchnorm.register_buffer("scratch", torch.zeros(3), persistent=False)
    real_total = _real("compute_module_total_buffer_size")
    expected = 4 * (100 + 200 + 3 + 4 + 4) + 8  # the three buffers added, BatchNorm's statistics and counter
    assert modeling.compute_module_total_buffer_size(model) == real_total(model) == expected
    real_np = _real("get_non_persistent_buffers")
    for recurse in (False, True):
        assert modeling.get_non_persistent_buffers(model, recurse=recurse) == real_np(model, recurse=recurse)
    assert modeling.get_non_persistent_buffers(model, recurse=True, fqns=True) == {"top", "batchnorm.scratch"}
    assert model.batchnorm._non_persistent_buffers_set == {"scratch"}  # the module's own set is untouched

    layers = nn.ModuleList([nn.Linear(10, 10) for _ in range(12)])
    for i in range(1, 12):
        layers[i].weight = layers[i - 1].weight
    sizes = {"": 12 * 440, **{f"{i}": 440 for i in range(12)}, **{f"{i}.weight": 400 for i in range(12)},
             **{f"{i}.bias": 40 for i in range(12)}}  # every alias sized, as infer_auto_device_map's callers may
    queue = list(layers.named_children())[1:]
    ties = sorted(f"{i}.weight" for i in range(12))[1:]  # "1" must not take "10.weight"
    ours = modeling.get_module_size_with_ties(ties, sizes["0"], sizes, queue)
    assert ours == _real("get_module_size_with_ties")(ties, sizes["0"], sizes, queue)
    assert ours[0] == 440 + 11 * 40 and ours[1] == [str(i) for i in sorted(range(1, 12), key=str)]
    for model, no_split in ((Net(), ["Block"]), (Net(), []), (nn.Sequential(Small(), Small()), ["Small"])):
        modules, sizes = list(model.named_children()), compute_module_sizes(model)
        assert modeling.get_max_layer_size(modules, sizes, no_split) == _real("get_max_layer_size")(
            modules, sizes, no_split)


def test_get_max_memory_and_check_device_map_plan_for_absent_gpus(caplog):
    """As Accelerate: size strings are converted in the caller's dict (transformers compares them as ints after),
    a GPU index this machine lacks is planned for with a warning, and check_device_map only warns about keys
    that name nothing. Dispatching to that GPU still fails with one clear line."""
    asked = {0: "1KB", "cpu": "2KB"}
    with caplog.at_level("WARNING"):
        assert get_max_memory(asked) == {0: 1000, "cpu": 2000}
    assert asked == {0: 1000, "cpu": 2000} and "Device 0 is not available" in caplog.text
    model = Small()
    modeling.check_device_map(model, {"": 0})
    modeling.check_device_map(model, {"linear1": 0, "linear2": 1, "batchnorm": 1})
    with pytest.warns(UserWarning, match=r"do not match any submodules.*'nothing'"):
        modeling.check_device_map(model, {"": "cpu", "nothing": 0})
    with pytest.raises(ValueError, match=r"leaves .*batchnorm.weight.* without a device"):
        modeling.check_device_map(model, {"linear1": 0, "linear2": 1})
    with pytest.raises(ValueError, match=r"device_map\['linear1'\] = 0 is not a device this machine has"):
        dispatch_model(model, {"linear1": 0, "linear2": "cpu", "batchnorm": "cpu"})


def test_get_state_dict_offloaded_model_gathers_cpu_and_disk_weights(tmp_path):
    for offload in ("cpu", "disk"):
        torch.manual_seed(0)
        model = Net()
        expected = {k: v.clone() for k, v in model.state_dict().items()}
        if offload == "cpu":
            cpu_offload(model, execution_device="cpu")
        else:
            disk_offload(model, tmp_path / "off", execution_device="cpu")
            assert model.head.weight.device.type == "meta"
        got = modeling.get_state_dict_offloaded_model(model)
        top = {k for k in expected if "." not in k}  # the root's own tensors: Accelerate's walk skips the root
        assert set(got) == set(expected) - top
        assert all(torch.equal(got[k], expected[k]) and got[k].device.type == "cpu" for k in got)


def test_layerwise_casting_hooks_match_accelerate():
    """Weights are stored in bfloat16 between calls and cast to float32 for the forward; skipped names keep float32.
    The outputs equal the real Accelerate's hooks on a copy of the same model."""
    import copy

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)),
                         nn.Linear(16, 4))
    x = torch.randn(3, 8)
    ours, theirs = copy.deepcopy(base), copy.deepcopy(base)
    from accel.big_modeling import attach_layerwise_casting_hooks

    attach_layerwise_casting_hooks(ours, torch.bfloat16, torch.float32, skip_modules_pattern=["^3$"])
    real = pytest.importorskip("accelerate.big_modeling")
    _real("infer_auto_device_map")  # skips under the shim
    real.attach_layerwise_casting_hooks(theirs, torch.bfloat16, torch.float32, skip_modules_pattern=["^3$"])
    assert ours[0].weight.dtype == ours[2][0].weight.dtype == torch.bfloat16
    assert ours[3].weight.dtype == ours[2][1].weight.dtype == torch.float32  # skipped / not a Linear or Conv
    rounded = copy.deepcopy(base)  # what the forward must compute: bfloat16-rounded weights, float32 arithmetic
    for layer in (rounded[0], rounded[2][0]):
        for p in layer.parameters():
            p.data = p.data.to(torch.bfloat16).float()
    out = ours(x)
    assert ours[0].weight.dtype == torch.bfloat16  # back to storage after the call
    assert out.dtype == torch.float32 and torch.equal(out, rounded(x)) and torch.equal(out, theirs(x))
    assert not torch.equal(out, base(x))  # the rounding is visible: the comparison can fail


def test_load_checkpoint_in_model_accelerate_order_and_unused_keys(tmp_path, caplog):
    """device_map is the third positional argument, as in Accelerate, and unused checkpoint keys are logged with
    Accelerate's wording (strict: an error)."""
    from accel.utils.modeling import load_checkpoint_in_model

    torch.manual_seed(0)
    model = Small()
    state = dict(model.state_dict(), foo=torch.rand(4, 5))
    torch.save(state, tmp_path / "w.pt")
    fresh = Small()
    with caplog.at_level("WARNING"):
        missing, unexpected = load_checkpoint_in_model(fresh, tmp_path / "w.pt", {"": "cpu"})
    assert (missing, unexpected) == ([], ["foo"]) and "were not used when initializing Small" in caplog.text
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
    with pytest.raises(RuntimeError, match="unexpected keys.*foo"):
        load_checkpoint_in_model(Small(), tmp_path / "w.pt", strict=True)
    with pytest.raises(ValueError, match="keep_in_fp32_modules=.*not supported"):
        load_checkpoint_in_model(Small(), tmp_path / "w.pt", keep_in_fp32_modules=["linear1"])


def test_offload_index_paths_relative_to_the_working_directory(tmp_path, monkeypatch):
    """transformers' from_pretrained records `safetensors_file` as given (a relative checkpoint folder, or its own
    offload folder joined to a relative name): such an entry is read from the working directory, as Accelerate
    reads it; accel's own entries (names inside the offload folder) still resolve there."""
    from safetensors.torch import save_file

    monkeypatch.chdir(tmp_path)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "off").mkdir()
    save_file({"w": torch.arange(4.0)}, "ckpt/model.safetensors")
    save_file({"v": torch.ones(2)}, "off/v.safetensors")
    from_cwd = {"safetensors_file": "ckpt/model.safetensors", "weight_name": "w", "dtype": "float32"}
    inside = {"safetensors_file": "v.safetensors", "weight_name": "v", "dtype": "float32"}
    assert torch.equal(load_offloaded_weight(from_cwd, "off"), torch.arange(4.0))
    assert torch.equal(load_offloaded_weight(inside, "off"), torch.ones(2))
    with pytest.raises(FileNotFoundError, match="'off/nope.safetensors' is missing"):
        load_offloaded_weight({"safetensors_file": "nope.safetensors", "weight_name": "x"}, "off")


def test_load_checkpoint_in_model_reads_a_bare_shard_index(tmp_path):
    """Accelerate's sharded layout without "weight_map" (a bare name -> file index, any `*.index.json` name), given
    as the index or its folder, with and without a device map; keys no shard holds are missing."""
    from accel.utils.modeling import load_checkpoint_in_model

    torch.manual_seed(0)
    model = Small()
    index = {k: f"part_{k.split('.')[0]}.bin" for k in model.state_dict()}
    for file in set(index.values()):
        torch.save({k: v for k, v in model.state_dict().items() if index[k] == file}, tmp_path / file)
    (tmp_path / "weight_map.index.json").write_text(json.dumps(index))
    for checkpoint in (tmp_path / "weight_map.index.json", tmp_path):
        fresh = Small()
        assert load_checkpoint_in_model(fresh, checkpoint) == ([], [])
        assert all(torch.equal(fresh.state_dict()[k], v) for k, v in model.state_dict().items())
        with init_empty_weights():
            empty = Small()
        load_checkpoint_in_model(empty, checkpoint, {"linear1": "cpu", "batchnorm": "disk", "linear2": "cpu"},
                                 offload_folder=tmp_path / "off")
        assert empty.batchnorm.weight.device.type == "meta" and torch.equal(empty.linear2.bias, model.linear2.bias)
        assert torch.equal(load_offloaded_weight(json.loads((tmp_path / "off" / "index.json").read_text())[
            "batchnorm.weight"], tmp_path / "off"), model.batchnorm.weight)
    (tmp_path / "weight_map.index.json").write_text(json.dumps({k: v for k, v in index.items() if "linear2" not in k}))
    with init_empty_weights():
        empty = Small()
    with pytest.raises(ValueError, match=r"lacks weights .*linear2.weight, linear2.bias"):
        load_checkpoint_in_model(empty, tmp_path, {"": "cpu"})
    with pytest.raises(RuntimeError, match=r"missing keys 2 key\(s\): linear2.weight, linear2.bias\.$"):
        load_checkpoint_in_model(Small(), tmp_path, strict=True)
