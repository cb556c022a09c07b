"""Accelerator on one process: precision policy, accumulation semantics, wrappers, errors."""

import copy
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from accel import Accelerator, GradScalerKwargs, ParallelismConfig
from accel.config import ConfigError
from accel.optimizer import AcceleratedOptimizer
from accel.scheduler import AcceleratedScheduler
from accel.utils import set_seed


@pytest.fixture(autouse=True)
def isolated_config(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv("ACCEL_LAUNCH_CONFIG", raising=False)


def make(seed=0, dim=4):
    set_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(dim, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_prepare_returns_same_order_and_wrapper_types():
    model, optimizer = make()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    accelerator = Accelerator(cpu=True)
    s, lo, o, m = accelerator.prepare(scheduler, loader, optimizer, model)
    assert isinstance(s, AcceleratedScheduler) and s.scheduler is scheduler
    assert isinstance(o, AcceleratedOptimizer) and o.optimizer is optimizer
    assert isinstance(lo, DataLoader) and len(lo) == 4
    assert m is model and accelerator.unwrap_model(m) is model
    assert accelerator.prepare(model) is model  # a single object comes back unpacked
    assert accelerator.distributed_type == "NO" and accelerator.num_processes == 1
    assert accelerator.device == torch.device("cpu")


def test_gradient_accumulation_equals_one_big_batch():
    """k accumulation steps of batch b give the same update as one step on batch k*b (atol 1e-6)."""
    x, y = torch.randn(16, 4, generator=torch.Generator().manual_seed(3)), torch.randn(16, 1)
    ref_model, ref_opt = make()
    torch.nn.functional.mse_loss(ref_model(x[:8]), y[:8]).backward()
    ref_opt.step()

    model, optimizer = make()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    before = copy.deepcopy(model.state_dict())
    for i, sl in enumerate([slice(0, 4), slice(4, 8)]):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x[sl]), y[sl]))
            optimizer.step()
            optimizer.zero_grad()
        if i == 0:  # off the boundary: step and zero_grad did nothing
            assert not accelerator.sync_gradients
            assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
            assert model[0].weight.grad is not None
    assert accelerator.sync_gradients
    for k, v in ref_model.state_dict().items():
        assert torch.allclose(model.state_dict()[k], v, atol=1e-6), k


def test_end_of_dataloader_forces_sync():
    model, optimizer = make()
    loader = DataLoader(TensorDataset(torch.randn(6, 4)), batch_size=2)  # 3 batches, window of 4
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    syncs = []
    for (xb,) in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(xb).sum())
            syncs.append(accelerator.sync_gradients)
    assert syncs == [False, False, True]


def test_bf16_autocasts_forward_keeps_fp32_master_weights():
    model, optimizer = make()
    accelerator = Accelerator(cpu=True, mixed_precision="bf16")
    model, optimizer = accelerator.prepare(model, optimizer)
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    out = model(torch.randn(2, 4))
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32  # outputs handed back in float32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    accelerator.backward(out.sum())
    assert model[0].weight.grad.dtype == torch.float32
    assert accelerator.mixed_precision == "bf16" and accelerator.scaler is None
    with accelerator.autocast():
        assert torch.mm(torch.randn(2, 2), torch.randn(2, 2)).dtype == torch.bfloat16
    plain = accelerator.unwrap_model(model, keep_fp32_wrapper=False)
    assert plain(torch.randn(2, 4)).dtype == torch.float32 and seen[-1] == torch.float32


def test_fp16_skips_inf_step_and_scheduler():
    model, optimizer = make(dim=2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    accelerator = Accelerator(cpu=True, mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024)])
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    assert accelerator.scaler is not None
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    before = copy.deepcopy(model.state_dict())
    scale = accelerator.scaler.get_scale()
    assert scale == 1024

    loss = model(torch.randn(2, 2)).sum() * float("inf")
    accelerator.backward(loss)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    assert seen == [torch.float16]
    assert accelerator.optimizer_step_was_skipped
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scheduler.get_last_lr() == [0.1]  # not stepped
    assert accelerator.scaler.get_scale() == scale * 0.5

    accelerator.backward(model(torch.randn(2, 2)).sum())
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)  # unscales first
    optimizer.step()
    scheduler.step()
    assert not accelerator.optimizer_step_was_skipped
    assert torch.isfinite(norm) and norm < 100  # unscaled: not multiplied by the 512 loss scale
    assert not all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scheduler.get_last_lr() == [0.05]


def test_clip_grad_norm_returns_total_norm():
    model, optimizer = make()
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.randn(5, 4)).pow(2).sum())
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = accelerator.clip_grad_norm_(model.parameters(), max_norm=0.5)
    assert torch.allclose(norm, expected)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert clipped == pytest.approx(0.5, rel=1e-4)
    accelerator.clip_grad_value_(model.parameters(), 1e-3)
    assert max(p.grad.abs().max() for p in model.parameters()) <= 1e-3


def test_collectives_on_one_process():
    accelerator = Accelerator(cpu=True)
    t = torch.arange(3)
    assert torch.equal(accelerator.gather(t), t)
    assert accelerator.gather(torch.tensor(5.0)).shape == (1,)
    assert torch.equal(accelerator.reduce(t), t)
    assert torch.equal(accelerator.pad_across_processes(t), t)
    with accelerator.split_between_processes([1, 2, 3]) as part:
        assert part == [1, 2, 3]
    calls = []
    accelerator.on_main_process(lambda: calls.append(1))()
    assert calls == [1]
    with accelerator.main_process_first():
        pass
    accelerator.wait_for_everyone()


def test_split_between_processes_rule():
    from accel.state import split_for_process

    parts = [split_for_process(list(range(7)), 3, i) for i in range(3)]
    assert parts == [[0, 1, 2], [3, 4], [5, 6]]
    padded = [split_for_process(list(range(7)), 3, i, apply_padding=True) for i in range(3)]
    assert [len(p) for p in padded] == [3, 3, 3]
    tensors = [split_for_process(torch.arange(5), 2, i) for i in range(2)]
    assert torch.equal(torch.cat(tensors), torch.arange(5))


@pytest.mark.parametrize("parallelism,needle", [
    (ParallelismConfig(zero_stage=2, pp_size=2, offload_params=True),
     "pipeline parallelism (pp_size=2) with CPU offload is not available yet"),
    (ParallelismConfig(tp_size=2, zero_stage=1), "tensor parallelism (tp_size=2) with ZeRO stage 1"),
])
def test_unavailable_backends_error_instead_of_falling_back(parallelism, needle):
    with pytest.raises(ConfigError, match="not available yet") as info:
        Accelerator(cpu=True, parallelism_config=parallelism)
    assert needle in str(info.value)


def test_degrees_that_do_not_divide_the_world_are_refused():
    with pytest.raises(ConfigError, match="tp_size=2 x pp_size=1 = 2 does not divide the world size 1"):
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(tp_size=2))


def test_fp8_without_torchao_and_unknown_arguments_are_clear_errors(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    with pytest.raises(ConfigError, match=r"fp8 needs torchao.*pip install 'accel-train\[fp8\]'"):
        Accelerator(cpu=True, mixed_precision="fp8")
    with pytest.raises(ConfigError, match="mixed_precision.*'fp32'.*allowed: one of no, fp16, bf16, fp8"):
        Accelerator(cpu=True, mixed_precision="fp32")
    with pytest.raises(ConfigError, match="deepspeed_plugin"):
        Accelerator(cpu=True, deepspeed_plugin=object())
    with pytest.raises(ConfigError, match="ParallelismConfig.*zero_stage.*bad value 7.*0 to 3"):
        ParallelismConfig(zero_stage=7)


def test_accelerator_arguments_override_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("mixed_precision: bf16\ngradient_accumulation_steps: 3\n")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(cfg))
    assert Accelerator(cpu=True).mixed_precision == "bf16"
    assert Accelerator(cpu=True).gradient_accumulation_steps == 3
    accelerator = Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    assert accelerator.mixed_precision == "no" and accelerator.gradient_accumulation_steps == 2


def test_facade_never_branches_on_backend():
    accel_dir = Path(__file__).resolve().parents[3] / "accel"
    source = "\n".join(path.read_text() for path in [accel_dir / "accelerator.py",
                                                       *sorted((accel_dir / "accelerator_mixins").glob("*.py"))])
    for forbidden in ("isinstance(self.backend", "backend.name ==", "DistributedDataParallel(", "torch.nn.parallel", "DDPBackend",
                      "DistributedType.MULTI", "distributed_type =="):
        assert forbidden not in source, forbidden


def test_micro_batch_size_from_a_deepspeed_config_is_checked_against_the_loader():
    accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(micro_batch_size=8))
    with pytest.warns(UserWarning, match="micro_batch_size .* is 8 but this data loader gives each process batches of 2"):
        accelerator.prepare(DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2))


def test_save_writes_once_atomically(tmp_path):
    from safetensors.torch import load_file

    accelerator = Accelerator(cpu=True)
    accelerator.save({"w": torch.arange(3.0)}, tmp_path / "w.safetensors", safe_serialization=True)
    assert torch.equal(load_file(str(tmp_path / "w.safetensors"))["w"], torch.arange(3.0))
    accelerator.save({"step": 3, "w": torch.ones(2)}, tmp_path / "obj.pt")
    loaded = torch.load(tmp_path / "obj.pt", weights_only=True)
    assert loaded["step"] == 3 and torch.equal(loaded["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["obj.pt", "w.safetensors"]


def test_accelerate_distributed_type_names_exist():
    from accel import DistributedType

    accelerator = Accelerator(cpu=True)
    assert accelerator.distributed_type != DistributedType.DEEPSPEED
    assert accelerator.distributed_type != DistributedType.FSDP
    assert accelerator.distributed_type == "NO"


def test_loss_fn_given_to_prepare_lets_any_backend_take_target():
    """The pipeline loop (`loss = model(x, target=y)`) runs unchanged on the other backends."""
    set_seed(0)
    model = torch.nn.Linear(3, 1)
    reference = copy.deepcopy(model)
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(model, loss_fn=torch.nn.functional.mse_loss)
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    loss = prepared(x, target=y)
    assert torch.equal(loss, torch.nn.functional.mse_loss(reference(x), y))
    assert torch.equal(prepared(x), reference(x))  # without target: the outputs
    accelerator.backward(loss)
    assert model.weight.grad is not None


def test_loss_fn_gets_a_model_outputs_logits_on_every_backend():
    """As under pipeline parallelism, loss_fn receives a ModelOutput's logits, so one loss_fn serves all."""
    from transformers.modeling_outputs import CausalLMOutput

    class HF(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return CausalLMOutput(logits=self.fc(x))

    model = HF()
    prepared = Accelerator(cpu=True).prepare(model, loss_fn=lambda logits, y: (logits - y).pow(2).mean())
    x, y = torch.randn(4, 3), torch.randn(4, 2)
    assert torch.equal(prepared(x, target=y), (model.fc(x) - y).pow(2).mean())
    assert isinstance(prepared(x), CausalLMOutput)  # without target: the outputs as they are


def test_precision_policy_decides_the_scaler_and_fsdp_policy_once():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from accel.runtime.precision import PrecisionPolicy

    fp16 = PrecisionPolicy("fp16", torch.device("cpu"))
    fp16.choose_scaler(partial_gradients=False)
    assert type(fp16.scaler) is torch.amp.GradScaler
    fp16.choose_scaler(partial_gradients=True)  # a rank holding part of the gradients must agree on inf/nan
    assert isinstance(fp16.scaler, ShardedGradScaler)
    bf16 = PrecisionPolicy("bf16", torch.device("cpu"))
    bf16.choose_scaler(partial_gradients=True)
    assert bf16.scaler is None
    policy = bf16.fsdp_policy()
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert PrecisionPolicy("no", torch.device("cpu")).fsdp_policy() is None


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_recomputes_blocks_with_equal_gradients(mode):
    """Each repeated block runs its forward again in backward; the gradients equal the run without (fp32, 1e-6)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    grads, calls = {}, {}
    for name in ("no", mode):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(config)
        accelerator = Accelerator(cpu=True, parallelism_config=ParallelismConfig(activation_checkpointing=name))
        model = accelerator.prepare(model)
        count = [0]
        model.transformer.h[0].mlp.register_forward_pre_hook(lambda *_: count.__setitem__(0, count[0] + 1))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
        calls[name] = count[0]
        model.eval()
        with torch.no_grad():
            model(input_ids=tokens)  # evaluation does not recompute
        calls[name + " eval"] = count[0]
    assert calls == {"no": 1, "no eval": 2, mode: 2, mode + " eval": 3}
    for key, value in grads["no"].items():
        assert torch.allclose(grads[mode][key], value, atol=1e-6, rtol=0), key


def test_fp16_on_a_cpu_says_what_runs_under_import_accel():
    """accel keeps float16 autocast and a CPU GradScaler for fp16 on a CPU (Accelerate runs float32 there; under
    `import accelerate` accel does too, tests/unit/accelerate/test_accelerate_compat.py): one line says which."""
    import warnings

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    notes = [str(w.message) for w in said if "fp16 on a CPU" in str(w.message)]
    assert notes == ["accel: mixed_precision fp16 on a CPU runs float16 autocast with a CPU GradScaler (Accelerate "
                     "runs float32 here, and so does accel under `import accelerate`)"]
    assert accelerator.scaler is not None and accelerator.precision.dtype == torch.float16
