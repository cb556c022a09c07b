"""torch.compile through the recipe: the dynamo keys from every source (config file, Accelerate's `dynamo_config`
section, launch flags, `Accelerator(dynamo_backend=)`, `TorchDynamoPlugin`), one-line refusals, and a compiled
model (whole and regional, inductor on CPU) training like the eager one (fp32, atol 1e-5). The multi-process
backends (DDP, ZeRO-3 with checkpointing, TP 2, PP 2) are checked in tests/multiproc/ecosystem/test_hf_models.py."""

from __future__ import annotations

import pytest
import torch
from accel.cli.launch import flag_overrides
from accel.cli.main import build_parser

from accel import Accelerator
from accel.config import ConfigError, parse_layer, resolve_config
from accel.config.plugins import TorchDynamoPlugin, dynamo_layer


def test_dynamo_keys_from_a_file_and_from_accelerates_section(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("dynamo_backend: inductor\ndynamo_use_regional_compilation: true\n")
    cfg = resolve_config(mine)
    assert (cfg.dynamo_backend, cfg.dynamo_use_regional_compilation, cfg.dynamo_mode) == ("inductor", True, "default")
    theirs = tmp_path / "accelerate.yaml"  # what `accelerate config` writes
    theirs.write_text("distributed_type: 'NO'\ndynamo_config:\n  dynamo_backend: INDUCTOR\n  dynamo_mode: max-autotune\n"
                      "  dynamo_use_fullgraph: false\n  dynamo_use_dynamic: true\n")
    cfg = resolve_config(theirs)
    assert (cfg.dynamo_backend, cfg.dynamo_mode, cfg.dynamo_use_dynamic) == ("inductor", "max-autotune", True)


def test_dynamo_flags():
    args = build_parser().parse_args(["launch", "--dynamo_backend", "aot_eager", "--dynamo_use_regional_compilation",
                                      "train.py"])
    layer = parse_layer(flag_overrides(args), "accel launch flags")
    assert layer == {"dynamo_backend": "aot_eager", "dynamo_use_regional_compilation": True}


@pytest.mark.parametrize("raw,message", [
    ({"dynamo_backend": "turbo"}, "key 'dynamo_backend': bad value 'turbo'; allowed: one of no, eager, aot_eager, inductor"),
    ({"dynamo_config": {"dynamo_speed": 1}}, "dynamo_config.dynamo_speed"),
    ({"dynamo_mode": "fast"}, "key 'dynamo_mode': bad value 'fast'"),
])
def test_bad_dynamo_values_are_one_line_errors(raw, message):
    with pytest.raises(ConfigError, match=None) as info:
        parse_layer(raw, "cfg.yaml")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_accelerator_arguments():
    assert dynamo_layer("inductor") == {"dynamo_backend": "inductor"}
    assert dynamo_layer(None, TorchDynamoPlugin(backend="INDUCTOR", mode="reduce-overhead")) == {
        "dynamo_backend": "inductor", "dynamo_mode": "reduce-overhead"}
    assert dynamo_layer(None, TorchDynamoPlugin(backend="inductor", disable=True)) == {"dynamo_backend": "no"}
    with pytest.raises(ConfigError, match="dynamo_backend and dynamo_plugin are both given"):
        dynamo_layer("inductor", TorchDynamoPlugin(backend="inductor"))
    with pytest.raises(ConfigError, match="TorchDynamoPlugin: argument 'backend': bad value 'fast'"):
        TorchDynamoPlugin(backend="fast").to_layer()


def test_a_backend_this_torch_lacks_is_refused_by_the_accelerator():
    with pytest.raises(ConfigError, match=r"dynamo_backend: 'onnxrt' is not a torch.compile backend of this torch .*; "
                                          r"allowed: no, .*inductor"):
        Accelerator(cpu=True, dynamo_backend="onnxrt")


def _gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("regional", [False, True], ids=["whole", "regional"])
def test_compiled_model_trains_like_eager(regional):
    """Three AdamW steps with inductor equal eager (atol 1e-5); the model is compiled in place (same class, same
    parameter names), and torch.compile really captured graphs."""
    from torch._dynamo.utils import counters

    tokens = torch.randint(0, 64, (3, 2, 8), generator=torch.Generator().manual_seed(0))
    runs = {}
    for backend in ("no", "inductor"):
        torch._dynamo.reset()
        model = _gpt2()
        names = [n for n, _ in model.named_parameters()]
        plugin = TorchDynamoPlugin(backend=backend, use_regional_compilation=regional)
        accelerator = Accelerator(cpu=True, dynamo_plugin=plugin)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
        graphs = counters["stats"]["unique_graphs"]
        losses = []
        for batch in tokens:
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        compiled = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None]
        runs[backend] = (losses, compiled, counters["stats"]["unique_graphs"] - graphs, model)
        assert type(model).__name__ == "GPT2LMHeadModel" and [n for n, _ in model.named_parameters()] == names
        assert model.config.use_cache is (backend == "no")  # a KV cache is off while compiled (it recompiles)
    assert runs["no"][1] == [] and runs["no"][2] == 0
    compiled = runs["inductor"][1]
    assert compiled == (list(runs["inductor"][3].transformer.h) if regional else [runs["inductor"][3]])
    assert runs["inductor"][2] > 0
    assert torch.allclose(torch.tensor(runs["inductor"][0]), torch.tensor(runs["no"][0]), atol=1e-5, rtol=0)


def test_launch_refuses_a_backend_this_torch_lacks(run_accel, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    result = run_accel("launch", "--dynamo_backend", "onnxrt", script)
    assert result.returncode == 2 and "ran" not in result.stdout
    assert result.stderr.strip().splitlines() == [
        result.stderr.strip().splitlines()[0]] and "dynamo_backend: 'onnxrt' is not a torch.compile backend" in result.stderr
