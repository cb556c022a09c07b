"""`accel estimate-memory` and accel/planning/estimate.py: exact byte counts, tied weights, ZeRO sharding, a 70B config
on the meta device, the JSON keys and the one-line errors."""

from __future__ import annotations

import json
import time

import pytest
import torch

from accel.cli.main import main
from accel.planning.estimate import estimate, load_spec, spec_from_module, spec_from_safetensors

transformers = pytest.importorskip("transformers")


class Block(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.fc = torch.nn.Linear(width, 3 * width)


class Small(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3):
        super().__init__()
        self.embed = torch.nn.Embedding(50, width)
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 50, bias=False)


def small() -> torch.nn.Module:
    return Small()


def test_exact_bytes_per_dtype_and_largest_layer():
    model = Small()
    spec = spec_from_module(model)
    numel = sum(p.numel() for p in model.parameters())
    result = estimate(spec, ["float32", "bfloat16"])
    f32, bf16 = result["weights"]
    assert result["params"] == numel
    assert f32["total_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert bf16["total_bytes"] == numel * 2
    assert f32["largest_layer"] == {"name": "<root>", "params": 50 * 8 * 2, "bytes": 50 * 8 * 2 * 4}
    assert f32["largest_param"]["name"] in ("embed.weight", "head.weight")
    ddp = result["training"]["layouts"]["ddp"]
    n_tensors = len(list(model.parameters()))
    assert ddp["params_bytes"] == ddp["grads_bytes"] == numel * 4
    assert ddp["optimizer_bytes"] == numel * 8 + n_tensors * 4  # two moments + a 0-d step each
    assert ddp["device_bytes"] == numel * 16 + n_tensors * 4 and ddp["master_bytes"] == 0


def test_block_is_largest_layer_when_blocks_dominate():
    spec = spec_from_module(Small(width=64, depth=2))
    layer = estimate(spec, ["float32"])["weights"][0]["largest_layer"]
    assert layer["name"] == "blocks.0" and layer["params"] == 2 * 64 + 64 * 192 + 192


def test_tied_weights_counted_once():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    spec = spec_from_module(transformers.AutoModelForCausalLM.from_config(config))
    names = [p.name for p in spec.params]
    assert "lm_head.weight" not in names and "transformer.wte.weight" in names
    real = transformers.AutoModelForCausalLM.from_config(config)
    assert spec.numel == sum(p.numel() for p in real.parameters())  # parameters() dedups ties


def test_zero3_is_a_one_over_n_shard_of_ddp():
    spec = spec_from_module(Small(width=16, depth=4))
    n = 4
    layouts = estimate(spec, num_processes=n)["training"]["layouts"]
    ddp, z3, off = layouts["ddp"], layouts["zero3"], layouts["zero3_offload"]
    steps = len(spec.params) * 4
    for key in ("params_bytes", "grads_bytes"):
        assert ddp[key] / n <= z3[key] <= ddp[key] / n + 4 * 16 * len(spec.params)  # dim-0 padding, one row each
    assert z3["optimizer_bytes"] - steps == pytest.approx((ddp["optimizer_bytes"] - steps) / n, rel=0.15)
    assert off["device_bytes"] == 0 and off["host_bytes"] == z3["device_bytes"]
    z1 = layouts["zero1"]
    assert z1["params_bytes"] == ddp["params_bytes"] and z1["optimizer_bytes"] < ddp["optimizer_bytes"]


def test_llama_70b_on_meta_in_seconds(tmp_path):
    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                      num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    config.to_json_file(tmp_path / "config.json")
    start = time.perf_counter()
    result = estimate(load_spec(str(tmp_path)), num_processes=8, tp=2, pp=2)
    assert time.perf_counter() - start < 10
    assert result["params"] == pytest.approx(70.6e9, rel=0.002)
    root = result["weights"][1]["largest_layer"]  # untied embedding + head + final norm: FSDP2's root unit
    assert root == {"name": "<root>", "params": 2 * 128256 * 8192 + 8192, "bytes": (2 * 128256 * 8192 + 8192) * 2}
    assert result["training"]["dp_size"] == 2


def test_safetensors_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"layers.0.w": torch.zeros(4, 4), "layers.1.w": torch.zeros(4, 4, dtype=torch.bfloat16),
               "head": torch.zeros(2, 4)}, tmp_path / "model.safetensors")
    spec = spec_from_safetensors(tmp_path)
    assert spec.numel == 40 and {p.block for p in spec.params} == {"layers.0", "layers.1", None}


def test_json_keys(capsys):
    assert main(["estimate-memory", f"{__name__}:small", "--json", "--num_processes", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"model", "params", "weights", "training", "assumptions"}
    assert set(out["weights"][0]) == {"dtype", "total_bytes", "largest_layer", "largest_param"}
    assert set(out["training"]["layouts"]) == {"ddp", "zero1", "zero2", "zero3", "zero3_offload"}
    assert set(out["training"]["layouts"]["zero2"]) == {"params_bytes", "grads_bytes", "optimizer_bytes",
                                                        "master_bytes", "device_bytes", "host_bytes"}


def test_text_output(capsys):
    assert main(["estimate-memory", f"{__name__}:small", "--dtypes", "float16"]) == 0
    out = capsys.readouterr().out
    assert "float16" in out and "zero3_offload" in out and "Assumed:" in out


@pytest.mark.parametrize("args, fragment", [
    (["no_such_model_type"], "unknown transformers model type"),
    (["missing/config.json"], "no such file"),
    (["missing.safetensors"], "no such file"),
    (["os:no_such_callable"], "cannot load the callable"),
    (["os:getcwd"], "not a torch.nn.Module"),
    ([f"{__name__}:small", "--num_processes", "3", "--tp_size", "2"], "not a multiple"),
    ([f"{__name__}:small", "--dtypes", "float7"], "--dtypes: bad value"),
    ([f"{__name__}:small", "--num_processes", "8", "--pp_size", "8"], "--pp_size 8"),
])
def test_errors_are_one_line(args, fragment, capsys):
    assert main(["estimate-memory", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and err.startswith("accel estimate-memory: error:")


def test_missing_transformers_names_the_install(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)  # import transformers -> ImportError
    assert main(["estimate-memory", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'accel-train[transformers]'" in err and err.count("\n") == 1


# -- activations (fake tensors under torch's MemTracker) ----------------------------------------------------------
def _tiny_llama(layers: int = 3):
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("checkpointing", ["no", "full"])
def test_fake_activations_match_the_real_step(checkpointing):
    from accel.planning.estimate import activation_bytes

    model = _tiny_llama()
    fake = activation_bytes(model, 2, 48, checkpointing=checkpointing)
    real = activation_bytes(model, 2, 48, checkpointing=checkpointing, fake=False)
    assert fake == pytest.approx(real, rel=0.15)
    assert all(not p.is_meta for p in model.parameters()) and model.model.layers[0].forward.__name__ == "forward"


def test_checkpointing_keeps_fewer_bytes_and_grows_with_tokens():
    from accel.planning.estimate import activation_bytes

    with torch.device("meta"):
        model = _tiny_llama(layers=4)
    none, full = (activation_bytes(model, 2, 64, "bf16", c) for c in ("no", "full"))
    assert full < 0.6 * none
    assert activation_bytes(model, 4, 64, "bf16") > 1.6 * none  # twice the tokens


def test_activation_json_keys(tmp_path, capsys):
    _tiny_llama(layers=2).config.to_json_file(tmp_path / "config.json")
    assert main(["estimate-memory", str(tmp_path), "--json", "--batch_size", "1", "--seq_len", "32"]) == 0
    a = json.loads(capsys.readouterr().out)["activations"]
    assert set(a) == {"batch_size", "seq_len", "mixed_precision", "no_checkpointing_bytes",
                      "full_checkpointing_bytes", "method"}
    assert (a["batch_size"], a["seq_len"]) == (1, 32)
    assert 0 < a["full_checkpointing_bytes"] < a["no_checkpointing_bytes"]


@pytest.mark.parametrize("args, fragment", [
    (["gpt2", "--batch_size", "2"], "--batch_size and --seq_len"),
    ([f"{__name__}:small", "--batch_size", "0", "--seq_len", "4"], "--batch_size 0"),
])
def test_activation_errors_are_one_line(args, fragment, capsys):
    assert main(["estimate-memory", *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


# -- what the text report looks like: prose wrapped, no torch warning -------------------------------------------
@pytest.mark.parametrize("columns, width", [("300", 100), ("60", 60)])
def test_the_prose_is_wrapped_to_the_terminal_at_most_100_columns(monkeypatch, capsys, columns, width):
    from accel.planning.estimate import ASSUMPTIONS

    monkeypatch.setenv("COLUMNS", columns)
    assert main(["estimate-memory", f"{__name__}:small"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= max(width, 83)  # 83: the layouts table, never wrapped
    assumed = lines[next(i for i, line in enumerate(lines) if line.startswith("Assumed: ")):]
    assert len(assumed) > 5 and max(len(line) for line in assumed) <= width
    assert " ".join(assumed) == f"Assumed: {ASSUMPTIONS}."  # every word kept, none split


class Func(torch.nn.Module):
    """Like transformers' hub-kernel function wrappers (a module per wrapped function, outside the model's tree):
    two of the same class name, one entered inside the other, make torch's ModTracker warn."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


INNER = Func(torch.relu)
OUTER = Func(lambda x: INNER(x) * 2)


class WithFuncs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return OUTER(self.fc(self.embed(ids)))


def with_funcs() -> torch.nn.Module:
    return WithFuncs()


def test_the_activation_measurement_prints_no_torch_warning(monkeypatch, capsys):
    import contextlib
    import warnings

    from accel.planning import estimate as planning

    def caught(quiet: bool) -> list[str]:
        formatwarning = warnings.formatwarning
        with warnings.catch_warnings(record=True) as records, monkeypatch.context() as patch:
            warnings.simplefilter("always")
            if not quiet:
                patch.setattr(planning, "_quiet_mod_tracker", contextlib.nullcontext)
            assert main(["estimate-memory", f"{__name__}:with_funcs", "--batch_size", "2", "--seq_len", "4"]) == 0
        warnings.formatwarning = formatwarning  # what torch replaces to print it
        return [str(record.message) for record in records]

    assert any(planning.MOD_TRACKER_WARNING in message for message in caught(quiet=False))  # torch does warn here
    formatwarning = warnings.formatwarning
    assert caught(quiet=True) == []
    assert warnings.formatwarning is formatwarning  # and torch's replacement of it is undone
    assert capsys.readouterr().err == ""


def test_a_transformers_model_with_batch_size_prints_no_warning(tmp_path, capsys):
    import warnings

    _tiny_llama(layers=2).config.to_json_file(tmp_path / "config.json")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        assert main(["estimate-memory", str(tmp_path), "--batch_size", "1", "--seq_len", "16"]) == 0
    assert [str(r.message) for r in records if "PyTorch" in str(r.message)] == []
    assert "Please file a bug" not in capsys.readouterr().err


# -- tensor and pipeline parallelism: what accel's plan splits and where its split cuts ------------------------
def _llama_spec(tie: bool = False, layers: int = 4):
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100,
                                      tie_word_embeddings=tie)
    with torch.device("meta"):
        return spec_from_module(transformers.AutoModelForCausalLM.from_config(config))


def test_tp_follows_the_models_own_plan():
    params = {p.name: p for p in _llama_spec().params}
    assert params["model.embed_tokens.weight"].tp_dim == 0 and params["model.embed_tokens.weight"].tp_whole_grad
    assert params["lm_head.weight"].tp_dim == 0 and not params["lm_head.weight"].tp_whole_grad
    assert params["model.layers.0.self_attn.q_proj.weight"].tp_dim == 0
    assert params["model.layers.0.self_attn.o_proj.weight"].tp_dim == 1  # rowwise: by input columns
    assert params["model.layers.0.mlp.down_proj.weight"].tp_dim == 1
    assert params["model.layers.0.input_layernorm.weight"].tp_dim is None  # norms replicated
    assert params["model.norm.weight"].tp_dim is None


def test_tp_alone_keeps_the_split_and_a_whole_embedding_gradient():
    from accel.planning.estimate import training

    spec = _llama_spec()
    whole = {p.name: p.numel for p in spec.params}
    split = sum(n // 2 if spec.params[i].tp_dim is not None else n for i, n in enumerate(whole.values()))
    result = training(spec, 2, tp=2)
    ddp = result["layouts"]["ddp"]
    assert result["dp_size"] == 1 and ddp["params_bytes"] == split * 4 == result["rank_params_bytes"]
    assert ddp["grads_bytes"] == (split + whole["model.embed_tokens.weight"] // 2) * 4  # its gradient: replicated
    assert ddp["optimizer_bytes"] == (2 * split + len(spec.params)) * 4
    assert all(row == ddp for row in result["layouts"].values() if row is not result["layouts"]["zero3_offload"])


def test_tp_with_data_parallelism_is_fsdp2_over_the_tp_shards():
    from accel.planning.estimate import _shard_numel, rank_params, training

    spec = _llama_spec()
    result = training(spec, 4, tp=2)
    layouts = result["layouts"]
    shards = sum(_shard_numel(s, 2) for s in rank_params(spec, 2, 1))
    for name in ("ddp", "zero2", "zero3"):  # DDP takes no DTensors: accel shards with FSDP2 at every stage
        assert layouts[name]["params_bytes"] == layouts[name]["grads_bytes"] == shards * 4
        assert layouts[name]["optimizer_bytes"] == (2 * shards + len(spec.params)) * 4
    assert result["rank_params_bytes"] == training(spec, 2, tp=2)["rank_params_bytes"]  # unsharded slice


def test_tp_split_by_names_for_a_checkpoint():
    from accel.planning.estimate import _tp_split_by_name

    assert _tp_split_by_name("model.embed_tokens.weight", (100, 8)) == (0, True)
    assert _tp_split_by_name("lm_head.weight", (100, 8)) == (0, False)
    assert _tp_split_by_name("model.layers.0.self_attn.k_proj.weight", (4, 8)) == (0, False)
    assert _tp_split_by_name("model.layers.0.self_attn.k_proj.bias", (4,)) == (0, False)
    assert _tp_split_by_name("model.layers.0.mlp.down_proj.weight", (8, 16)) == (1, False)
    assert _tp_split_by_name("model.layers.0.mlp.down_proj.bias", (8,)) == (None, False)
    assert _tp_split_by_name("transformer.h.0.attn.c_attn.weight", (8, 24)) == (1, False)
    assert _tp_split_by_name("model.norm.weight", (8,)) == (None, False)


class FrontHeavy(torch.nn.Module):
    """A large embedding before four small blocks: the balanced split puts it alone with the first block."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 8)
        self.blocks = torch.nn.ModuleList(Block(8) for _ in range(4))
        self.norm = torch.nn.LayerNorm(8)


def test_pp_cuts_where_accels_balanced_split_does():
    from accel.backends.pipeline_split import balanced_split_points
    from accel.planning.estimate import pipeline_stages

    model = FrontHeavy()
    stages = pipeline_stages(spec_from_module(model), 2)
    assert balanced_split_points(model, 2) == ["blocks.1"]
    assert [p.name for p in stages[0]] == ["embed.weight", "blocks.0.norm.weight", "blocks.0.norm.bias",
                                           "blocks.0.fc.weight", "blocks.0.fc.bias"]
    assert stages[1][-2].name == "norm.weight"  # after the last block: the last stage


def test_pp_reports_the_fullest_stage_and_zero1_per_stage():
    from accel.planning.estimate import _zero1_max, pipeline_stages, training

    model = FrontHeavy()
    spec = spec_from_module(model)
    first = pipeline_stages(spec, 2)[0]
    numel = sum(p.numel for p in first)
    layouts = training(spec, 4, pp=2)["layouts"]
    assert layouts["ddp"]["params_bytes"] == numel * 4
    moments, steps = _zero1_max([p.numel for p in first], 2)
    assert layouts["zero1"]["optimizer_bytes"] == (2 * moments + steps) * 4


def test_tp_without_a_plan_assumes_the_blocks_matrices_split():
    spec = spec_from_module(Small())  # no layer accel's automatic plan recognises: TP needs a given tp_plan
    assert {p.name for p in spec.params if p.tp_dim == 0} == {f"blocks.{i}.fc.weight" for i in range(3)}
    assert all(p.tp_dim is None for p in spec.params if not p.name.endswith("fc.weight"))


# -- sequence (sp, Ulysses) and context (cp) parallelism ----------------------------------------------------------
def test_sequence_ranks_keep_whole_parameters_and_zero_shards_over_dp_times_the_degree():
    from accel.planning.estimate import training

    spec = _llama_spec()
    plain, sp, cp = training(spec, 4), training(spec, 4, sp=2), training(spec, 4, cp=4)
    assert (sp["dp_size"], sp["sp_size"], sp["cp_size"], cp["dp_size"], cp["cp_size"]) == (2, 2, 1, 1, 4)
    assert plain["sp_size"] == plain["cp_size"] == 1
    for name in ("ddp", "zero1", "zero2", "zero3", "zero3_offload"):  # dp 4, dp 2 x sp 2, cp 4: the same 4 ranks
        assert sp["layouts"][name] == cp["layouts"][name] == plain["layouts"][name], name
    assert sp["layouts"]["ddp"]["params_bytes"] == spec.numel * 4  # whole on every rank
    # with TP: FSDP2 over the TP shards, on dp x sp ranks (here dp 1 x sp 2)
    tp_sp = training(spec, 4, tp=2, sp=2)
    assert tp_sp["dp_size"] == 1 and tp_sp["layouts"]["ddp"] == training(spec, 4, tp=2)["layouts"]["ddp"]
    # one data-parallel rank and cp 2: still 2 ranks to shard over
    assert training(spec, 2, cp=2)["layouts"]["zero3"] == training(spec, 2)["layouts"]["zero3"]
    # pipeline stages x sp 2: each stage's parameters sharded over dp x sp, as over dp 2 without sp
    assert training(spec, 4, pp=2, sp=2)["layouts"]["zero3"] == training(spec, 4, pp=2)["layouts"]["zero3"]


@pytest.mark.parametrize("kwargs,fragment", [
    ({"sp": 2, "cp": 2}, "--sp_size 2 and --cp_size 2: sequence and context parallelism both split the sequence"),
    ({"cp": 3}, "--num_processes 4 is not a multiple of --tp_size 1 x --pp_size 1 x --cp_size 3"),
])
def test_sequence_degree_errors(kwargs, fragment):
    from accel.planning.estimate import EstimateError, training

    with pytest.raises(EstimateError) as info:
        training(_llama_spec(), 4, **kwargs)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_sequence_activations_are_divided_by_the_degree():
    from accel.planning.estimate import activation_bytes, activations, kv_shape, sequence_length

    with torch.device("meta"):
        model = _tiny_llama(layers=2)  # 4 heads, 2 key/value heads of 16: K/V width 32
    whole = activation_bytes(model, 1, 64)
    plain = activations(model, 1, 64)
    assert set(plain) == {"batch_size", "seq_len", "mixed_precision", "no_checkpointing_bytes",
                          "full_checkpointing_bytes", "method"}
    sp = activations(model, 1, 64, sp=2)
    assert sp["no_checkpointing_bytes"] == whole // 2 and sp["one_process_no_checkpointing_bytes"] == whole
    assert (sp["sp_size"], sp["cp_size"]) == (2, 1) and "/ the degree" in sp["method"]
    assert kv_shape(model) == (2, 32)
    cp = activations(model, 1, 64, cp=2)  # plus the other rank's K and V of every layer, float32: 2 x 32 x 32 x 4
    assert cp["no_checkpointing_bytes"] == whole // 2 + 2 * (2 * 64 * 32 * 4 // 2)
    full = activation_bytes(model, 1, 64, checkpointing="full")
    assert cp["full_checkpointing_bytes"] == full // 2 + 2 * 64 * 32 * 4 // 2  # one layer recomputed at a time
    # the sequence is padded as accel's batch cut pads it: to a multiple of sp, or of 2 x cp
    assert (sequence_length(62, sp=2), sequence_length(62, cp=2), sequence_length(62, cp=4)) == (62, 64, 64)
    assert activations(model, 1, 62, cp=2)["one_process_no_checkpointing_bytes"] == whole


def test_sequence_flags_on_the_command_line(capsys):
    assert main(["estimate-memory", f"{__name__}:small", "--json", "--num_processes", "4", "--sp_size", "2"]) == 0
    training = json.loads(capsys.readouterr().out)["training"]
    assert (training["dp_size"], training["sp_size"], training["cp_size"]) == (2, 2, 1)
    assert main(["estimate-memory", f"{__name__}:small", "--num_processes", "4", "--cp_size", "2"]) == 0
    out = capsys.readouterr().out
    assert "processes = dp 2 x tp 1 x pp 1 x cp 2 (ZeRO shards over dp x the sequence degree)" in out
    for args, fragment in [(["--sp_size", "2", "--cp_size", "2"], "both split the sequence"),
                           (["--sp_size", "0"], "--sp_size 0"), (["--cp_size", "3"], "x --cp_size 3")]:
        assert main(["estimate-memory", f"{__name__}:small", "--num_processes", "4", *args]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1, err
