"""Accelerate compatibility on one process: the shim (`import accelerate` gives accel), data loading that follows
the user's generator (and resumes bit-exactly), Accelerate's sampler and loader arguments, triggers, reduce max/min,
and the state members its scripts use. Accelerate's own test scripts run in tests/multiproc/ecosystem/test_accelerate_scripts.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader

from accel import Accelerator
from accel.data.loading import SeedableRandomSampler, prepare_data_loader


def _order(loader, epochs=2):
    return [[b.tolist() for b in loader] for _ in range(epochs)]


def test_shim_resolves_accelerate_to_accel():
    from accel.shim import PATH

    code = ("import accelerate, accel\n"
            "from accelerate import Accelerator\n"
            "from accelerate.utils import DistributedType, is_cuda_available, set_seed\n"
            "from accelerate.utils.dataclasses import DistributedDataParallelKwargs\n"
            "from accelerate.data_loader import prepare_data_loader\n"
            "from accelerate.state import GradientState, AcceleratorState\n"
            "assert Accelerator is accel.Accelerator and accelerate.Accelerator is accel.Accelerator\n"
            "assert accelerate.__version__ == '1.15.0' != accel.__version__, accelerate.__version__\n"
            "import importlib.metadata as md\n"
            "assert md.version('accelerate') == '1.15.0', md.version('accelerate')\n"
            "import accelerate.utils.operations as ops, accel.runtime.ops\n"
            "assert ops.gather is accel.runtime.ops.gather\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": PATH, "PATH": ""}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_shim_runs_accelerate_modules_with_python_m():
    """`python -m accelerate.commands.launch ...` (how Accelerate's tests and some job scripts launch) runs accel's
    module as __main__ through the shim."""
    from accel.shim import PATH

    out = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--help"],
                         env={"PYTHONPATH": PATH, "PATH": ""}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("usage: accelerate launch"), out.stderr


def test_loader_follows_the_users_generator_set_after_prepare():
    """Accelerate's semantics: the shuffle is the user's DataLoader(shuffle=True, generator=g) order, with g as it is
    when iteration starts (the test scripts seed it after prepare)."""
    data = torch.arange(12)
    generator = torch.Generator()
    prepared = Accelerator(cpu=True).prepare(DataLoader(data, batch_size=4, shuffle=True, generator=generator))
    generator.manual_seed(42)
    expected = _order(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(42)))
    assert _order(prepared) == expected


def test_followed_generator_resumes_bit_exactly():
    data = torch.arange(12)
    generator = torch.Generator().manual_seed(3)
    loader = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True, generator=generator), put_on_device=False)
    first = [b.tolist() for b in loader]  # epoch 0
    running = iter(loader)
    epoch1 = [next(running).tolist()]  # epoch 1 started; a checkpoint is taken here
    state = loader.state_dict()
    epoch1 += [b.tolist() for b in running]  # the rest of epoch 1 in the uninterrupted run
    other = prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator()),
                                put_on_device=False)
    other.load_state_dict(state)
    assert [b.tolist() for b in other] == epoch1 != first


def test_seedable_sampler_arguments():
    data = list(range(10))
    sampler = SeedableRandomSampler(data_source=data, generator=torch.Generator(), num_samples=10, data_seed=5)
    assert sampler.seed == 5
    torch.manual_seed(42)
    assert SeedableRandomSampler(data).seed == 42  # the seed set_seed gave torch, as Accelerate's
    prepared = prepare_data_loader(DataLoader(data, batch_size=1, shuffle=True, generator=torch.Generator()),
                                   use_seedable_sampler=True, put_on_device=False)
    assert isinstance(prepared.batch_sampler.batch_sampler.sampler, SeedableRandomSampler)


def test_triggers_reduce_and_state_members():
    accelerator = Accelerator(cpu=True)
    assert accelerator.check_trigger() is False
    accelerator.set_trigger()
    assert accelerator.check_trigger() is True and accelerator.check_trigger() is False
    t = torch.tensor([1.0, 5.0])
    assert torch.equal(accelerator.reduce(t, "max"), t) and torch.equal(accelerator.reduce(t, "min"), t)
    state = accelerator.state
    assert state.initialized and state.default_device == torch.device("cpu")
    assert accelerator.on_local_process(lambda: 7, local_process_index=0)() == 7
    assert (accelerator.data_parallel_rank, accelerator.tensor_parallel_rank, accelerator.multi_device) == (0, 0, False)
    from accel.state import DistributedType, GradientState  # noqa: F401  (Accelerate's scripts import it from here)

    assert DistributedType.MULTI_NEURON == "MULTI_NEURON"


def test_everyday_helpers(tmp_path, caplog):
    import logging
    import os

    from accel.logging import get_logger
    from accel.utils import find_executable_batch_size, patch_environment, release_memory, write_basic_config

    tried = []

    @find_executable_batch_size(starting_batch_size=64)
    def train(batch_size):
        tried.append(batch_size)
        if batch_size > 16:
            raise RuntimeError("CUDA out of memory. Tried to allocate ...")
        return batch_size

    assert train() == 15 and tried == [64, 57, 51, 45, 40, 36, 32, 28, 25, 22, 19, 17, 15]  # x0.9, as Accelerate
    with patch_environment(accel_probe_value=3):
        assert os.environ["ACCEL_PROBE_VALUE"] == "3"
    assert "ACCEL_PROBE_VALUE" not in os.environ
    a, b = release_memory(torch.ones(2), torch.ones(3))
    assert a is None and b is None
    path = write_basic_config(save_location=str(tmp_path / "basic.yaml"))
    assert path and write_basic_config(save_location=str(tmp_path / "basic.yaml")) is False
    from accel.state import PartialState

    PartialState(cpu=True)  # get_logger needs the state, as in Accelerate
    with caplog.at_level(logging.INFO):
        get_logger("accel.test", "INFO").info("from the main process")
    assert "[RANK 0] from the main process" in caplog.text


@pytest.mark.parametrize("sync_each_batch", [False, True])
def test_sync_each_batch_reduces_on_every_micro_batch(sync_each_batch):
    """GradientAccumulationPlugin(sync_each_batch=True): accumulate() never enters no_sync (gradients reduced every
    micro-batch), while the optimizer still steps once per window."""
    import contextlib

    from accel.utils import GradientAccumulationPlugin

    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(cpu=True, gradient_accumulation_plugin=plugin)
    model = accelerator.prepare(torch.nn.Linear(2, 1))
    entered = []
    accelerator.backend.no_sync = lambda m: (entered.append(m), contextlib.nullcontext())[1]
    syncs = []
    for _ in range(4):
        with accelerator.accumulate(model):
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, True, False, True]
    assert len(entered) == (0 if sync_each_batch else 2)


def test_accelerator_state_members():
    from accel.state import AcceleratorState

    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    state = AcceleratorState()
    assert state is accelerator.state and state.mixed_precision == "bf16"
    assert state.parallelism_config is accelerator.parallelism_config and state.deepspeed_plugin is None
    assert state.device_mesh is None  # one process


def test_shim_version_pinned_through_accel_launch(tmp_path):
    """$ACCEL_ACCELERATE_VERSION pins what `accelerate.__version__` and the distribution metadata answer (the folder
    it needs is written once under the cache); a bad value is one line and exit 2, before any process starts."""
    script = tmp_path / "show.py"
    script.write_text("import importlib.metadata as md, accelerate, accel\n"
                      "print('versions', md.version('accelerate'), accelerate.__version__, accel.__version__)\n")
    env = {**__import__("os").environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "ACCEL_ACCELERATE_VERSION": "1.16.0"}
    cmd = [sys.executable, "-m", "accel.cli.main", "launch", "--accelerate_shim", "--cpu", str(script)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from accel.core.version import __version__

    assert f"versions 1.16.0 1.16.0 {__version__}" in out.stdout, out.stdout
    assert (tmp_path / "cache" / "accel" / "accelerate-shim-1.16.0" / "accelerate-1.16.0.dist-info" / "METADATA").is_file()
    bad = subprocess.run(cmd, env={**env, "ACCEL_ACCELERATE_VERSION": "latest"}, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().count("\n") == 0 and "ACCEL_ACCELERATE_VERSION='latest'" in bad.stderr, bad.stderr


def test_shim_dist_info_matches_its_version():
    import importlib.metadata as md

    from accel.shim import ACCELERATE_VERSION, PATH

    from accel.shim import metadata_text

    found = list(md.distributions(name="accelerate", path=[PATH]))
    assert [d.version for d in found] == [ACCELERATE_VERSION]
    assert found[0].read_text("METADATA") == metadata_text(ACCELERATE_VERSION)
    assert "huggingface" in found[0].metadata["Home-page"]  # sentence-transformers' check of the owner


@pytest.mark.parametrize("kind", ["generator", "global", "seedable"])
def test_checkpoint_on_an_epochs_last_batch_resumes_at_the_next_epoch(kind):
    """A checkpoint taken while the epoch's last batch is processed (where diffusers' scripts and run_glue_no_trainer
    save) resumes at the next epoch, with the order the uninterrupted run draws for it (was: epoch 1 again)."""
    data = torch.arange(12)

    def make(seed):
        generator = torch.Generator().manual_seed(seed) if kind == "generator" else None
        return prepare_data_loader(DataLoader(data, batch_size=4, shuffle=True, generator=generator),
                                   put_on_device=False, use_seedable_sampler=kind == "seedable")

    torch.manual_seed(0)
    loader = make(3)
    epoch0 = [b.tolist() for b in loader]
    state, rng = None, None
    for batch in loader:  # epoch 1: the checkpoint is taken on its last batch
        if loader.end_of_dataloader:
            state, rng = loader.state_dict(), torch.get_rng_state()
    epoch2 = [b.tolist() for b in loader]
    assert state is not None and state["iteration"] == 2 and epoch2 != epoch0
    torch.manual_seed(1)
    resumed = make(99)
    resumed.load_state_dict(state)
    torch.set_rng_state(rng)
    assert [b.tolist() for b in resumed] == epoch2
    assert resumed.iteration == 3


def test_names_consumers_import_from_accelerate_utils(tmp_path):
    """transformers' DeepSpeed integration (HfDeepSpeedConfig, DeepSpeedSchedulerWrapper) and PEFT
    (get_module_class_from_name) import these; tests/accelerate_compat/consumer_imports.py checks every import."""
    import json

    from accel.utils import DeepSpeedSchedulerWrapper, HfDeepSpeedConfig, get_module_class_from_name

    config = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}, "train_batch_size": 8}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    for given in (config, str(path), json.dumps(config)):
        ds = HfDeepSpeedConfig(given)
        assert ds.is_zero3() and not ds.is_zero2() and ds.is_offload()
        assert ds.get_value("zero_optimization.offload_param.device") == "cpu" and ds.get_value("a.b", 5) == 5
        assert ds.is_true("zero_optimization.stage") and not ds.is_false("zero_optimization.stage")
    ds.del_config_sub_tree("zero_optimization.offload_param")
    assert ds.get_value("zero_optimization.offload_param") is None and config["zero_optimization"]["offload_param"]
    with pytest.raises(ValueError, match="Expected a string path"):
        HfDeepSpeedConfig("not json {")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.ReLU()))
    assert get_module_class_from_name(model, "ReLU") is torch.nn.ReLU
    assert get_module_class_from_name(model, "GELU") is None
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    wrapper = DeepSpeedSchedulerWrapper(torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), opt)
    wrapper.step()
    assert opt.param_groups[0]["lr"] == 1.0  # the engine would step it


@pytest.mark.parametrize("exact", [True, False])
def test_exact_resume_chooses_what_load_state_restores(tmp_path, exact):
    """accel's exact resume puts a plain loader back where the checkpoint was taken (its epoch, the order it drew);
    Accelerate's (exact_resume=False, the default under the shim) restores no plain loader, as Accelerate's
    load_state does, and a resumed pass draws from the restored RNG as a fresh one."""
    from accel.data.loading import DataLoaderConfiguration

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(exact_resume=exact))
    loader = accelerator.prepare(DataLoader(torch.arange(12), batch_size=4, shuffle=True))
    [b.tolist() for b in loader]  # epoch 0
    running = iter(loader)
    next(running)
    accelerator.save_state(str(tmp_path / "c"))  # mid-epoch 1
    rest = [b.tolist() for b in running]
    [b.tolist() for b in loader]  # epoch 2
    accelerator.load_state(str(tmp_path / "c"))
    assert loader.iteration == (1 if exact else 3)  # Accelerate's: not restored (epochs 0-2 were read)
    resumed = [b.tolist() for b in accelerator.skip_first_batches(loader, 1)]
    if exact:
        assert resumed == rest
    else:
        assert resumed != rest  # the restored RNG drew this epoch's order afresh, as Accelerate's loader does
    with pytest.raises(ValueError, match="exact_resume='yes'"):
        DataLoaderConfiguration(exact_resume="yes")


def test_seedable_sampler_replaces_the_sampler_inside_a_custom_batch_sampler():
    """Accelerate's prepare (use_seedable_sampler, which transformers' Trainer turns on) puts its seedable sampler
    inside a custom batch sampler too (sentence-transformers' DefaultBatchSampler): the order is then a function of
    (seed, epoch), not the user's generator running on (measured against Accelerate 1.15: the same 3 epochs)."""
    from torch.utils.data import BatchSampler, RandomSampler

    from accel.data.loading import DataLoaderConfiguration
    from accel.utils import set_seed

    class EpochBatchSampler(BatchSampler):
        def set_epoch(self, epoch):
            self.epoch = epoch

    set_seed(42)
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    data = list(range(10))
    batches = EpochBatchSampler(RandomSampler(data, generator=torch.Generator().manual_seed(42)), 4, False)
    loader = accelerator.prepare(DataLoader(data, batch_sampler=batches))
    assert isinstance(batches.sampler, SeedableRandomSampler)
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        orders.append([b.tolist() for b in loader])
    assert orders == [[[2, 6, 1, 8], [4, 5, 0, 9], [3, 7]], [[8, 4, 9, 0], [5, 1, 6, 7], [2, 3]],
                      [[2, 6, 3, 8], [7, 9, 1, 4], [5, 0]]]


_AS_ACCELERATE = r"""
import json, warnings
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as said:
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
set_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.randn(36, 8), batch_size=32)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
losses, gathered = [], []
for _ in range(3):
    for x in data:
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        gathered.append(accelerator.gather_for_metrics(torch.zeros(32)).shape[0])
print(json.dumps({"mode": accelerator.mixed_precision, "scaler": accelerator.scaler is not None, "losses": losses,
                  "gathered": gathered, "said": [str(w.message) for w in said if "fp16" in str(w.message)]}))
"""


@pytest.mark.skipif(__import__("importlib").util.find_spec("accelerate") is None,
                    reason="the real accelerate package (a test extra) is not installed")
def test_the_shim_follows_accelerate_on_cpu_fp16_and_the_last_batch_of_gather_for_metrics():
    """Under `import accelerate`, fp16 on a CPU runs float32 without a scaler (Accelerate turns fp16 on only off the
    CPU; accel ran float16 autocast, ~2e-4 off from the first forward) and says so in one line; gather_for_metrics on
    one process trims a fixed-size value of the last batch to the real samples (36 items, batch 32: 32 then 4; accel
    gave 32 and 32). Same numbers as the real Accelerate 1.15, bit for bit."""
    import json

    from accel.shim import PATH

    def run(pythonpath: str | None) -> dict:
        env = {"PATH": "", **({"PYTHONPATH": pythonpath} if pythonpath else {})}
        out = subprocess.run([sys.executable, "-c", _AS_ACCELERATE], env=env, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    shim, real = run(PATH), run(None)
    assert shim["said"] == ["accel: mixed_precision fp16 on a CPU runs in float32 without loss scaling, as "
                            "Accelerate runs it (it turns fp16 on only off the CPU); bf16 runs half precision on a CPU"]
    assert real["said"] == []
    del shim["said"], real["said"]
    assert shim == real and real["mode"] == "fp16" and not real["scaler"] and real["gathered"] == [32, 4] * 3


def test_accelerator_and_partial_state_are_two_views_of_one_state():
    """`accelerator.state` is an AcceleratorState over PartialState's attributes: a value set through one is read
    through the other, and the errors after `_reset_state()` name the class used, as Accelerate's do."""
    from accel.state import AcceleratorState, PartialState

    accelerator = Accelerator(cpu=True)
    assert type(accelerator.state) is AcceleratorState and AcceleratorState() is accelerator.state
    partial = PartialState()
    accelerator.state.some_value = 3
    assert partial.some_value == 3 and partial.num_processes == accelerator.num_processes == 1
    with pytest.raises(AttributeError, match="^'PartialState' object has no attribute 'other'$"):
        partial.other
    try:
        accelerator.state._reset_state()
        with pytest.raises(AttributeError, match="^`AcceleratorState` object has no attribute `num_processes`. This "
                                                 r"happens if `AcceleratorState._reset_state\(\)` was called"):
            accelerator.num_processes
        with pytest.raises(AttributeError, match=r"if `PartialState._reset_state\(\)`"):
            partial.num_processes
    finally:
        assert Accelerator(cpu=True).num_processes == 1 and partial.num_processes == 1


def test_gradient_state_without_arguments_is_the_current_accelerators():
    from accel.runtime.accumulation import GradientState

    accelerator = Accelerator(cpu=True)
    current = GradientState()
    accelerator.gradient_accumulation_steps = 4
    accelerator.sync_gradients = False
    assert current.num_steps == 4 and current.sync_gradients is False
    assert GradientState(num_steps=2).num_steps == 2 and GradientState().num_steps == 2  # the newest is current
    assert accelerator.gradient_state.num_steps == 4  # each Accelerator keeps its own
    GradientState._reset_state()
    assert GradientState._shared_state == {} and GradientState().num_steps == 1 and current.num_steps == 4
    loader = prepare_data_loader(DataLoader(list(range(4)), batch_size=2))  # built without an Accelerator
    assert loader.gradient_state.__dict__ is GradientState._shared_state


def test_unwrap_model_takes_off_data_parallel_inside_torch_compile():
    model = torch.nn.Linear(2, 4)
    compiled = torch.compile(torch.nn.DataParallel(model))
    accelerator = Accelerator(cpu=True)
    assert accelerator.unwrap_model(compiled, keep_torch_compile=False) is model
    kept = accelerator.unwrap_model(compiled)
    assert kept is not compiled and kept._orig_mod is model and isinstance(compiled._orig_mod, torch.nn.DataParallel)
    own = torch.compile(model)
    assert accelerator.unwrap_model(own) is own


def test_a_pickled_accelerator_with_loaders_pickles_again():
    import pickle

    accelerator = Accelerator(cpu=True)
    accelerator.prepare(DataLoader(list(range(6)), batch_size=2))
    copy = pickle.loads(pickle.dumps(accelerator))
    assert [b.tolist() for b in copy._dataloaders[0]] == [[0, 1], [2, 3], [4, 5]]
    assert pickle.loads(pickle.dumps(copy))._dataloaders[0].batch_size == 2


def test_save_model_brings_offloaded_weights_in(tmp_path):
    from accel.big_modeling import cpu_offload
    from safetensors.torch import load_file

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    cpu_offload(model, execution_device="cpu")
    assert model[0].weight.device.type == "meta"
    Accelerator(cpu=True).save_model(model, str(tmp_path))
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], v) for k, v in expected.items())


def test_a_quantized_model_with_cpu_offload_is_refused():
    model = torch.nn.Linear(2, 2)
    model.is_loaded_in_8bit, model.hf_device_map = True, {"": "cpu"}
    with pytest.raises(ValueError, match="8-bit or 4-bit precision with CPU or disk offload"):
        Accelerator(cpu=True).prepare_model(model)
