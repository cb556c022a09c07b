"""Accelerator members Accelerate scripts use, on one process: save/load_state pre-hooks, profile, verify_device_map
(and prepare of a device-mapped model), and the torch_tp_plugin / deepspeed_plugins arguments. Where it runs on a
CPU, the real Accelerate 1.15 does the same steps in a subprocess and the observable results are compared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from accel import Accelerator, DeepSpeedPlugin, ParallelismConfig
from accel.checkpoint import layout
from accel.checkpoint.layout import CheckpointError
from accel.config import ConfigError
from accel.config.kwargs import ProfileKwargs
from accel.config.plugins import TorchTensorParallelPlugin, tp_plugin_layer


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG", "ACCELERATE_BYPASS_DEVICE_MAP"):
        monkeypatch.delenv(name, raising=False)


def net(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def prepared(n_models: int = 1):
    """An Accelerator with `n_models` models, each with its SGD optimizer."""
    accelerator = Accelerator(cpu=True)
    models = [net(i) for i in range(n_models)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    objects = accelerator.prepare(*models, *optimizers)
    objects = objects if isinstance(objects, tuple) else (objects,)
    return accelerator, list(objects[:n_models]), list(objects[n_models:])


def snapshot(model) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def scramble(*models) -> None:
    with torch.no_grad():
        for model in models:
            for p in model.parameters():
                p.fill_(7.0)


# -- save_state / load_state pre-hooks --------------------------------------------------------------------------

def test_save_hook_that_saves_a_model_itself_skips_its_weights_and_load_hook_restores_it(tmp_path):
    """diffusers' pattern: the save hook writes the model its own way into output_dir and pops its weights; the
    load hook pops the model and loads it from there. The file is part of the published checkpoint."""
    accelerator, (model,), _ = prepared()
    seen = {}

    def save_hook(models, weights, output_dir):
        seen["save"] = (models, [sorted(w) for w in weights], output_dir)
        save_file({k: v.contiguous() for k, v in models[0].state_dict().items()},
                  os.path.join(output_dir, "own_model.safetensors"))
        weights.pop()

    def load_hook(models, input_dir):
        seen["load"] = (list(models), input_dir)
        models.pop().load_state_dict(load_file(os.path.join(input_dir, "own_model.safetensors")))

    save_handle = accelerator.register_save_state_pre_hook(save_hook)
    load_handle = accelerator.register_load_state_pre_hook(load_hook)
    assert isinstance(save_handle, torch.utils.hooks.RemovableHandle)
    expected = snapshot(model)
    out = tmp_path / "ckpt"
    accelerator.save_state(str(out))

    models, weight_keys, output_dir = seen["save"]
    assert models == [model] and weight_keys == [sorted(model.state_dict())]
    assert isinstance(output_dir, str) and (out / "own_model.safetensors").is_file()
    manifest = layout.read_manifest(out)  # the hook's file is listed (size-checked) like the others
    assert manifest["skeleton"]["models"] == [] and "own_model.safetensors" in manifest["files"]

    scramble(model)
    accelerator.load_state(str(out))
    assert seen["load"] == ([model], str(out))
    for key, value in snapshot(model).items():
        assert torch.equal(value, expected[key]), key

    load_handle.remove()  # without the load hook the checkpoint lacks the model's weights
    with pytest.raises(CheckpointError, match=r"holds 0 models but 1 were prepared/registered \(after the pre-hooks"):
        accelerator.load_state(str(out))
    save_handle.remove()
    seen.clear()
    accelerator.save_state(str(tmp_path / "plain"))
    assert "save" not in seen and len(layout.read_manifest(tmp_path / "plain")["skeleton"]["models"]) == 1


def test_hooks_skip_one_of_two_models_by_position(tmp_path):
    """Accelerate's semantics are positional: what is left in `weights` is saved, in order, and loaded into what is
    left in `models`."""
    accelerator, (first, second), _ = prepared(2)
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.pop(0))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.pop(0))
    first_before, second_before = snapshot(first), snapshot(second)
    accelerator.save_state(str(tmp_path / "ckpt"))
    scramble(first, second)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(v, second_before[k]) for k, v in snapshot(second).items())  # loaded
    assert all(torch.all(v == 7.0) for v in snapshot(first).values())  # skipped
    assert first_before  # (the first model's weights were never written)


def test_save_hook_can_change_what_is_saved(tmp_path):
    accelerator, (model,), _ = prepared()

    def zero_the_first_bias(models, weights, output_dir):
        weights[0]["0.bias"] = torch.zeros_like(weights[0]["0.bias"])

    accelerator.register_save_state_pre_hook(zero_the_first_bias)
    before = snapshot(model)
    accelerator.save_state(str(tmp_path / "ckpt"))
    assert torch.equal(model[0].bias, before["0.bias"])  # the live model is untouched
    scramble(model)
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert torch.equal(model[0].bias, torch.zeros(4)) and torch.equal(model[0].weight, before["0.weight"])


# -- profile ------------------------------------------------------------------------------------------------------

def test_profile_writes_a_chrome_trace_per_process(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(net(0))
    trace_dir = tmp_path / "traces"
    with accelerator.profile(ProfileKwargs(activities=["cpu"], record_shapes=True,
                                           output_trace_dir=str(trace_dir))) as prof:
        model(torch.randn(5, 3))
    assert [p.name for p in trace_dir.iterdir()] == ["profile_0.json"]  # Accelerate's PROFILE_PATTERN_NAME
    events = json.loads((trace_dir / "profile_0.json").read_text())["traceEvents"]
    assert any(str(e.get("name", "")).startswith("aten::") for e in events)
    assert prof.key_averages()  # the yielded profiler is torch's


def test_profile_uses_the_handler_from_kwargs_handlers_and_its_schedule(tmp_path):
    ready = []
    handler = ProfileKwargs(schedule_option={"wait": 1, "warmup": 1, "active": 1}, on_trace_ready=ready.append)
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    assert accelerator.profile_handler is handler
    with accelerator.profile() as prof:
        for _ in range(4):
            torch.randn(8, 8) @ torch.randn(8, 8)
            prof.step()
    assert ready == [prof]  # wait, warmup, then one active step, handed over once
    with accelerator.profile(ProfileKwargs(output_trace_dir=str(tmp_path / "other"))):  # an override wins
        torch.randn(2) + 1
    assert (tmp_path / "other" / "profile_0.json").is_file() and len(ready) == 1


def test_profile_kwargs_refuses_an_unknown_activity_and_is_exported():
    import accel.utils
    import accel.utils.dataclasses

    with pytest.raises(ValueError, match=r"ProfileKwargs: argument 'activities': bad value 'tpu'; allowed: cpu, cuda"):
        ProfileKwargs(activities=["tpu"]).build()
    assert accel.utils.ProfileKwargs is ProfileKwargs is accel.utils.dataclasses.ProfileKwargs
    assert accel.utils.TorchTensorParallelPlugin is TorchTensorParallelPlugin
    assert accel.utils.dataclasses.TorchTensorParallelPlugin is TorchTensorParallelPlugin
    assert ProfileKwargs(with_flops=True).to_kwargs() == {"with_flops": True}


# -- verify_device_map ----------------------------------------------------------------------------------------

def mapped(device_map: dict, on=None) -> torch.nn.Module:
    model = net(0)
    (on or model).hf_device_map = device_map
    return model


def test_verify_device_map_is_accelerates_test():
    accelerator = Accelerator(cpu=True)
    assert not accelerator.verify_device_map(net(0))
    assert not accelerator.verify_device_map(mapped({"": "cpu"}))
    assert accelerator.verify_device_map(mapped({"0": "cpu", "1": "disk"}))
    assert accelerator.verify_device_map(mapped({"0": 0, "1": 0}))  # entries are counted, as Accelerate does
    model = net(0)
    assert accelerator.verify_device_map(mapped({"0": "cpu", "1": "cpu"}, on=model[1]) and model)  # a submodule


def test_prepare_keeps_a_dispatched_model_as_its_map_placed_it(tmp_path):
    """A model whose offloaded weights wait on the meta device is neither moved nor materialized by prepare (which
    would give it uninitialized weights); Accelerate also leaves it alone on one process."""
    from accel.big_modeling import dispatch_model

    model, x = net(0), torch.randn(3, 3)
    expected = model(x)
    model = dispatch_model(model, device_map={"0": "cpu", "1": "disk"}, offload_dir=str(tmp_path / "offload"))
    prepared_model = Accelerator(cpu=True).prepare(model)
    assert prepared_model is model and model[1].weight.device.type == "meta"
    assert torch.allclose(prepared_model(x), expected)


def test_prepare_refuses_a_device_mapped_model_on_several_processes(monkeypatch):
    accelerator = Accelerator(cpu=True)
    monkeypatch.setattr(Accelerator, "use_distributed", property(lambda self: True))
    with pytest.raises(ValueError, match=r"prepare: You can't train a model that has been loaded with "
                                         r"`device_map='auto'` in any distributed mode \(1 processes\); allowed: one"):
        accelerator.prepare(mapped({"0": "cpu", "1": "cpu"}))
    accelerator.prepare(net(0))  # an ordinary model is fine
    monkeypatch.setenv("ACCELERATE_BYPASS_DEVICE_MAP", "true")  # Accelerate's way out
    accelerator.prepare(mapped({"0": "cpu", "1": "cpu"}))


# -- torch_tp_plugin / deepspeed_plugins ------------------------------------------------------------------------

def test_torch_tp_plugin_is_tp_size_under_parallelism_config():
    plugin = TorchTensorParallelPlugin(tp_size=2)
    with pytest.warns(FutureWarning):
        layer = tp_plugin_layer({}, plugin)
    assert layer == {"parallelism": {"tp_size": 2}}
    given = {"parallelism": {"tp_size": 1, "pp_size": 1}}  # parallelism_config= wins, as in Accelerate
    with pytest.warns(FutureWarning):
        layer = tp_plugin_layer(given, plugin)
    assert layer["parallelism"]["tp_size"] == 1
    with (pytest.warns(FutureWarning, match="TorchTensorParallelPlugin` is deprecated"),
          pytest.raises(ConfigError, match="tp_size=2 x pp_size=1 = 2 does not divide the world size 1")):
        Accelerator(cpu=True, torch_tp_plugin=plugin)  # it reached the config: TP needs 2 processes
    with pytest.warns(FutureWarning):
        accelerator = Accelerator(cpu=True, torch_tp_plugin=TorchTensorParallelPlugin(tp_size=1),
                                  parallelism_config=ParallelismConfig())
    assert accelerator.config.parallelism.tp_size == 1 and accelerator.state.torch_tp_plugin.tp_size == 1
    with pytest.raises(ConfigError, match=r"TorchTensorParallelPlugin: argument 'tp_size': bad value 0; allowed"):
        TorchTensorParallelPlugin(tp_size=0)
    with pytest.raises(ConfigError, match=r"argument 'torch_tp_plugin': expected accel.utils.TorchTensorParallel"):
        Accelerator(cpu=True, torch_tp_plugin=2)


def test_deepspeed_plugins_first_is_active_and_a_second_cannot_be_selected():
    student, teacher = DeepSpeedPlugin(zero_stage=2), DeepSpeedPlugin(zero_stage=3)
    with pytest.warns(UserWarning, match=r"applies the first plugin \('student'\) to every model"):
        accelerator = Accelerator(cpu=True, deepspeed_plugins={"student": student, "teacher": teacher})
    assert accelerator.deepspeed_plugin is student is accelerator.state.deepspeed_plugin
    assert accelerator.config.parallelism.zero_stage == 2
    assert accelerator.state.deepspeed_plugins == {"student": student, "teacher": teacher}
    assert accelerator.state.get_deepspeed_plugin("teacher") is teacher
    assert student.selected and not teacher.selected
    accelerator.state.select_deepspeed_plugin("student")  # the active one: nothing changes
    with pytest.raises(NotImplementedError, match=r"select_deepspeed_plugin\('teacher'\): a second active "
                                                  r"DeepSpeed plugin is not available yet in accel; allowed: 'student'"):
        accelerator.state.select_deepspeed_plugin("teacher")
    with pytest.raises(ValueError, match=r"select_deepspeed_plugin: bad value 'x'; allowed: 'student', 'teacher'"):
        accelerator.state.select_deepspeed_plugin("x")


def test_deepspeed_plugins_one_entry_or_one_plugin_and_errors():
    only = DeepSpeedPlugin(zero_stage=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        accelerator = Accelerator(cpu=True, deepspeed_plugins={"main": only})
    assert accelerator.deepspeed_plugin is only and accelerator.config.parallelism.zero_stage == 3
    accelerator = Accelerator(cpu=True, deepspeed_plugins=DeepSpeedPlugin(zero_stage=1))
    assert accelerator.config.parallelism.zero_stage == 1
    with pytest.raises(ConfigError, match="deepspeed_plugin and deepspeed_plugins are both given"):
        Accelerator(cpu=True, deepspeed_plugin=only, deepspeed_plugins={"main": only})
    with pytest.raises(ConfigError, match=r"argument 'deepspeed_plugins': bad value \{'b': 'int'\}; allowed: a "
                                          "DeepSpeedPlugin or a non-empty dict"):
        Accelerator(cpu=True, deepspeed_plugins={"a": only, "b": 3})
    assert Accelerator(cpu=True).state.deepspeed_plugins is None


# -- the same steps on the real Accelerate ------------------------------------------------------------------------

ACCELERATE_SCRIPT = textwrap.dedent("""
    import json, os, sys, torch
    from accelerate import Accelerator
    from accelerate.utils import ProfileKwargs
    out = sys.argv[1]
    seen = {}
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = accelerator.prepare(torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)))
    def save_hook(models, weights, output_dir):
        seen["save"] = [type(models).__name__, len(models), [sorted(w) for w in weights], type(output_dir).__name__]
        weights.pop()
    def load_hook(models, input_dir):
        seen["load"] = [type(models).__name__, len(models), type(input_dir).__name__]
        models.pop()
    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(os.path.join(out, "ckpt"))
    seen["model_file_written"] = any(f.startswith("model") for f in os.listdir(os.path.join(out, "ckpt")))
    accelerator.load_state(os.path.join(out, "ckpt"))
    seen["handle"] = type(handle).__module__ + "." + type(handle).__name__
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=os.path.join(out, "t"))):
        model(torch.randn(2, 3))
    seen["traces"] = sorted(os.listdir(os.path.join(out, "t")))
    maps = [None, {"": "cpu"}, {"0": "cpu", "1": "disk"}, {"0": 0, "1": 0}]
    seen["verify"] = []
    for m in maps:
        probe = torch.nn.Linear(1, 1)
        if m is not None:
            probe.hf_device_map = m
        seen["verify"].append(accelerator.verify_device_map(probe))
    print(json.dumps(seen))
""")


def test_same_observations_as_the_real_accelerate(tmp_path):
    pytest.importorskip("accelerate")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("ACCELERATE_")}
    result = subprocess.run([sys.executable, "-c", ACCELERATE_SCRIPT, str(tmp_path / "hf")], capture_output=True,
                            text=True, timeout=180, check=False, env={**env, "HOME": str(tmp_path / "home")},
                            cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])

    mine: dict = {}
    accelerator, (model,), _ = Accelerator(cpu=True), (net(0),), None
    model = accelerator.prepare(model)

    def save_hook(models, weights, output_dir):
        mine["save"] = [type(models).__name__, len(models), [sorted(w) for w in weights], type(output_dir).__name__]
        weights.pop()

    def load_hook(models, input_dir):
        mine["load"] = [type(models).__name__, len(models), type(input_dir).__name__]
        models.pop()

    handle = accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    accelerator.save_state(str(tmp_path / "ckpt"))
    mine["model_file_written"] = bool(layout.read_manifest(tmp_path / "ckpt")["skeleton"]["models"])
    accelerator.load_state(str(tmp_path / "ckpt"))
    mine["handle"] = type(handle).__module__ + "." + type(handle).__name__
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=str(tmp_path / "t"))):
        model(torch.randn(2, 3))
    mine["traces"] = sorted(os.listdir(tmp_path / "t"))
    mine["verify"] = []
    for device_map in (None, {"": "cpu"}, {"0": "cpu", "1": "disk"}, {"0": 0, "1": 0}):
        probe = torch.nn.Linear(1, 1)
        if device_map is not None:
            probe.hf_device_map = device_map
        mine["verify"].append(accelerator.verify_device_map(probe))
    assert mine == theirs


def test_accelerate_views_without_their_features():
    """Accelerate's read-only members for features accel runs another way (fsdp2 plugin, context parallelism) have
    Accelerate's values for a run without them."""
    from accel import Accelerator
    from accel.utils.dataclasses import FP8BackendType

    accelerator = Accelerator(cpu=True)
    assert (accelerator.is_fsdp2, accelerator.is_composable_parallelism_enabled) == (False, False)
    assert accelerator.fp8_backend == FP8BackendType.NO == "NO"
    assert accelerator.should_save_model and accelerator.data_parallel_shard_rank == 0
    assert accelerator.use_stateful_dataloader is False
    assert accelerator.context_parallel_rank == 0
    with accelerator.maybe_context_parallel(buffers=[torch.ones(2, 4)], buffer_seq_dims=[1]):
        pass  # the prepared DataLoader cuts the batches: nothing to shard here
