"""Model-state memory estimates: what a model's weights take per dtype, its largest layer, and the bytes per
rank of parameters, gradients and AdamW state for each layout as accel's backends really keep them.

Plain functions over a `ModelSpec` (parameter names, sizes, repeated blocks), so `accel estimate-memory` and a
later `accel plan` share them. Models are built on the meta device: a 70B config takes seconds, no memory.

What accel keeps (accel/runtime/precision.py, accel/backends/{ddp,zero,recipe,spmd,tensor,pipeline}.py), AdamW, N data-
parallel ranks: parameters stay float32 in every mixed-precision mode (bf16/fp16 are autocast: no separate master
copy), gradients float32, two float32 moments plus a 0-d float32 `step` per parameter. DDP: all of it on every
rank. ZeRO-1 (ZeroRedundancyOptimizer + DDP): whole parameters' optimizer state, partitioned greedily by size.
ZeRO-2/3 (FSDP2 `fully_shard` per repeated block, then the root): parameters, gradients and state as dim-0
shards (rank 0 holds the largest, ceil(dim0 / N) rows); stage 2 differs from 3 only while it computes.
Offload (FSDP2 CPUOffloadPolicy): the same shards on the host, nothing on the device between steps.
Tensor parallelism splits each parameter as accel's plan does (tensor_plan.py: the model's own plan, else the
automatic one; a vocabulary-split embedding's gradient comes back whole); with data parallelism next to it,
every zero stage is FSDP2 over the TP shards (DDP takes no DTensors). Pipeline parallelism cuts the blocks as
accel's balanced split does (pipeline_split.py); each stage then runs the same data-parallel layout on its own.
Sequence (sp, Ulysses) and context (cp) parallelism keep whole parameters on each of their ranks, which compute
parts of the same gradients: gradients are reduced, and ZeRO shards, over dp x sp/cp (FSDP2 over the `dp_cp`
mesh dimension, as torchtitan does); the activations of one step are divided by the degree.
Measured to the byte against real gloo runs by benchmarks/bench_estimate.py.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from accel.planning import inputs
from accel.planning.inputs import EstimateError

__all__ = ["EstimateError"]  # defined with the input checks (accel.planning.inputs), raised from here too

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "float8_e4m3fn": 1}
STATE_BYTES = 4  # float32 parameters, gradients and each Adam moment
LAYOUTS = ("ddp", "zero1", "zero2", "zero3", "zero3_offload")
ASSUMPTIONS = ("AdamW; parameters, gradients and both moments float32 in every mixed-precision mode (accel's "
               "bf16/fp16 are autocast with float32 weights: no separate master copy, master_bytes 0); plus a 0-d "
               "float32 step per parameter; ZeRO-2/3 shard each parameter on dim 0 (rank 0's shard, the largest, "
               "is reported); ZeRO-1 partitions whole parameters greedily by size; TP splits what accel's tensor "
               "parallel plan splits (the model's own plan, else the automatic one: q/k/v/gate/up by output rows, "
               "o/down by input columns, a vocabulary embedding and the output head by vocabulary; norms and "
               "other parameters replicated; a safetensors checkpoint: by parameter names; a model accel finds "
               "no plan for: a given plan splitting the >=2-D parameters of the repeated blocks), on the plan's "
               "dimension, a vocabulary-split embedding's gradient whole (replicated); with TP and more than one "
               "data-parallel rank every stage (ZeRO-0 included; ZeRO-1 is refused) is FSDP2 over dim 0 of the "
               "TP shards; PP cuts the repeated blocks into contiguous stages balancing the parameter count as "
               "accel's automatic split does (the parameters before the first block count with it and sit on "
               "the first stage, the others with the last), one stage per rank (pp_schedule 1F1B/GPipe), each "
               "stage with its own data-parallel layout, the "
               "largest stage's rank reported; sequence/context parallelism (sp/cp) keep whole parameters and "
               "reduce gradients over dp x sp/cp, over which ZeRO-1/2/3 shard (FSDP2 over dp x cp, as torchtitan); "
               "the model states exclude activations (measured apart with "
               "--batch_size/--seq_len), gathered parameters and communication buffers (e.g. DDP's gradient "
               "buckets)")


@dataclass
class Param:
    name: str
    shape: tuple
    itemsize: int  # as stored (safetensors) or as created (module)
    block: str | None  # the repeated block (ZeRO/FSDP2 wrap unit) holding it, None for the root's own
    tp_dim: int | None = None  # the dimension tensor parallelism splits (None: every TP rank holds it whole)
    tp_whole_grad: bool = False  # split, but its gradient comes back whole (a vocabulary-split nn.Embedding)
    expert: bool = False  # a MoE layer's expert parameter: expert parallelism keeps 1/ep of these on each rank

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class ModelSpec:
    source: str
    params: list[Param] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)


# -- reading a model ------------------------------------------------------------------------------------------
def spec_from_module(model: torch.nn.Module, source: str = "module") -> ModelSpec:
    """The parameters of `model` (tied ones once), each with the repeated block (nn.ModuleList member) that
    accel's ZeRO would wrap it in."""
    owner: dict[int, str] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList):
            for child_name, child in module.named_children():
                block = f"{name}.{child_name}" if name else child_name
                for p in child.parameters():
                    owner.setdefault(id(p), block)  # outer blocks win, as wrapping them covers the inner
    params = [Param(n, tuple(p.shape), p.element_size(), owner.get(id(p))) for n, p in model.named_parameters()]
    splits = _tp_splits(model)
    if splits is None:
        _tp_split_blocks(params)
    for param in params:
        param.tp_dim, param.tp_whole_grad = (splits or {}).get(param.name, (param.tp_dim, False))
    experts = _expert_names(model)
    for param in params:
        param.expert = param.name in experts if experts is not None else _is_expert_name(param.name)
    return ModelSpec(source, params)


def _expert_names(model: torch.nn.Module) -> set[str] | None:
    """The parameters accel's expert parallelism divides (accel.parallel.expert recognises their modules); None:
    no MoE layer it recognises (names decide then, as for a checkpoint)."""
    from accel.parallel.expert import expert_param_names

    names = expert_param_names(model)
    return names or None


def _is_expert_name(name: str) -> bool:
    """A checkpoint's expert parameter by its name: transformers' MoE layers keep them under `.experts.`."""
    return ".experts." in name


def _tp_split_blocks(params: list[Param]) -> None:
    """No plan accel can find (it refuses TP without ParallelismConfig(tp_plan=...)): assume a given plan that
    splits every >= 2-D parameter of the repeated blocks on dim 0."""
    for p in params:
        p.tp_dim = 0 if p.block and len(p.shape) >= 2 else None


def _tp_splits(model: torch.nn.Module) -> dict[str, tuple] | None:
    """parameter name -> (dimension split, gradient whole) under the tensor-parallel plan accel would apply to
    `model` (its own plan, else the automatic one, ties kept: accel/parallel/tensor_plan.py); None when accel
    finds no plan it can use (it would refuse TP unless given one)."""
    import contextlib
    import io

    from accel.parallel import tensor_plan as tpl
    from accel.config import ConfigError

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # model_plan prints the entries it leaves out
            plan = tpl.model_plan(model) or tpl.automatic_plan(model)
            plan, _ = tpl.keep_ties(model, tpl.expand_plan(model, plan))
    except (ConfigError, AttributeError, KeyError, ValueError):
        return None
    if not plan:
        return None
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    splits = {}
    for module_name, style in plan.items():
        module = model.get_submodule(module_name)
        for leaf, param in module.named_parameters(recurse=False):
            dim = tpl.split_dim(module, leaf, style)
            if dim == -1:  # fused q/k/v: split by output features, in parts (the local numel is 1/tp)
                dim = 1 if tpl.is_conv1d(module) and leaf == "weight" else 0
            if dim is None or dim >= param.dim():
                continue
            whole_grad = isinstance(module, torch.nn.Embedding) and style.startswith("rowwise")
            for name in names[id(param)]:
                splits[name] = (dim, whole_grad)
    return splits


def _tp_split_by_name(name: str, shape: tuple) -> tuple:
    """(dimension, gradient whole) for a parameter known by name only, as accel's automatic plan would split it."""
    from accel.parallel import tensor_plan as tpl

    owner, _, leaf = name.rpartition(".")
    module = owner.rpartition(".")[2]
    if not shape:
        return None, False
    if module in tpl._EMBEDDING_NAMES:
        return 0, True
    if module in tpl._HEAD_NAMES or module in tpl._COLUMN_NAMES:
        return 0, False
    if module in tpl._FUSED_NAMES:
        return (1 if len(shape) >= 2 else 0), False  # GPT-2's Conv1D stores [in, 3 x hidden]
    if module in tpl._ROW_NAMES and len(shape) >= 2 and leaf == "weight":
        return 1, False
    return None, False


_BLOCK = re.compile(r"^(.*?\.\d+)\.")


def spec_from_safetensors(path: Path) -> ModelSpec:
    """Headers only: a `.safetensors` file, a sharded index, or a folder holding either (each header and index
    checked by accel.planning.inputs)."""
    if inputs.kind_of(path) == "dir":
        index = path / "model.safetensors.index.json"
        files = [index] if inputs.kind_of(index) == "file" else sorted(path.glob("*.safetensors"))
        if not files:
            raise EstimateError(f"{path}: no model.safetensors.index.json or *.safetensors in the folder")
    else:
        files = [path]
    if files[0].name.endswith(".index.json"):
        files = inputs.safetensors_index(files[0])
    params = []
    for file in files:
        for name, (dtype, shape) in inputs.safetensors_header(file).items():
            match = _BLOCK.match(name)
            param = Param(name, shape, max(1, inputs.SAFETENSORS_BITS[dtype] // 8),
                          match.group(1) if match else None, *_tp_split_by_name(name, shape))
            param.expert = _is_expert_name(name)
            params.append(param)
    if all(p.tp_dim is None for p in params):
        _tp_split_blocks(params)
    return ModelSpec(str(path), params)


def _quiet_transformers():
    """Warnings logged while accel reads and builds a transformers model held back: transformers' about the config
    (token ids outside the vocabulary, ...) and those of the libraries its model code imports (torchao's notes on
    its kernels, torch's on registered types). An `accel` command prints its result or one error line."""
    import contextlib
    import logging

    from transformers.utils import logging as hf_logging

    @contextlib.contextmanager
    def quiet():
        level, disabled = hf_logging.get_verbosity(), logging.root.manager.disable
        hf_logging.set_verbosity_error()
        logging.disable(logging.WARNING)
        try:
            yield
        finally:
            logging.disable(disabled)
            hf_logging.set_verbosity(level)
    return quiet()


def build_from_config(config, source: str = "the config") -> torch.nn.Module:
    """A transformers causal LM (or base model) from `config`, on the meta device; what transformers refuses
    in it is one EstimateError naming `source`."""
    from transformers import AutoModel, AutoModelForCausalLM

    with _quiet_transformers(), torch.device("meta"):
        try:
            try:
                return AutoModelForCausalLM.from_config(config)
            except ValueError:
                return AutoModel.from_config(config)
        except Exception as exc:  # noqa: BLE001 - any value transformers cannot build a model from
            raise EstimateError(f"{source}: transformers cannot build a model from it ({_summary(exc)}); "
                                "allowed: a config transformers builds (sizes, types and options as its model "
                                "expects)") from None


def _summary(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message[:200]}" if message else type(exc).__name__


def is_checkpoint(path: Path) -> bool:
    """MODEL names a safetensors checkpoint (file, index, or a folder without config.json): headers only."""
    return path.suffix == ".safetensors" or path.name.endswith(".index.json") or (
        inputs.kind_of(path) == "dir" and inputs.kind_of(path / "config.json") != "file")


def load_spec(model: str) -> ModelSpec:
    """MODEL as the CLI takes it: a safetensors file/index/folder, a transformers config (file, folder or model
    type), or `module:callable` returning an nn.Module."""
    path = Path(inputs.path_text("MODEL", model))
    if is_checkpoint(path):
        if inputs.kind_of(path) is None:
            raise EstimateError(f"{model}: no such file or folder")
        return spec_from_safetensors(path)
    if ":" in model and inputs.kind_of(path) is None:
        return spec_from_module(_call(model), model)
    return spec_from_module(build_from_config(*_config(model)), model)


def _call(target: str) -> torch.nn.Module:
    import importlib

    import os
    import sys

    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path:  # the `accel` script does not put the current folder on the path
        sys.path.insert(0, os.getcwd())
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:  # a missing or malformed name
        raise EstimateError(f"{target}: cannot load the callable ({_summary(exc)}); allowed: module:callable "
                            "returning an nn.Module") from None
    if not callable(fn):
        raise EstimateError(f"{target}: a {type(fn).__name__}, not a callable; allowed: module:callable returning "
                            "an nn.Module")
    with torch.device("meta"):
        try:
            model = fn()
        except Exception as exc:  # noqa: BLE001 - the user's function failed: its error in one line
            raise EstimateError(f"{target}: calling it failed ({_summary(exc)}); allowed: module:callable "
                                "returning an nn.Module, called with no arguments") from None
    if not isinstance(model, torch.nn.Module):
        raise EstimateError(f"{target}: returned {type(model).__name__}, not a torch.nn.Module")
    return model


def _config(model: str) -> tuple:
    """(a transformers config for MODEL, where it came from): a config.json (checked by
    accel.planning.inputs.model_config), a folder holding one, or a model type."""
    try:
        from transformers import CONFIG_MAPPING, AutoConfig
    except ImportError:
        raise EstimateError("reading a transformers config needs transformers; install it with "
                            "pip install 'accel-train[transformers]'") from None
    path = Path(model)
    kind = inputs.kind_of(path)
    if kind is not None:
        file = path / "config.json" if kind == "dir" else path
        data = inputs.model_config(file, CONFIG_MAPPING)
        try:
            with _quiet_transformers():
                return AutoConfig.for_model(data.pop("model_type"), **data), str(file)
        except Exception as exc:  # noqa: BLE001 - any value transformers' config class refuses
            raise EstimateError(f"{file}: not a transformers config ({_summary(exc)}); allowed: "
                                f"{inputs.CONFIG_FORMAT}") from None
    if "/" in model or model.endswith(".json"):
        raise EstimateError(f"{model}: no such file or folder")
    if model not in CONFIG_MAPPING:
        raise EstimateError(f"{inputs.show(model)}: unknown transformers model type; give a config.json, a "
                            "folder, a safetensors checkpoint or module:callable")
    with _quiet_transformers():
        return AutoConfig.for_model(model), model


# -- the estimates ----------------------------------------------------------------------------------------------
def weights(spec: ModelSpec, dtype: str) -> dict:
    """Total bytes in `dtype`, the largest wrap unit (a repeated block, or the root's own parameters) and the
    largest single parameter."""
    size = DTYPE_BYTES[dtype]
    units: dict[str, int] = {}
    for p in spec.params:
        units[p.block or "<root>"] = units.get(p.block or "<root>", 0) + p.numel
    unit = max(units, key=lambda block: units[block])
    biggest = max(spec.params, key=lambda p: p.numel)
    return {"dtype": dtype, "total_bytes": spec.numel * size,
            "largest_layer": {"name": unit, "params": units[unit], "bytes": units[unit] * size},
            "largest_param": {"name": biggest.name, "params": biggest.numel, "bytes": biggest.numel * size}}


def _shard_numel(shape: tuple, n: int) -> int:
    """Rank 0's dim-0 shard under FSDP2 (torch.chunk: ceil(dim0 / n) rows)."""
    if not shape:
        return 1
    return min(shape[0], math.ceil(shape[0] / n)) * math.prod(shape[1:])


def _zero1_max(numels: list[int], n: int) -> tuple[int, int]:
    """The largest rank's share (elements, tensors) under ZeroRedundancyOptimizer's greedy partition (largest
    first, to the least loaded rank, the lowest of those tied); a heap of the loaded ranks, so thousands of
    ranks cost nothing."""
    loads, counts = [0] * min(n, len(numels)), [0] * min(n, len(numels))  # ranks past the tensors hold none
    heap = [(0, rank) for rank in range(len(loads))]
    for numel in sorted(numels, reverse=True):
        load, rank = heapq.heappop(heap)
        loads[rank], counts[rank] = load + numel, counts[rank] + 1
        heapq.heappush(heap, (loads[rank], rank))
    if not loads:
        return 0, 0
    rank = loads.index(max(loads))
    return loads[rank], counts[rank]


def pipeline_stages(spec: ModelSpec, pp: int) -> list[list[Param]]:
    """The parameters of each of `pp` stages, cut as accel's automatic split does (pipeline_split.py): between
    the blocks of the largest repeated stack, balancing the parameter count; the parameters before its first
    block count with that block and sit on the first stage, those after it with the last block."""
    if pp == 1:
        return [list(spec.params)]
    from accel.backends.pipeline_split import _partition

    stacks: dict[str, int] = {}
    for p in spec.params:
        if p.block:
            stacks[p.block.rpartition(".")[0]] = stacks.get(p.block.rpartition(".")[0], 0) + p.numel
    stack = max(stacks, key=lambda name: stacks[name]) if stacks else None
    blocks = list(dict.fromkeys(p.block for p in spec.params if p.block and p.block.rpartition(".")[0] == stack))
    if len(blocks) < pp:
        raise EstimateError(f"--pp_size {pp}: the model has only {len(blocks)} repeated blocks to split")
    index = {b: i for i, b in enumerate(blocks)}
    unit, units = 0, []
    for p in spec.params:  # in definition order: a parameter goes with the last block seen (or the first)
        unit = index.get(p.block or "", unit)  # no block: "" is none of them
        units.append(unit)
    costs = [0] * len(blocks)
    for p, u in zip(spec.params, units, strict=True):
        costs[u] += p.numel
    starts = _partition(costs, pp)
    stage_of = [sum(1 for s in starts[1:] if s <= u) for u in range(len(blocks))]
    stages: list[list[Param]] = [[] for _ in range(pp)]
    for p, u in zip(spec.params, units, strict=True):
        stages[stage_of[u]].append(p)
    return stages


def _tp_local(p: Param, tp: int) -> tuple[tuple, tuple]:
    """(parameter shape, gradient shape) one TP rank holds."""
    if tp == 1 or p.tp_dim is None:
        return p.shape, p.shape
    shape = list(p.shape)
    shape[p.tp_dim] = math.ceil(shape[p.tp_dim] / tp)
    return tuple(shape), p.shape if p.tp_whole_grad else tuple(shape)


def rank_params(spec: ModelSpec, tp: int, pp: int) -> list[tuple]:
    """The shapes one rank holds under TP `tp` and PP `pp` (the largest stage), before data parallelism."""
    stages = pipeline_stages(spec, pp)
    chosen = max(stages, key=lambda s: sum(p.numel for p in s))
    return [_tp_local(p, tp)[0] for p in chosen]


def _stage_rows(params: list[Param], tp: int, dp: int, ep: int = 1) -> dict:
    """{layout: (parameter, gradient, moment, step elements)} of one rank of a stage holding `params`. With expert
    parallelism (ep > 1) the expert parameters are held 1/ep per rank; under ZeRO 2/3 (and any layout with TP, which
    is FSDP2) the stacked ones ([E, ...], 3-D) are sharded again over their dp / ep replicas (FSDP2 on dim 0 of
    the E/ep rows) and TP splits them within (1/tp); a ModuleList's experts (each its own parameters) likewise, each
    expert an FSDP2 unit over the replicas (1/ep of them held, each sharded on dim 0). `dp` here counts the sequence
    ranks too: they are replicas of their dp rank's experts. ZeRO-1 shards the optimizer state over the expert's
    replicas (dp / ep ranks), the dense parameters' too (accel/backends/zero.py)."""
    if ep > 1 and any(p.expert for p in params):
        dense = [p for p in params if not p.expert]
        rows = _stage_rows(dense, tp, dp)
        experts = [p for p in params if p.expert]
        replicas = dp // ep
        whole = sum(math.ceil(p.numel / ep) for p in experts)
        resharded = sum(math.ceil(_shard_numel((p.shape[0] // ep, *p.shape[1:]), replicas) / tp)
                        if len(p.shape) == 3 else math.ceil(_shard_numel(p.shape, replicas) / ep) for p in experts)
        held = {name: resharded if tp > 1 or name.startswith(("zero2", "zero3")) else whole for name in rows}
        out = {name: (a + held[name], b + held[name], c + 2 * held[name], d + len(experts))
               for name, (a, b, c, d) in rows.items()}
        if tp == 1 and replicas > 1:  # ZeroRedundancyOptimizer over edp: the dense and this rank's experts
            a, b, _, _ = out["zero1"]
            numels = [p.numel for p in dense] + [math.ceil(p.numel / ep) for p in experts]
            moments, steps = _zero1_max(numels, replicas)
            out["zero1"] = (a, b, 2 * moments, steps)
        return out
    local = [_tp_local(p, tp) for p in params]
    shapes = [s for s, _ in local]
    full = sum(math.prod(s) for s in shapes)
    full_grads = sum(math.prod(g) for _, g in local)
    steps = len(shapes)  # one 0-d step per parameter: FSDP2 keeps one per shard on every rank
    if dp == 1:  # no data parallelism: every stage keeps the whole TP slice (no FSDP2, no ZeroRedundancyOptimizer)
        row = (full, full_grads, 2 * full, steps)
        return dict.fromkeys(LAYOUTS, row)
    sharded = sum(_shard_numel(s, dp) for s in shapes)
    fsdp = (sharded, sharded, 2 * sharded, steps)  # FSDP2 reduce-scatters gradients into the parameters' shards
    zero1, zero1_steps = _zero1_max([math.prod(s) for s in shapes], dp)
    return {"ddp": fsdp if tp > 1 else (full, full_grads, 2 * full, steps),  # DDP takes no DTensors: FSDP2
            "zero1": fsdp if tp > 1 else (full, full_grads, 2 * zero1, zero1_steps),  # refused with TP
            "zero2": fsdp, "zero3": fsdp, "zero3_offload": fsdp}


def check_sequence_degrees(sp: int, cp: int, pp: int = 1) -> int:
    """The sequence degree (sp x cp) of a layout accel runs (accel.backends.check_available's rules): one of
    sequence and context parallelism (with pipeline stages too); else one EstimateError naming the flags."""
    if sp < 1 or cp < 1:
        raise EstimateError(f"--sp_size {sp} --cp_size {cp}: bad value; allowed: integers >= 1")
    if sp > 1 and cp > 1:
        raise EstimateError(f"--sp_size {sp} and --cp_size {cp}: sequence and context parallelism both split the "
                            "sequence; allowed: one of them above 1")
    return sp * cp


def training(spec: ModelSpec, num_processes: int = 1, tp: int = 1, pp: int = 1, sp: int = 1, cp: int = 1,
             ep: int = 1) -> dict:
    """Bytes per rank (the largest) of parameters, gradients, AdamW state and master weights for each layout,
    on the device and on the host, with `num_processes` ranks of which tp * pp * sp * cp share one batch.
    `rank_params_bytes`: the float32 bytes of the largest stage's TP slice, before data parallelism shards it.
    The sequence ranks (sp or cp) hold whole (TP-sliced) parameters and reduce gradients with the data-parallel
    ranks: ZeRO and FSDP2 shard over dp x sp/cp."""
    seq = check_sequence_degrees(sp, cp, pp)
    if num_processes < 1 or tp < 1 or pp < 1 or num_processes % (tp * pp * seq):
        extra = "" if seq == 1 else f" x --sp_size {sp}" if sp > 1 else f" x --cp_size {cp}"
        raise EstimateError(f"--num_processes {num_processes} is not a multiple of --tp_size {tp} x --pp_size "
                            f"{pp}{extra}")
    dp = num_processes // (tp * pp * seq)
    if ep < 1 or dp % ep:
        raise EstimateError(f"--ep_size {ep}: does not divide the data-parallel degree {dp} (the ranks experts are "
                            f"divided among); allowed: a divisor of {dp}")
    stages = [_stage_rows(params, tp, dp * seq, ep) for params in pipeline_stages(spec, pp)]
    layouts = {}
    for name in LAYOUTS:
        params, grads, moments, steps = max((rows[name] for rows in stages), key=sum)  # the fullest rank
        entry = {"params_bytes": params * STATE_BYTES, "grads_bytes": grads * STATE_BYTES,
                 "optimizer_bytes": (moments + steps) * STATE_BYTES, "master_bytes": 0}
        total = sum(entry.values())
        offload = name.endswith("offload")
        entry.update(device_bytes=0 if offload else total, host_bytes=total if offload else 0)
        layouts[name] = entry
    rank_numel = sum(math.prod(s) for s in rank_params(spec, tp, pp))
    result = {"num_processes": num_processes, "tp_size": tp, "pp_size": pp, "sp_size": sp, "cp_size": cp,
              "dp_size": dp, "rank_params_bytes": rank_numel * STATE_BYTES, "layouts": layouts}
    if ep > 1:
        result["ep_size"] = ep
    return result


def estimate(spec: ModelSpec, dtypes=("float32", "bfloat16"), num_processes: int = 1, tp: int = 1,
             pp: int = 1, sp: int = 1, cp: int = 1, ep: int = 1) -> dict:
    """Everything `accel estimate-memory --json` prints."""
    for dtype in dtypes:
        if dtype not in DTYPE_BYTES:
            raise EstimateError(f"--dtypes: bad value {dtype!r}; allowed: {', '.join(DTYPE_BYTES)}")
    if not spec.params:
        raise EstimateError(f"{spec.source}: the model has no parameters")
    return {"model": spec.source, "params": spec.numel, "weights": [weights(spec, d) for d in dtypes],
            "training": training(spec, num_processes, tp, pp, sp, cp, ep), "assumptions": ASSUMPTIONS}


# -- activations: forward + backward on fake tensors -----------------------------------------------------------
CHECKPOINTING = ("no", "full", "selective")
MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
ACTIVATION_METHOD = ("forward and backward of the whole model on fake tensors (FakeTensorMode, no memory, no "
                     "compute) under torch's MemTracker; activation bytes = the peak over the step of the "
                     "tracked bytes that are not parameters, buffers or gradients (saved activations, "
                     "temporaries, logits and loss); float32 parameters, autocast for bf16/fp16")


def load_module(model: str) -> torch.nn.Module:
    """MODEL as an nn.Module on the meta device: a transformers config or `module:callable` (a safetensors
    checkpoint has no code to run)."""
    path = Path(inputs.path_text("MODEL", model))
    if is_checkpoint(path):
        raise EstimateError(f"{model}: activations need the model's code; give its config.json or module:callable")
    if ":" in model and inputs.kind_of(path) is None:
        return _call(model)
    return build_from_config(*_config(model))


def _peak_tracker():
    """torch's MemTracker that also records the peak of the non-model-state bytes (its own peak is of the total,
    which late in backward is dominated by the gradients)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    states = (_MemRefType.PARAM, _MemRefType.BUFFER, _MemRefType.GRAD, _MemRefType.OPT)

    class ActivationTracker(MemTracker):
        activation_peak = 0

        def _update_peak_stats(self, peak_state) -> None:  # replaces the per-module bookkeeping: not needed here
            for snap in self._curr_mem_snap.values():
                other = snap["Total"] - sum(snap.get(s, 0) for s in states)
                self.activation_peak = max(self.activation_peak, other)

    return ActivationTracker()


def _inputs(model: torch.nn.Module, batch_size: int, seq_len: int) -> torch.Tensor:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        embedding = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
        if embedding is None:
            raise EstimateError("--batch_size: activations are measured on token ids; the model has no "
                                "nn.Embedding and no config.vocab_size")
        vocab = embedding.num_embeddings
    return torch.randint(0, vocab, (batch_size, seq_len))


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A transformers model's own loss (labels = the ids); any other module's output summed."""
    if getattr(model, "config", None) is not None and "labels" in model.forward.__code__.co_varnames:
        return model(input_ids=ids, labels=ids).loss
    out = model(ids)
    out = getattr(out, "logits", out)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return out.float().sum()


# What torch's ModTracker (under MemTracker) warns when a module not in the model's tree is entered inside another of
# the same class name: it names such modules by their class alone, and transformers' hub-kernel function wrappers
# (a `Func` module per wrapped function, e.g. Llama's apply_rotary_pos_emb) all share one. Only its per-module
# bookkeeping is affected; the step's peak that accel reads is counted over all tensors. Its text asks the user to
# file a PyTorch bug, so it is silenced for the measurement (that one message, nothing else).
MOD_TRACKER_WARNING = "The module hierarchy tracking maybe be messed up"


@contextlib.contextmanager
def _quiet_mod_tracker():
    """Ignore ModTracker's hierarchy warning, and undo the global `warnings.formatwarning` it replaces to print it."""
    formatwarning = warnings.formatwarning
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=re.escape(MOD_TRACKER_WARNING), category=UserWarning)
            yield
    finally:
        warnings.formatwarning = formatwarning


def measure_step(model: torch.nn.Module, ids: torch.Tensor, mixed_precision: str = "no") -> int:
    """Activation bytes of one forward + backward of `model` on `ids` (real or fake), as MemTracker sees it."""
    tracker = _peak_tracker()
    tracker.track_external(model)
    dtype = MIXED_PRECISION[mixed_precision]
    with _quiet_mod_tracker(), tracker:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = _loss(model, ids)
        loss.backward()
    return tracker.activation_peak


def activation_bytes(model, batch_size: int, seq_len: int, mixed_precision: str = "no",
                     checkpointing: str = "no", fake: bool = True) -> int:
    """Activation memory of one training step for a micro-batch of `batch_size` x `seq_len` tokens: `model` is
    an nn.Module (any device; it is copied, not changed) or MODEL as the CLI takes it. `checkpointing` is accel's
    `activation_checkpointing` (no/full/selective), applied with accel's own function to the fake copy.
    `fake=False` runs the same step on a real copy of a real `model` (what benchmarks/ compares against)."""
    import copy

    from types import SimpleNamespace

    from torch._subclasses.fake_tensor import FakeTensorMode

    from accel.transforms.activation_checkpointing import apply_activation_checkpointing

    if mixed_precision not in MIXED_PRECISION:
        raise EstimateError(f"--mixed_precision: bad value {mixed_precision!r}; allowed: {', '.join(MIXED_PRECISION)}")
    if checkpointing not in CHECKPOINTING:
        raise EstimateError(f"checkpointing: bad value {checkpointing!r}; allowed: {', '.join(CHECKPOINTING)}")
    if batch_size < 1 or seq_len < 1:
        raise EstimateError(f"--batch_size {batch_size} --seq_len {seq_len}: both must be >= 1")
    module = load_module(model) if isinstance(model, str) else model
    module = _meta_copy(module) if fake else copy.deepcopy(module)
    apply_activation_checkpointing(module, SimpleNamespace(activation_checkpointing=checkpointing,
                                                           zero_wrap_classes=None, zero_min_params=None))
    try:
        if not fake:
            module.train()
            return measure_step(module, _inputs(module, batch_size, seq_len), mixed_precision)
        with FakeTensorMode(allow_non_fake_inputs=True):
            module.to_empty(device="cpu")
            module.train()
            return measure_step(module, _inputs(module, batch_size, seq_len), mixed_precision)
    except EstimateError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own forward/backward (sizes it cannot take, its bugs)
        raise EstimateError(f"--batch_size {batch_size} --seq_len {seq_len}: one training step of the model failed "
                            f"on fake tensors ({_summary(exc)}); allowed: sizes the model's forward takes") from None


def _meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy on the meta device, so the caller's module keeps its weights and forward."""
    import copy

    if all(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return copy.deepcopy(module)
    return copy.deepcopy(module).to("meta")


SEQUENCE_METHOD = ("; with sequence/context parallelism, per rank: the whole sequence's bytes / the degree (each "
                   "rank holds 1/N of every sequence; Ulysses' attention 1/N of the heads of the whole sequence), "
                   "context parallelism plus each layer's all-gathered K and V (the other ranks' (N-1)/N, kept for "
                   "backward: every layer without checkpointing, one with full checkpointing)")


def sequence_length(seq_len: int, sp: int = 1, cp: int = 1) -> int:
    """The sequence length the sequence ranks share: padded up to a multiple of sp (Ulysses' contiguous slices) or
    of 2 x cp (context parallelism's chunks), as accel's batch cut pads it."""
    multiple = 2 * cp if cp > 1 else sp
    return -(-seq_len // multiple) * multiple


def kv_shape(module) -> tuple[int, int]:
    """(layers, key/value width) from a transformers model's config: its hidden layers, and key/value heads x head
    dimension; (0, 0) for a module without one (its K/V are then not counted)."""
    config = getattr(module, "config", None)
    config = getattr(config, "get_text_config", lambda: config)() if config is not None else None

    def first(*keys):
        return next((getattr(config, k) for k in keys if isinstance(getattr(config, k, None), int)), None)

    layers, hidden = first(*inputs.LAYER_KEYS[:4]), first("hidden_size", "n_embd", "d_model")
    heads = first("num_attention_heads", "n_head")
    if not (layers and hidden and heads):
        return 0, 0
    head_dim = first("head_dim") or hidden // heads
    return layers, (first("num_key_value_heads") or heads) * head_dim


def activations(model, batch_size: int, seq_len: int, mixed_precision: str = "no", sp: int = 1,
                cp: int = 1) -> dict:
    """The `activations` entry of `accel estimate-memory --json`: per process. With sequence (sp) or context (cp)
    parallelism the step is measured on the whole (padded) sequence and divided by the degree, and context
    parallelism adds the K and V each layer all-gathers (`one_process_*`: the whole sequence on one process)."""
    seq = check_sequence_degrees(sp, cp)
    model = load_module(model) if isinstance(model, str) else model
    length = sequence_length(seq_len, sp, cp)
    whole = {ac: activation_bytes(model, batch_size, length, mixed_precision, ac) for ac in ("no", "full")}
    out = {"batch_size": batch_size, "seq_len": seq_len, "mixed_precision": mixed_precision,
           "no_checkpointing_bytes": whole["no"], "full_checkpointing_bytes": whole["full"],
           "method": ACTIVATION_METHOD}
    if seq == 1:
        return out
    layers, kv_width = kv_shape(model)
    gathered = 2 * batch_size * length * kv_width * (2 if mixed_precision in ("bf16", "fp16") else 4) * (
        seq - 1) // seq if cp > 1 else 0
    out.update(no_checkpointing_bytes=whole["no"] // seq + layers * gathered,
               full_checkpointing_bytes=whole["full"] // seq + min(layers, 1) * gathered,
               sp_size=sp, cp_size=cp, one_process_no_checkpointing_bytes=whole["no"],
               one_process_full_checkpointing_bytes=whole["full"], method=ACTIVATION_METHOD + SEQUENCE_METHOD)
    return out
