"""The three trainers of `versus.py`, each run in a process of its own: accel, Accelerate (FSDP2) and torchtitan.

Every worker reads the same spec (model dimensions, sequence length, batch, steps, precision, compile), loads the
same initial weights (a safetensors file of a transformers Llama) and the same random tokens, trains with AdamW
(torchtitan's betas, eps and weight decay; fused on CUDA), clips the gradient norm at 1.0 as torchtitan does, and
times every step between two `torch.cuda.synchronize()`: the record holds each step's seconds and loss and the peak
memory. The loss is the mean cross-entropy of the next token over every position, computed the same way in each.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

ADAMW = {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # torchtitan's default_adamw
MAX_NORM = 1.0  # torchtitan's training.max_norm


# -- shared by every peer -----------------------------------------------------------------------------------------
def device_of(spec: dict):
    import torch

    return torch.device("cpu") if spec["cpu"] else torch.device("cuda", 0)


def hf_config(spec: dict):
    """The transformers LlamaConfig of the spec's dimensions (Llama 3 RoPE scaling, tied embeddings as Llama 3.2)."""
    from transformers import LlamaConfig

    m = spec["model"]
    return LlamaConfig(hidden_size=m["dim"], intermediate_size=m["ffn"], num_hidden_layers=m["layers"],
                       num_attention_heads=m["heads"], num_key_value_heads=m["kv_heads"], vocab_size=m["vocab"],
                       tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072, use_cache=False,
                       attn_implementation="sdpa",
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 8192})


def prepare_inputs(spec: dict) -> None:
    """Write the initial weights (a transformers Llama initialised under seed 0, float32) and the random tokens
    every peer trains on: (steps x batch) rows of seq + 1 tokens, the labels being the inputs shifted by one."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device_of(spec)):
        model = LlamaForCausalLM(hf_config(spec))
    weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, spec["weights"])
    total = spec["warmup"] + spec["steps"]
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec["model"]["vocab"], (total * spec["batch"], spec["seq"] + 1), generator=generator)
    torch.save(tokens, spec["tokens"])


def batches(spec: dict):
    """(inputs, labels) of each step, on the CPU."""
    import torch

    tokens = torch.load(spec["tokens"])
    b = spec["batch"]
    for i in range(tokens.shape[0] // b):
        rows = tokens[i * b:(i + 1) * b]
        yield rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


def hf_model(spec: dict):
    """The transformers Llama with the shared initial weights, in float32 on the device."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    with torch.device(device_of(spec)):
        model = LlamaForCausalLM(hf_config(spec))
    missing, unexpected = model.load_state_dict(load_file(spec["weights"]), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


def adamw(params, spec: dict):
    import torch

    return torch.optim.AdamW(params, lr=spec["lr"], fused=not spec["cpu"], **ADAMW)


def next_token_loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def float8_filter(module, name: str) -> bool:
    """The layers converted to float8 in every peer: each Linear of the blocks, not the output head (torchtitan's
    filter_fqns=["lm_head"]; dimensions multiples of 16)."""
    import torch

    return (isinstance(module, torch.nn.Linear) and "lm_head" not in name
            and module.in_features % 16 == 0 and module.out_features % 16 == 0)


def float8_recipe():
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig.from_recipe_name("rowwise")  # torchtitan's default recipe


def timed_loop(spec: dict, step) -> dict:
    """Run `step(inputs, labels) -> loss` over every batch, each step timed between two synchronizations."""
    import torch

    device = device_of(spec)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    seconds, losses = [], []
    for inputs, labels in batches(spec):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(inputs, labels)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated() if cuda else 0
    return {"seconds": seconds, "losses": losses, "peak_bytes": peak}


def layout(model) -> str:
    """What the prepared model is: FSDP2 (parameters are DTensors) or plain, and its parameters' dtype."""
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    kind = "FSDP2" if any(isinstance(p, DTensor) for p in params) else "not sharded"
    return f"{kind}, {type(model).__name__}, parameters {params[0].dtype}".replace("torch.", "")


def hf_step(spec: dict, model, optimizer, backward, clip):
    device = device_of(spec)

    def step(inputs, labels):
        logits = model(input_ids=inputs.to(device)).logits
        loss = next_token_loss(logits, labels.to(device))
        backward(loss)
        clip(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


# -- accel ----------------------------------------------------------------------------------------------------------
def run_accel(spec: dict) -> dict:
    """This repository's Accelerator with ZeRO-3 asked for. On one process accel's data-parallel plan is "none"
    whatever the stage (nothing to shard or reduce), so the model runs unsharded under bf16 autocast with float32
    parameters; the record's setup says which layout ran."""
    from accel import Accelerator, ParallelismConfig
    from accel.utils import AORecipeKwargs, TorchDynamoPlugin

    config = spec["config"]
    handlers = ([AORecipeKwargs(config=float8_recipe(), module_filter_func=float8_filter)]
                if config["float8"] else [])
    dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if config["compile"] else None
    parallelism = ParallelismConfig(zero_stage=3)
    accelerator = Accelerator(mixed_precision="fp8" if config["float8"] else "bf16", cpu=spec["cpu"],
                              kwargs_handlers=handlers, dynamo_plugin=dynamo, parallelism_config=parallelism)
    model = hf_model(spec)
    optimizer = adamw(model.parameters(), spec)
    model, optimizer = accelerator.prepare(model, optimizer)
    record = timed_loop(spec, hf_step(spec, model, optimizer, accelerator.backward, accelerator.clip_grad_norm_))
    record["setup"] = f"Accelerator(zero_stage=3), {layout(model)}"
    accelerator.end_training()
    return record


# -- Accelerate -----------------------------------------------------------------------------------------------------
def run_accelerate(spec: dict) -> dict:
    """Hugging Face Accelerate with FSDP2 (fully_shard per decoder layer, bf16 parameters, fp32 reduction)."""
    import torch
    import accelerate
    from accelerate import Accelerator
    from accelerate.utils import AORecipeKwargs, FullyShardedDataParallelPlugin, TorchDynamoPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert "accel" not in Path(accelerate.__file__).parts[-3:-1], "the real Accelerate, not accel's shim"
    config = spec["config"]
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], state_dict_type="SHARDED_STATE_DICT",
        mixed_precision_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        cpu_ram_efficient_loading=False, activation_checkpointing=False)
    handlers = ([AORecipeKwargs(config=float8_recipe(), module_filter_func=float8_filter)]
                if config["float8"] else [])
    dynamo = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True) if config["compile"] else None
    accelerator = Accelerator(mixed_precision="fp8" if config["float8"] else "bf16", cpu=spec["cpu"],
                              fsdp_plugin=plugin, kwargs_handlers=handlers, dynamo_plugin=dynamo)
    model = hf_model(spec)
    optimizer = adamw(model.parameters(), spec)
    model, optimizer = accelerator.prepare(model, optimizer)
    record = timed_loop(spec, hf_step(spec, model, optimizer, accelerator.backward, accelerator.clip_grad_norm_))
    record["setup"] = f"accelerate {accelerate.__version__}, {accelerator.distributed_type}, {layout(model)}"
    accelerator.end_training()
    return record


# -- torchtitan -----------------------------------------------------------------------------------------------------
STAND_INS = {  # a package torchtitan imports at import time that this run never uses -> the modules standing in
    "triton": ["triton", "triton.language"],  # its expert-parallel kernels; a CPU-only torch has no triton
    "datasets": ["datasets", "datasets.distributed"],  # its Hugging Face data loaders (pyarrow, pandas)
    "tensorboard": ["torch.utils.tensorboard"],  # its metrics' SummaryWriter, made only with enable_tensorboard
}


def stub_missing_modules(stand_ins: dict[str, list[str]] = STAND_INS) -> list[str]:
    """Put stand-ins in place of the modules of each package of `stand_ins` that is not installed; the names of
    those packages. Torch's own probes for triton run first, so torch still sees no triton."""
    import importlib.util

    import torch.utils._triton as torch_triton

    torch_triton.has_triton_package()  # cached: torch asks once
    import torch._dynamo.repro.after_dynamo  # the modules that probe triton at import
    import torch._inductor.codecache
    import torch._inductor.runtime.triton_compat  # noqa: F401

    class Anything:
        def __call__(self, *args, **kwargs):
            return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return self

        def __getitem__(self, key):
            return self

    anything = Anything()

    def module_getattr(name):
        if name.startswith("__"):
            raise AttributeError(name)
        return anything

    absent = sorted(package for package in stand_ins if importlib.util.find_spec(package) is None)
    for package in absent:
        for name in stand_ins[package]:
            module = types.ModuleType(name)
            module.__getattr__ = module_getattr  # type: ignore[method-assign]
            module.__version__ = "0.0.0"
            module.__path__ = []  # a package, so its submodules import
            sys.modules[name] = module
            parent, _, child = name.rpartition(".")
            if parent in sys.modules:
                setattr(sys.modules[parent], child, module)
    return absent


def cpu_device_module():
    """torch.cpu with what torchtitan asks of a device module (name, properties, memory statistics, set_device),
    answered for the CPU: its Trainer then runs on a CPU as on a GPU."""
    import torch

    module = types.SimpleNamespace(**{n: getattr(torch.cpu, n) for n in dir(torch.cpu) if not n.startswith("_")})
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.__dict__.update(
        get_device_name=lambda *_: "cpu", current_device=lambda: 0, device_count=lambda: 1,
        set_device=lambda *_: None, synchronize=lambda *_: None, empty_cache=lambda: None,
        reset_peak_memory_stats=lambda *_: None, memory_stats=lambda *_: {},
        get_device_properties=lambda *_: types.SimpleNamespace(name="cpu", total_memory=total))
    return module


def titan_model_config(spec: dict):
    """torchtitan's Llama3Model.Config: its registry's 1B flavour when the dimensions are Llama 3.2 1B's, else the
    same builder at the spec's dimensions; float8 through its Float8LinearConverter (rowwise, lm_head kept)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, _NORM_INIT, _output_linear_init

    m = spec["model"]
    dim, vocab = m["dim"], m["vocab"]
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab, enable_weight_tying=True,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=m["layers"], dim=dim, n_heads=m["heads"], n_kv_heads=m["kv_heads"],
            hidden_dim=m["ffn"], attn_backend="flex",
            rope=ComplexRoPE.Config(dim=dim // m["heads"], max_seq_len=131072, theta=500000, scaling="llama")))
    if spec["cpu"]:  # flex attention has no backward on a CPU; one document per row, so causal SDPA is the same
        from torchtitan.models.common.attention import ScaledDotProductAttention

        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if spec["config"]["float8"]:
        from torchtitan.components.quantization import Float8LinearConverter

        converter = Float8LinearConverter.Config(recipe_name="rowwise", filter_fqns=["lm_head"],
                                                 model_compile_enabled=spec["config"]["compile"])
        config = converter.build().convert(config)
    return config


def titan_trainer_config(spec: dict, data_classes):
    """torchtitan's Trainer.Config for this run: FSDP2 over the ranks (its default), bf16 parameters and fp32
    reduction, no activation checkpointing, plain cross-entropy, AdamW as the others, constant learning rate."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec_model = model_registry("1B")
    spec_model.model = titan_model_config(spec)
    tokenizer, loader = data_classes
    cuda_graphs = spec.get("titan_cuda_graphs", True) and not spec["cpu"]
    return Trainer.Config(
        model_spec=spec_model, hf_assets_path="", dump_folder=spec["dump_folder"],
        loss=CrossEntropyLoss.Config(global_vocab_size=spec["model"]["vocab"]),
        optimizer=default_adamw(lr=spec["lr"], implementation="for-loop" if spec["cpu"] else "fused"),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=0, decay_ratio=0.0),
        training=TrainingConfig(local_batch_size=spec["batch"], seq_len=spec["seq"],
                                steps=spec["warmup"] + spec["steps"], max_norm=MAX_NORM,
                                disable_cuda_graphs=not cuda_graphs),
        tokenizer=tokenizer.Config(), dataloader=loader.Config(dataset=spec["tokens"]),
        metrics=MetricsProcessor.Config(log_freq=1),
        activation_checkpoint=None,  # type: ignore[arg-type]  (parallelize_llama applies none)
        compile=CompileConfig(enable=spec["config"]["compile"], components=["model", "loss"]),
    )


def titan_data_classes(spec: dict):
    """A tokenizer that is never asked anything and a data loader of the shared tokens, in torchtitan's shapes:
    ({"input": ids, "positions": 0..seq-1}, labels); one document per row, so its block-causal mask is causal."""
    from dataclasses import dataclass

    import torch
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class NoTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, **_ignored):
            super().__init__()

        def encode(self, *args, **kwargs):
            raise NotImplementedError

        def decode(self, *args, **kwargs):
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return spec["model"]["vocab"]

    class SharedTokens(BaseDataLoader):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config=None, **_ignored):
            pass

        def __iter__(self):
            for inputs, labels in batches(spec):
                positions = torch.arange(inputs.shape[1]).expand_as(inputs).contiguous()
                yield {"input": inputs, "positions": positions}, labels

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    return NoTokenizer, SharedTokens


def titan_load_weights(spec: dict, model, model_config) -> None:
    """The shared transformers weights into torchtitan's model, through its Llama3StateDictAdapter; each tensor laid
    out as the model's own state dict lays it out (a DTensor under FSDP2; its hooks fuse wq/wk/wv into wqkv)."""
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

    state = Llama3StateDictAdapter(model_config, None).from_hf(load_file(spec["weights"]))
    current = model.state_dict()
    assert set(state) == {k for k in current if "freqs_cis" not in k}, set(state) ^ set(current)
    ready = {}
    for key, full in state.items():
        like = current[key]
        full = full.to(device=like.device, dtype=like.dtype)
        ready[key] = distribute_tensor(full, like.device_mesh, like.placements) if isinstance(like, DTensor) else full
    result = model.load_state_dict(ready, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys


def run_torchtitan(spec: dict) -> dict:
    """torchtitan's Trainer, built from its Trainer.Config, each step its own `train_step`. On a CPU it runs with a
    stand-in for the CUDA device module it takes where torch names no accelerator (`cpu_device_module`)."""
    stubbed = stub_missing_modules()
    import torchtitan
    import torchtitan.tools.utils as titan_utils

    if spec["cpu"]:  # torchtitan takes "cuda" where torch names no accelerator; its modules copy the name on import
        titan_utils.device_type, titan_utils.device_module = "cpu", cpu_device_module()

    data_classes = titan_data_classes(spec)
    config = titan_trainer_config(spec, data_classes)
    record = titan_trainer(spec, config)
    version = getattr(torchtitan, "__version__", "?")
    record["setup"] = f"torchtitan {version}, {record.get('setup', '')}".rstrip(", ")
    if stubbed:
        record["setup"] += f"; stand-ins for the unused imports {', '.join(stubbed)}"
    return record


def titan_trainer(spec: dict, config) -> dict:
    import torch
    from torchtitan.trainer import Trainer

    trainer = Trainer(config)
    titan_load_weights(spec, trainer.model_parts[0], trainer.model_config)
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def keep_loss(step, global_avg_loss, *args, **kwargs):
        losses.append(float(global_avg_loss))
        return log(step, global_avg_loss, *args, **kwargs)

    trainer.metrics_processor.log = keep_loss
    data = trainer.batch_generator(trainer.dataloader)

    def step(inputs, labels):
        trainer.step += 1
        trainer.train_step(data)
        return losses[-1]

    record = timed_loop(spec, step)
    graphs = "off" if config.training.disable_cuda_graphs else "on"
    attention = "SDPA (flex has no backward on a CPU)" if spec["cpu"] else "flex attention"
    record["setup"] = f"Trainer, FSDP2, {attention}, CUDA graphs {graphs}"
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return record


RUNNERS = {"accel": run_accel, "accelerate": run_accelerate, "torchtitan": run_torchtitan}


def worker(spec_path: str, out_path: str) -> None:
    """One peer under one config: read the spec, run, write the record."""
    spec = json.loads(Path(spec_path).read_text())
    if spec.get("site"):
        sys.path.insert(0, spec["site"])  # the peers' packages installed from benchmarks/wheels
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    code = 0
    try:
        if spec["peer"] == "prepare":
            prepare_inputs(spec)
            record: dict = {"prepared": True}
        else:
            record = RUNNERS[spec["peer"]](spec)
        Path(out_path).write_text(json.dumps(record))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no waiting at exit on threads a trainer left behind (compile workers, a wedged collective)
