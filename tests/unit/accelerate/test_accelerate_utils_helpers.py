"""Accelerate's small `accelerate.utils` helpers in accel: each is called side by side with the real Accelerate's
(installed as a test dependency) on the same inputs, and the answers must be equal. Where Accelerate's needs a GPU
or its own initialised state, accel's is checked against what Accelerate documents instead."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import warnings

import accelerate.utils as hf
import accelerate.utils.constants as hf_constants
import pytest
import torch
from torch import nn

import accel
import accel.utils as au


@pytest.fixture(autouse=True)
def _fresh_process_state():
    """Tests that touch accel's process state (save, wait_for_everyone, the autocast context) leave it as they
    found it, so later tests build theirs with their own arguments."""
    from accel.state import PartialState

    was_initialized = PartialState._shared_state.get("_initialized", False)
    yield
    if not was_initialized and PartialState._shared_state.get("_initialized", False):
        PartialState._reset_for_tests()


# -- constants and enums --------------------------------------------------------------------------------------------
CONSTANTS = [
    "MODEL_NAME", "OPTIMIZER_NAME", "SCHEDULER_NAME", "SAMPLER_NAME", "SCALER_NAME", "RNG_STATE_NAME",
    "SAFE_MODEL_NAME", "SAFE_WEIGHTS_NAME", "SAFE_WEIGHTS_INDEX_NAME", "SAFE_WEIGHTS_PATTERN_NAME", "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME", "WEIGHTS_PATTERN_NAME", "PROFILE_PATTERN_NAME", "TORCH_LAUNCH_PARAMS",
    "TORCH_DISTRIBUTED_OPERATION_TYPES", "MITA_PROFILING_AVAILABLE_PYTORCH_VERSION",
    "XPU_PROFILING_AVAILABLE_PYTORCH_VERSION",
]


@pytest.mark.parametrize("name", CONSTANTS)
def test_constants_equal_accelerates(name):
    assert getattr(au, name) == getattr(hf, name)


def test_constants_module_has_accelerates_values():
    from accel.core import constants

    for name in dir(constants):
        if name.isupper():
            assert getattr(constants, name) == getattr(hf_constants, name), name


ENUMS = ["ComputeEnvironment", "CustomDtype", "LoggerType", "PrecisionType", "RNGType", "SageMakerDistributedType"]


@pytest.mark.parametrize("name", ENUMS)
def test_enums_match_accelerates(name):
    ours, theirs = getattr(au, name), getattr(hf, name)
    assert [(m.name, m.value) for m in ours] == [(m.name, m.value) for m in theirs]
    assert issubclass(ours, str) == issubclass(theirs, str)  # str enums compare equal to their values
    for ours_member, their_member in zip(ours, theirs):
        assert str(ours_member) == str(their_member) and repr(ours_member) == repr(their_member)
        assert (ours_member == their_member.value) == (their_member == their_member.value)
        assert ours(their_member.value) is ours_member
    if hasattr(theirs, "list"):
        assert ours.list() == theirs.list()
        for value in ["no", "fp16", "torch", "tensorboard", "nothing"]:
            assert (value in ours) == (value in theirs)


def test_precision_type_is_a_str_enum():
    assert au.PrecisionType.BF16 == "bf16" and str(au.PrecisionType.FP16) == "fp16"
    assert "fp8" in au.PrecisionType and "fp4" not in au.PrecisionType


# -- operations -----------------------------------------------------------------------------------------------------
Point = collections.namedtuple("Point", "x y")


def _same(a, b):
    """Equal nested structures, tensors compared by dtype, device and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def _batch():
    return {"ids": torch.arange(6).view(3, 2), "mask": [torch.ones(3, dtype=torch.bfloat16), Point(1, "a")],
            "half": (torch.full((3,), 0.5, dtype=torch.float16), 3.0), "n": 7}


def test_small_predicates_match():
    values = [torch.zeros(1), nn.Parameter(torch.zeros(1)), Point(1, 2), (1, 2), [1], {"a": 1}, 3, None]
    for value in values:
        assert au.is_torch_tensor(value) == hf.is_torch_tensor(value)
        assert au.is_namedtuple(value) == hf.is_namedtuple(value)
    assert au.is_tensor_information(au.TensorInformation(torch.Size([2]), torch.float32))
    assert hf.is_tensor_information(hf.TensorInformation(torch.Size([2]), torch.float32))
    assert not au.is_tensor_information((torch.Size([2]), torch.float32))


@pytest.mark.parametrize("obj", [[1, 2], (1, 2), Point(1, 2)])
def test_honor_type_matches(obj):
    ours, theirs = au.honor_type(obj, (v * 2 for v in obj)), hf.honor_type(obj, (v * 2 for v in obj))
    assert ours == theirs and type(ours) is type(theirs)


@pytest.mark.parametrize("data", [_batch(), [torch.tensor([[1.5]], dtype=torch.bfloat16)], (torch.tensor(2),), 5])
def test_listify_matches(data):
    assert au.listify(data) == hf.listify(data)


@pytest.mark.parametrize("data", [_batch(), [], {"a": [1, {"b": torch.zeros(1, device="meta")}]}, 3, "x"])
def test_find_device_matches(data):
    assert au.find_device(data) == hf.find_device(data)


@pytest.mark.parametrize("data", [_batch(), [], {}, [3, torch.zeros(2)], (torch.zeros(4, 2),), "x"])
def test_ignorant_find_batch_size_matches(data):
    assert au.ignorant_find_batch_size(data) == hf.ignorant_find_batch_size(data)


def test_convert_to_fp32_matches():
    assert _same(au.convert_to_fp32(_batch()), hf.convert_to_fp32(_batch()))
    assert au.convert_to_fp32(_batch())["half"][0].dtype == torch.float32


def test_convert_outputs_to_fp32_matches():
    def forward(x):
        return {"out": x.half(), "aux": [x.bfloat16(), x.int()]}

    x = torch.arange(3.0)
    ours, theirs = au.convert_outputs_to_fp32(forward), hf.convert_outputs_to_fp32(forward)
    assert _same(ours(x), theirs(x))
    assert ours.__wrapped__.model_forward is forward
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(ours.__wrapped__)


@pytest.mark.parametrize("batch_size,num_processes", [(3, 4), (1, 4), (5, 2), (4, 4), (7, 3), (2, 8), (9, 4)])
def test_pad_input_tensors_matches(batch_size, num_processes):
    data = {"x": torch.arange(batch_size * 2.0).view(batch_size, 2), "y": [torch.arange(batch_size)]}
    ours = au.pad_input_tensors(data, batch_size, num_processes)
    assert _same(ours, hf.pad_input_tensors(data, batch_size, num_processes))


def test_pad_input_tensors_refuses_other_leaves_like_accelerate():
    for module in (au, hf):
        with pytest.raises(TypeError):
            module.pad_input_tensors({"x": torch.zeros(3), "n": 1}, 3, 2)


def test_pad_across_processes_leaves_nested_tensors_with_accelerates_warning():
    assert issubclass(au.CannotPadNestedTensorWarning, UserWarning)
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)
    with pytest.warns(au.CannotPadNestedTensorWarning):
        assert au.pad_across_processes(nested) is nested


# -- other ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1536, 10**6, 3 * 1024**3 + 7, 5 * 1024**4, 2 * 1024**5, 12.5])
def test_convert_bytes_matches(size):
    assert au.convert_bytes(size) == hf.convert_bytes(size)


def test_merge_dicts_matches():
    def inputs():
        return {"a": {"b": 1, "c": {"d": 2}}, "e": 3}, {"a": {"x": 0, "c": {"y": 1}}, "e": 0, "f": [1]}

    source, destination = inputs()
    ours = au.merge_dicts(source, destination)
    assert ours is destination
    assert ours == hf.merge_dicts(*inputs())


class _Outer:
    class Inner:
        def method(self):
            pass


@pytest.mark.parametrize("obj", [_Outer, _Outer.Inner, _Outer.Inner.method, _Outer.Inner(), len, 3, "s", None,
                                 lambda: 0, torch.nn.Linear])
def test_get_pretty_name_matches(obj):
    assert au.get_pretty_name(obj) == hf.get_pretty_name(obj)


def test_recursive_getattr_matches():
    model = nn.Sequential(nn.Linear(2, 2))
    for path in ("0", "0.weight", "0.weight.shape", "training"):
        ours, theirs = au.recursive_getattr(model, path), hf.recursive_getattr(model, path)
        assert ours is theirs or ours == theirs
    with pytest.raises(AttributeError):
        au.recursive_getattr(model, "0.nothing")


def _tree():
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.ModuleList([nn.Linear(2, 2), nn.Tanh()])),
                         nn.Linear(2, 1))


@pytest.mark.parametrize("return_fqns", [False, True])
def test_get_module_children_bottom_up_matches(return_fqns):
    model = _tree()
    ours = au.get_module_children_bottom_up(model, return_fqns=return_fqns)
    theirs = hf.get_module_children_bottom_up(model, return_fqns=return_fqns)
    if return_fqns:
        assert [(n, id(m)) for n, m in ours] == [(n, id(m)) for n, m in theirs]
    else:
        assert [id(m) for m in ours] == [id(m) for m in theirs]
    assert (ours[-1][1] if return_fqns else ours[-1]) is model


def test_is_port_in_use_matches():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("localhost", 0))
        server.listen(1)
        port = server.getsockname()[1]
        assert au.is_port_in_use(port) is hf.is_port_in_use(port) is True
    assert au.is_port_in_use(port) == hf.is_port_in_use(port)


def test_check_os_kernel_warns_on_an_old_linux_kernel(monkeypatch, caplog):
    import platform

    from accel.state import PartialState

    PartialState(cpu=True)  # its warning goes through get_logger, which needs the state (as in Accelerate)
    au.check_os_kernel()  # this machine: no error
    old = platform.uname()._replace(system="Linux", release="4.19.0-25-amd64")
    monkeypatch.setattr(platform, "uname", lambda: old)
    with caplog.at_level(logging.WARNING):
        au.check_os_kernel()
    assert "Detected kernel version 4.19.0" in caplog.text


def test_wait_for_everyone_on_one_process():
    assert au.wait_for_everyone() is None


def _tied_state_dict():
    torch.manual_seed(0)
    emb = nn.Embedding(4, 3)
    head = nn.Linear(3, 4, bias=False)
    head.weight = emb.weight
    model = nn.ModuleDict({"emb": emb, "head": head, "norm": nn.LayerNorm(3)})
    return model.state_dict()


def test_clean_state_dict_for_safetensors_matches(caplog, monkeypatch):
    import accelerate.utils.other

    # Accelerate's logger needs Accelerate's own state initialised: a plain logger stands in for it
    monkeypatch.setattr(accelerate.utils.other, "logger", logging.getLogger("accelerate-stand-in"))
    from accel.state import PartialState

    PartialState(cpu=True)  # our warning goes through get_logger, which needs the state (as in Accelerate)
    ours_input, theirs_input = _tied_state_dict(), _tied_state_dict()
    with caplog.at_level(logging.WARNING):
        ours = au.clean_state_dict_for_safetensors(ours_input)
    theirs = hf.clean_state_dict_for_safetensors(theirs_input)
    assert list(ours) == list(theirs) == ["emb.weight", "norm.weight", "norm.bias"]
    assert list(ours_input) == list(theirs_input)  # the duplicate is removed from the given dict too
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert "Removed shared tensor {'head.weight'}" in caplog.text


def test_extract_submodules_state_dict_matches():
    state = {f"h.{i}.w": torch.tensor(i) for i in (1, 2, 10, 11)} | {"h.1": torch.tensor(0), "head.w": torch.tensor(5)}
    for names in (["h.1"], ["h.1", "head"], ["h"], ["nothing"], ["h.10", "h.1"]):
        ours, theirs = au.extract_submodules_state_dict(state, names), hf.extract_submodules_state_dict(state, names)
        assert list(ours) == list(theirs)


@pytest.mark.parametrize("safe", [False, True])
def test_save_writes_what_accelerates_load_reads(tmp_path, safe):
    state = _tied_state_dict()
    path = tmp_path / ("w.safetensors" if safe else "w.bin")
    au.save(state, path, safe_serialization=safe)
    if safe:
        from safetensors.torch import load_file

        loaded = load_file(path)
        assert sorted(loaded) == ["emb.weight", "norm.bias", "norm.weight"]  # the alias is gone
    else:
        loaded = hf.load(path)
        assert list(loaded) == list(state)
    assert all(torch.equal(loaded[k], state[k]) for k in loaded)


def test_save_only_on_the_main_process(tmp_path, monkeypatch):
    from accel.state import PartialState

    state = PartialState()
    monkeypatch.setattr(type(state), "is_main_process", property(lambda self: False))
    au.save({"x": torch.zeros(1)}, tmp_path / "a.bin")
    assert not (tmp_path / "a.bin").exists()
    au.save({"x": torch.zeros(1)}, tmp_path / "b.bin", save_on_each_node=True)  # the local main process writes
    assert (tmp_path / "b.bin").exists()


def test_load_matches_accelerates_and_restores_safe_globals(tmp_path):
    import numpy as np

    obj = {"t": torch.arange(3), "np": np.arange(4, dtype=np.uint32), "rng": np.random.get_state()}
    torch.save(obj, tmp_path / "s.pt")
    before = set(torch.serialization.get_safe_globals())  # torch keeps them in a set: the order is not stable
    ours, theirs = au.load(tmp_path / "s.pt"), hf.load(tmp_path / "s.pt")
    assert set(torch.serialization.get_safe_globals()) == before
    assert torch.equal(ours["t"], theirs["t"]) and (ours["np"] == theirs["np"]).all()
    assert ours["rng"][0] == theirs["rng"][0] and (ours["rng"][1] == theirs["rng"][1]).all()
    torch.save({"f": _Outer.Inner()}, tmp_path / "unsafe.pt")  # weights_only refuses arbitrary objects
    with pytest.raises(pickle.UnpicklingError):
        au.load(tmp_path / "unsafe.pt")
    assert isinstance(au.load(tmp_path / "unsafe.pt", weights_only=False)["f"], _Outer.Inner)


def test_compile_regions_matches_accelerates_structure():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 4)
            self.body = nn.Module()
            self.body.blocks = nn.ModuleList([Block(), Block()])
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            x = self.embed(x)
            for block in self.body.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Net()
    assert not au.has_compiled_regions(model)
    ours, theirs = au.compile_regions(model, backend="eager"), hf.compile_regions(model, backend="eager")

    def layout(m):
        return [(name, type(sub).__name__) for name, sub in m.named_modules()]

    assert layout(ours) == layout(theirs)
    assert ours.__dict__["_orig_mod"] is model and type(ours) is Net
    assert au.has_compiled_regions(ours) and hf.has_compiled_regions(ours)
    assert not au.is_compiled_module(ours) and not hf.is_compiled_module(ours)
    x = torch.randn(3, 4)
    assert torch.equal(ours(x), model(x))
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert au.extract_model_from_parallel(ours, keep_torch_compile=False) is model
    assert au.extract_model_from_parallel(ours) is ours and ours.__dict__["_orig_mod"] is model
    assert list(ours.state_dict()) == list(theirs.state_dict())  # `_orig_mod` did not become a submodule
    whole = torch.compile(model, backend="eager")
    assert au.is_compiled_module(whole) and au.extract_model_from_parallel(whole, keep_torch_compile=False) is model


def test_model_has_dtensor_matches():
    model = _tree()
    assert au.model_has_dtensor(model) is hf.model_has_dtensor(model) is False


# -- modeling -------------------------------------------------------------------------------------------------------
SIZES = [0, 1234, "5GB", "5Gb", "1.5MB", "2MiB", "3KiB", "7kB", "1GiB", "0.5gib", "10", "1TB", "xMB", "", -3, "5 MB"]


@pytest.mark.parametrize("size", SIZES)
def test_convert_file_size_to_int_matches(size):
    try:
        expected = hf.convert_file_size_to_int(size)
    except ValueError:
        with pytest.raises(ValueError):
            au.convert_file_size_to_int(size)
    else:
        assert au.convert_file_size_to_int(size) == expected


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8, torch.int64,
          torch.bool, torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.int16, torch.uint32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_dtype_byte_size_matches(dtype):
    assert au.dtype_byte_size(dtype) == hf.dtype_byte_size(dtype)


def test_dtype_byte_size_of_custom_dtypes_matches():
    for ours, theirs in zip(au.CustomDtype, hf.CustomDtype):
        assert au.dtype_byte_size(ours) == hf.dtype_byte_size(theirs)
    with pytest.raises(ValueError):
        au.dtype_byte_size("float")


def test_id_tensor_storage_matches():
    base = torch.arange(10.0)
    tensors = [base, base[2:5], base.view(2, 5), torch.zeros(3, dtype=torch.int8), torch.zeros(4, device="meta")]
    for t in tensors:
        assert au.id_tensor_storage(t) == hf.id_tensor_storage(t)
    assert au.id_tensor_storage(base) == au.id_tensor_storage(base[3:])
    assert au.id_tensor_storage(base) != au.id_tensor_storage(base.clone())


def test_calculate_maximum_sizes_matches():
    model = nn.Sequential(nn.Linear(8, 16), nn.Sequential(nn.Linear(16, 16), nn.ReLU()), nn.Linear(16, 2))
    ours, theirs = au.calculate_maximum_sizes(model), hf.calculate_maximum_sizes(model)
    assert ours[0] == theirs[0] and ours[1][0] == theirs[1][0] and sorted(ours[1][1]) == sorted(theirs[1][1])


def test_retie_parameters_matches():
    def broken():
        model = nn.ModuleDict({"emb": nn.Embedding(4, 3), "head": nn.Linear(3, 4, bias=False)})
        model.head.weight = model.emb.weight
        tied = au.find_tied_parameters(model)
        model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # the link broken (e.g. by a hook)
        return model, tied

    for module in (au, hf):
        model, tied = broken()
        module.retie_parameters(model, tied)
        assert model.head.weight is model.emb.weight
    model, tied = broken()
    model.emb.weight = nn.Parameter(torch.empty(4, 3, device="meta"))
    au.retie_parameters(model, tied)  # the first one off the meta device is what every name gets
    assert model.emb.weight is model.head.weight and model.head.weight.device.type == "cpu"


def test_check_tied_parameters_on_same_device_warns_like_accelerate(caplog):
    tied = [["emb.weight", "head.weight"]]
    with caplog.at_level(logging.WARNING):
        au.check_tied_parameters_on_same_device(tied, {"emb": "cpu", "head": "cpu"})
        assert caplog.text == ""
        au.check_tied_parameters_on_same_device(tied, {"emb": 0, "head": "cpu"})
    assert "Tied parameters are on different devices: {'emb.weight': 0, 'head.weight': 'cpu'}" in caplog.text
    with pytest.raises(ValueError, match="does not contain the module"):
        au.check_tied_parameters_on_same_device(tied, {"emb": "cpu"})


def test_check_tied_parameters_in_config_matches():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16, n_positions=8)
    for tie in (True, False):
        config.tie_word_embeddings = tie
        model = transformers.GPT2LMHeadModel(config)
        assert au.check_tied_parameters_in_config(model) == hf.check_tied_parameters_in_config(model)
    plain = _tree()
    assert au.check_tied_parameters_in_config(plain) is hf.check_tied_parameters_in_config(plain) is False


def test_offload_helpers():
    from accelerate.big_modeling import cpu_offload as hf_cpu_offload

    from accel.big_modeling import cpu_offload

    models = {}
    for name, offload in (("accel", cpu_offload), ("accelerate", hf_cpu_offload)):
        torch.manual_seed(0)
        models[name] = nn.Sequential(nn.Linear(3, 2), nn.Sequential(nn.Linear(2, 2)))
        assert not au.has_offloaded_params(models[name][0])
        offload(models[name], execution_device="cpu")
    ours, theirs = models["accel"], models["accelerate"]
    for ours_sub, theirs_sub in zip(ours.modules(), theirs.modules()):  # the root has two hooks in a sequence
        assert au.has_offloaded_params(ours_sub) == hf.has_offloaded_params(theirs_sub)
    assert au.has_offloaded_params(ours[0]) and ours[0].weight.device.type == "meta"
    for ours_module, theirs_module in ((ours[0], theirs[0]), (ours[1][0], theirs[1][0])):
        with au.align_module_device(ours_module), hf.align_module_device(theirs_module):
            assert ours_module.weight.device.type == "cpu"
            assert torch.equal(ours_module.weight, theirs_module.weight)
        assert ours_module.weight.device.type == "meta"
    plain = nn.Linear(3, 2)
    weight = plain.weight
    with au.align_module_device(plain):  # nothing to do
        assert plain.weight is weight
    with au.align_module_device(plain, "cpu"):
        assert plain.weight.device.type == "cpu" and torch.equal(plain.weight, weight)
    assert plain.weight.device.type == "cpu"


@pytest.mark.parametrize("writer", ["accel", "accelerate"])
def test_load_offloaded_weights_reads_both_formats(tmp_path, writer):
    source = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    source[0].weight.data = source[0].weight.data.bfloat16()
    state = source.state_dict()
    (au if writer == "accel" else hf).offload_state_dict(tmp_path, state)
    index = json.loads((tmp_path / "index.json").read_text())
    target = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2)).to("meta")
    target[0].weight.data = target[0].weight.data.bfloat16()
    au.load_offloaded_weights(target, index, str(tmp_path))
    for name, value in target.state_dict().items():
        assert value.device.type == "cpu" and torch.equal(value, state[name]), name
    au.load_offloaded_weights(target, None, str(tmp_path))  # nothing to do


def _write_checkpoint(tmp_path, metadata={"format": "pt"}):
    from safetensors.torch import save_file

    state = {"a.w": torch.arange(4.0), "a.b": torch.ones(2), "b.w": torch.zeros(3), "c": torch.tensor([7])}
    save_file(state, str(tmp_path / "m.safetensors"), metadata=metadata)
    torch.save(state, tmp_path / "m.bin")
    return state


@pytest.mark.parametrize("device_map", [None, {"": "cpu"}, {"a": "cpu", "b": "disk"}, {"a": "disk", "b.w": "cpu"}])
@pytest.mark.parametrize("suffix", ["safetensors", "bin"])
def test_load_state_dict_matches(tmp_path, device_map, suffix):
    state = _write_checkpoint(tmp_path)
    path = str(tmp_path / f"m.{suffix}")
    ours, theirs = au.load_state_dict(path, device_map), hf.load_state_dict(path, device_map)
    assert sorted(ours) == sorted(theirs) == sorted(state)
    assert all(_same(ours[k], theirs[k]) for k in ours)


def test_load_state_dict_checks_safetensors_metadata(tmp_path, caplog):
    _write_checkpoint(tmp_path, metadata={"format": "flax"})
    with pytest.raises(ValueError, match="saved with flax"):
        au.load_state_dict(str(tmp_path / "m.safetensors"))
    _write_checkpoint(tmp_path, metadata={"format": "keras"})
    with pytest.raises(OSError, match="valid metadata"):
        au.load_state_dict(str(tmp_path / "m.safetensors"))
    _write_checkpoint(tmp_path, metadata=None)
    with caplog.at_level(logging.WARNING):
        assert len(au.load_state_dict(str(tmp_path / "m.safetensors"))) == 4
    assert "does not contain metadata" in caplog.text


def test_get_grad_scaler_matches_on_this_machine():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA scaler without a GPU warns that it disables itself
        ours, theirs = au.get_grad_scaler(init_scale=2.0**10), hf.get_grad_scaler(init_scale=2.0**10)
        assert type(ours) is type(theirs) and ours._device == theirs._device
        assert ours.is_enabled() == theirs.is_enabled()
        fsdp = au.get_grad_scaler(au.DistributedType.FSDP)
        assert type(fsdp) is type(hf.get_grad_scaler(hf.DistributedType.FSDP))


def test_get_mixed_precision_context_manager(monkeypatch):
    from accel.state import PartialState

    # (Accelerate's needs its own Accelerator initialised even for the no-op context: checked against torch's)
    assert isinstance(au.get_mixed_precision_context_manager(), contextlib.nullcontext)
    state = PartialState(cpu=True)
    for mode, dtype in (("bf16", torch.bfloat16), ("fp8", torch.bfloat16), ("fp16", torch.float16)):
        monkeypatch.setitem(state.__dict__, "mixed_precision", mode)
        with au.get_mixed_precision_context_manager(native_amp=True):
            assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == dtype
    monkeypatch.setitem(state.__dict__, "mixed_precision", "no")
    context = au.get_mixed_precision_context_manager(True, au.AutocastKwargs(cache_enabled=False))
    assert isinstance(context, torch.autocast) and context._cache_enabled is False


def test_is_peft_model_matches():
    model = _tree()
    assert bool(au.is_peft_model(model)) == bool(hf.is_peft_model(model))


def test_ensure_weights_retied_matches():
    class Tied(nn.Module):
        _tied_weights_keys = ["head.weight"]

        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(4, 3)
            self.head = nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight

    def reinit(module):  # re-creates the module's own parameters, as FSDP's param_init_fn may
        for name, param in list(module.named_parameters(recurse=False)):
            setattr(module, name, nn.Parameter(torch.zeros_like(param)))
        return module

    for module in (au, hf):
        model = Tied()
        init = module.ensure_weights_retied(reinit, model, torch.device("cpu"))
        init(model.emb)
        init(model.head)
        assert model.emb.weight is model.head.weight
    assert au.ensure_weights_retied(reinit, _tree(), torch.device("cpu")) is reinit


# -- environment ----------------------------------------------------------------------------------------------------
def test_convert_dict_to_env_variables_matches():
    env = {"ACCELERATE_DEBUG_MODE": "1", "BAD_ENV_NAME": "<mything", "OTHER_ENV": "2", "EMPTY": "", "A B": "c",
           "SEMI": "a;b", "NL": "a\nb"}
    assert au.convert_dict_to_env_variables(env) == hf.convert_dict_to_env_variables(env)
    assert au.convert_dict_to_env_variables(env) == ["ACCELERATE_DEBUG_MODE=1\n", "OTHER_ENV=2\n"]


def test_parse_choice_from_env_matches(monkeypatch):
    monkeypatch.delenv("ACCEL_TEST_CHOICE", raising=False)
    for default in ("no", 3, None):
        assert au.parse_choice_from_env("ACCEL_TEST_CHOICE", default) == hf.parse_choice_from_env(
            "ACCEL_TEST_CHOICE", default)
    monkeypatch.setenv("ACCEL_TEST_CHOICE", "bf16")
    assert au.parse_choice_from_env("ACCEL_TEST_CHOICE") == hf.parse_choice_from_env("ACCEL_TEST_CHOICE") == "bf16"


def test_are_libraries_initialized_matches():
    names = ("torch", "accel", "not_a_library_at_all", "json")
    assert au.are_libraries_initialized(*names) == hf.are_libraries_initialized(*names)


def test_purge_accelerate_environment(monkeypatch):
    monkeypatch.setenv("ACCELERATE_KEEP", "1")
    monkeypatch.delenv("ACCELERATE_NEW", raising=False)

    @au.purge_accelerate_environment
    def change():
        os.environ["ACCELERATE_NEW"] = "x"
        os.environ["ACCELERATE_KEEP"] = "2"
        return "done"

    assert change() == "done" and "ACCELERATE_NEW" not in os.environ and os.environ["ACCELERATE_KEEP"] == "1"

    @au.purge_accelerate_environment
    class Case:
        def test_set(self):
            os.environ["ACCELERATE_NEW"] = "y"

        def helper(self):
            os.environ["ACCELERATE_NEW"] = "z"

    class Child(Case):
        def test_child(self):
            os.environ["ACCELERATE_NEW"] = "c"

    Case().test_set()
    Child().test_child()
    assert "ACCELERATE_NEW" not in os.environ
    Case().helper()  # not a test method: not wrapped
    assert os.environ.pop("ACCELERATE_NEW") == "z"


@pytest.mark.parametrize("env", [{}, {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                                 {"PMI_RANK": "2", "PMI_SIZE": "8", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "4"},
                                 {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6"}])
def test_get_cpu_distributed_information_matches(monkeypatch, env):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    ours, theirs = au.get_cpu_distributed_information(), hf.get_cpu_distributed_information()
    assert dataclasses.asdict(ours) == dataclasses.asdict(theirs)


def test_device_probes_match():
    assert au.get_current_device_type() == hf.get_current_device_type()
    assert au.check_cuda_p2p_ib_support() == hf.check_cuda_p2p_ib_support()
    try:
        expected = hf.get_gpu_info()
    except (OSError, subprocess.CalledProcessError) as error:
        with pytest.raises(type(error)):
            au.get_gpu_info()
    else:
        assert au.get_gpu_info() == expected


# -- imports, launch, top level ---------------------------------------------------------------------------------------
def test_required_decorators():
    def convert(x):
        """Doc."""
        return x + 1

    wrapped = au.torchao_required(convert)
    assert wrapped.__name__ == "convert" and wrapped.__doc__ == "Doc."
    if au.is_torchao_available():
        assert wrapped(1) == 2
    else:
        with pytest.raises(ImportError, match="pip install torchao"):
            wrapped(1)
    with pytest.raises(NotImplementedError, match="convert: DeepSpeed's engine is not available yet in accel"):
        au.deepspeed_required(convert)(1)


@pytest.mark.parametrize("kind", ["MULTI_CPU", "MULTI_GPU", "NO"])
def test_prepare_for_launch_sets_accelerates_environment(monkeypatch, kind):
    seen = {}
    for name in ("RANK", "LOCAL_RANK", "FORK_LAUNCHED"):
        monkeypatch.setenv(name, "")  # recorded now, so the values PrepareForLaunch sets are undone after the test
    for module in (au, hf):
        for name in ("RANK", "LOCAL_RANK", "FORK_LAUNCHED"):
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("NPROC", "2")
        monkeypatch.setenv("NODE_RANK", "1")
        calls = []
        module.PrepareForLaunch(lambda *a: calls.append(a), distributed_type=kind)(1, "x", 2)
        seen[module.__name__] = (calls, {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "FORK_LAUNCHED")})
    assert seen["accel.utils"] == seen["accelerate.utils"]
    with pytest.raises(ValueError):
        au.PrepareForLaunch(print, distributed_type="NOT_A_TYPE")


@pytest.mark.parametrize("enable", [None, "1", "0"])
def test_top_level_is_rich_available(monkeypatch, enable):
    import accelerate as real

    monkeypatch.delenv("ACCELERATE_ENABLE_RICH", raising=False)
    if enable is not None:
        monkeypatch.setenv("ACCELERATE_ENABLE_RICH", enable)
    assert accel.is_rich_available() == real.is_rich_available() == au.is_rich_available()
    assert "is_rich_available" in accel.__all__


def test_every_new_name_is_listed_and_import_stays_light():
    for name in CONSTANTS + ENUMS + ["save", "load", "load_state_dict", "PrepareForLaunch", "compile_regions"]:
        assert name in au.__all__
    code = ("import sys, accel.utils\n"
            "heavy = [m for m in ('accel.utils.modeling', 'accel.utils.other', 'accel.config.plugins', 'torch._dynamo',"
            " 'accel.utils.dataclasses', 'accel.utils.launch') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_torchao_helpers_match():
    """accelerate.utils.ao's layer rules and conversion, on a model with Linear layers of both kinds."""
    pytest.importorskip("torchao")
    import accelerate.utils.ao as hf_ao

    def make():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                                   torch.nn.Linear(32, 24), torch.nn.Linear(24, 16))

    model = make()
    for name, module in model.named_modules():
        assert au.filter_first_and_last_linear_layers(module, name) == \
            hf_ao.filter_first_and_last_linear_layers(module, name)
    ours, theirs = make(), make()
    au.convert_model_to_fp8_ao(ours)
    hf_ao.convert_model_to_fp8_ao(theirs)
    assert [type(m).__name__ for m in ours] == [type(m).__name__ for m in theirs]
    assert au.has_ao_layers(ours) and hf_ao.has_ao_layers(ours) and not au.has_ao_layers(make())
