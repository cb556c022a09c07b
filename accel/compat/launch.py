"""Accelerate's `accelerate.utils.launch` helpers: the command and environment its launchers build (torchrun, one
process, mpirun), SageMaker's argument conversion, and launching a function in several forked processes."""

from __future__ import annotations

import argparse
import ast
import os
import socket
import subprocess
import sys
import warnings
from shutil import which
from typing import Callable

from accel.runtime.state import DistributedType

PRECISIONS = ("no", "fp8", "fp16", "bf16")
# torch.compile backends by Accelerate's DynamoBackend names (what ACCELERATE_DYNAMO_BACKEND holds)
DYNAMO_BACKENDS = ("NO", "EAGER", "AOT_EAGER", "INDUCTOR", "AOT_TS_NVFUSER", "NVPRIMS_NVFUSER", "CUDAGRAPHS", "OFI",
                   "FX2TRT", "ONNXRT", "TENSORRT", "AOT_TORCHXLA_TRACE_ONCE", "TORCHXLA_TRACE_ONCE", "IPEX", "TVM",
                   "HPU_BACKEND")
# launch flag -> FSDP_* variable, written when --use_fsdp (None values are left out)
_FSDP_ENV = {"fsdp_reshard_after_forward": "RESHARD_AFTER_FORWARD", "fsdp_offload_params": "OFFLOAD_PARAMS",
             "fsdp_min_num_params": "MIN_NUM_PARAMS", "fsdp_auto_wrap_policy": "AUTO_WRAP_POLICY",
             "fsdp_transformer_layer_cls_to_wrap": "TRANSFORMER_CLS_TO_WRAP",
             "fsdp_backward_prefetch": "BACKWARD_PREFETCH", "fsdp_state_dict_type": "STATE_DICT_TYPE",
             "fsdp_forward_prefetch": "FORWARD_PREFETCH", "fsdp_use_orig_params": "USE_ORIG_PARAMS",
             "fsdp_cpu_ram_efficient_loading": "CPU_RAM_EFFICIENT_LOADING",
             "fsdp_sync_module_states": "SYNC_MODULE_STATES",
             "fsdp_activation_checkpointing": "ACTIVATION_CHECKPOINTING",
             "fsdp_activation_checkpointing_offload": "ACTIVATION_CHECKPOINTING_OFFLOAD",
             "fsdp_ignored_modules": "IGNORED_MODULES"}
_LOWERED = {"fsdp_reshard_after_forward", "fsdp_offload_params", "fsdp_forward_prefetch", "fsdp_use_orig_params",
            "fsdp_cpu_ram_efficient_loading", "fsdp_sync_module_states", "fsdp_activation_checkpointing",
            "fsdp_activation_checkpointing_offload"}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _common_env(args: argparse.Namespace) -> dict[str, str]:
    """os.environ plus what every Accelerate launcher exports: debug mode, visible GPUs, mixed precision (and the fp8
    recipe flags), the dynamo settings, the thread count and CPU affinity."""
    env = os.environ.copy()
    if getattr(args, "debug", False):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    gpu_ids = getattr(args, "gpu_ids", "all")
    if gpu_ids not in ("all", None):
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids
    precision = str(args.mixed_precision).lower()
    if precision not in PRECISIONS:
        raise ValueError(f"Unknown mixed_precision mode: {precision}. Choose between {list(PRECISIONS)}.")
    env["ACCELERATE_MIXED_PRECISION"] = precision
    if precision == "fp8":
        from accel.core.probes import is_fp8_available

        if not is_fp8_available():
            raise RuntimeError("FP8 is not available on this machine: mixed_precision fp8 needs torchao installed")
        env.update(_fp8_env(args))
    backend = str(args.dynamo_backend).upper()
    if backend not in DYNAMO_BACKENDS:
        raise ValueError(f"Unknown dynamo backend: {backend}. Choose between {list(DYNAMO_BACKENDS)}.")
    env["ACCELERATE_DYNAMO_BACKEND"] = backend
    env["ACCELERATE_DYNAMO_MODE"] = str(args.dynamo_mode)
    for flag in ("use_fullgraph", "use_dynamic", "use_regional_compilation"):
        env[f"ACCELERATE_DYNAMO_{flag.upper()}"] = str(getattr(args, f"dynamo_{flag}", False))
    env["OMP_NUM_THREADS"] = str(args.num_cpu_threads_per_process)
    if getattr(args, "enable_cpu_affinity", False):
        env["ACCELERATE_CPU_AFFINITY"] = "1"
    return env


def _fp8_env(args: argparse.Namespace) -> dict[str, str]:
    """ACCELERATE_FP8_* from the `fp8_*` launch flags (the linear-precision override as three variables)."""
    env = {}
    for name, value in vars(args).items():
        if not name.startswith("fp8_") or value is None:
            continue
        if name == "fp8_override_linear_precision":
            for part, flag in zip(("FPROP", "DGRAD", "WGRAD"), value, strict=False):
                env[f"ACCELERATE_FP8_OVERRIDE_{part}"] = str(flag)
        else:
            env[f"ACCELERATE_{name.upper()}"] = str(value)
    return env


def _mpirun_args() -> tuple[str, str, str, str, str]:
    """(program, hostfile flag, process-count flag, per-node flag, bind flag) of the installed MPI (Open MPI, or
    Intel MPI / MVAPICH, which share their flag names)."""
    programs = [name for name in ("mpirun", "mpiexec") if which(name)]
    if not programs:
        raise OSError("mpirun or mpiexec were not found. Ensure that Intel MPI, Open MPI, or MVAPICH are installed.")
    if b"Open MPI" in subprocess.check_output([programs[0], "--version"]):
        return programs[0], "--hostfile", "-n", "--npernode", "--bind-to"
    return programs[0], "-f", "-n", "-ppn", ""


def prepare_simple_launcher_cmd_env(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Accelerate's one-process (or mpirun) launch: the command line and the environment for the script."""
    if args.no_python and args.module:
        raise ValueError("--module and --no_python cannot be used together")
    num_processes, num_machines = getattr(args, "num_processes", None), args.num_machines
    cmd = []
    if getattr(args, "mpirun_hostfile", None) is not None:
        program, hostfile, count, per_node, bind = _mpirun_args()
        cmd += [program, hostfile, args.mpirun_hostfile, per_node,
                str(num_processes // num_machines) if num_processes and num_machines else "1"]
        cmd += [count, str(num_processes)] if num_processes else []
        cmd += [bind, getattr(args, "bind-to", "socket")] if bind else []
    if not args.no_python:
        cmd += [sys.executable, *(["-m"] if args.module else [])]
    cmd += [args.training_script, *args.training_script_args]
    env = _common_env(args)
    use_cpu = bool(args.cpu or getattr(args, "use_cpu", False))
    env["ACCELERATE_USE_CPU"] = str(use_cpu)
    if num_machines > 1 and (args.main_process_ip is None or args.main_process_port is None):
        raise ValueError("num_machines > 1 needs main_process_ip and main_process_port")
    if (num_processes is not None and num_processes > 1) or num_machines > 1:
        env["MASTER_ADDR"] = args.main_process_ip if args.main_process_ip is not None else "127.0.0.1"
        env["MASTER_PORT"] = str(args.main_process_port) if args.main_process_port is not None else "29500"
    if use_cpu:
        env["KMP_AFFINITY"], env["KMP_BLOCKTIME"] = "granularity=fine,compact,1,0", "1"
    return cmd, env


def prepare_multi_gpu_env(args: argparse.Namespace) -> dict[str, str]:
    """Accelerate's torchrun launch: sets torchrun's arguments on `args` (nproc_per_node, master_port or
    rdzv_endpoint, ...; port 0 picks a free one) and returns the environment for the workers."""
    from accel.compat.other import is_port_in_use

    if args.main_process_port == 0:
        args.main_process_port = _free_port()
    elif args.main_process_port is None:
        args.main_process_port = 29500
    port, machines = args.main_process_port, args.num_machines
    args.nproc_per_node = str(args.num_processes // machines if machines > 1 else args.num_processes)
    if machines > 1:
        args.nnodes, args.node_rank = str(machines), int(args.machine_rank)
        if getattr(args, "same_network", False):
            args.master_addr, args.master_port = str(args.main_process_ip), str(port)
        else:
            args.rdzv_endpoint = f"{args.main_process_ip}:{port}"
    else:
        args.master_port = str(port)
    if (machines <= 1 or int(args.machine_rank) == 0) and is_port_in_use(port):
        if machines > 1:
            raise ConnectionError(f"main_process_port {port} is in use by another process; allowed: a free port "
                                  "(--main_process_port), or 0 on one machine to pick one")
        args.standalone = True
        warnings.warn(f"Port {port} is already in use; launching in standalone mode (torchrun picks a free port). "
                      "Set --main_process_port to a free port, or 0, to choose.", stacklevel=2)
    if args.module and args.no_python:
        raise ValueError("--module and --no_python cannot be used together")
    env = _common_env(args)
    if args.use_fsdp:
        if args.fsdp_cpu_ram_efficient_loading and not args.fsdp_sync_module_states:
            raise ValueError("When using `--fsdp_cpu_ram_efficient_loading` set `--fsdp_sync_module_states` to `True`")
        env["ACCELERATE_USE_FSDP"] = "true"
        env["FSDP_VERSION"] = str(getattr(args, "fsdp_version", None) or "1")
        env["FSDP_SHARDING_STRATEGY"] = str(args.fsdp_sharding_strategy)
        for flag, name in _FSDP_ENV.items():
            value = getattr(args, flag, None)
            if value is not None:
                env["FSDP_" + name] = str(value).lower() if flag in _LOWERED else str(value)
    if getattr(args, "use_megatron_lm", False):
        raise NotImplementedError("prepare_multi_gpu_env: Megatron-LM is not available in accel; allowed: "
                                  "use_megatron_lm False")
    if getattr(args, "use_parallelism_config", False):
        env = prepare_extend_env_parallelism_config(args, env)
    return env


def prepare_extend_env_parallelism_config(args: argparse.Namespace, current_env: dict) -> dict[str, str]:
    """`current_env` with the PARALLELISM_CONFIG_* variables of the `parallelism_config_*` launch flags (what
    `ParallelismConfig()` reads when built without sizes)."""
    prefix = "PARALLELISM_CONFIG_"
    current_env["ACCELERATE_USE_PARALLELISM_CONFIG"] = "true"
    for name in ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "cp_backend", "sp_size", "sp_backend"):
        current_env[prefix + name.upper()] = str(getattr(args, "parallelism_config_" + name))
    if args.parallelism_config_cp_size > 1:
        current_env[prefix + "CP_COMM_STRATEGY"] = str(args.parallelism_config_cp_comm_strategy)
    if args.parallelism_config_sp_size > 1:
        for name in ("sp_seq_length", "sp_seq_length_is_variable", "sp_attn_implementation"):
            current_env[prefix + name.upper()] = str(getattr(args, "parallelism_config_" + name))
    return current_env


def _convert_nargs_to_dict(nargs: list[str]) -> dict:
    """A script's `--key value` arguments as a dict, numbers as int/float and True/False as bools (what SageMaker's
    hyperparameters take); a flag without a value (store_true) is a ValueError, as SageMaker cannot pass it."""
    def infer(text: str):
        try:
            number = float(text)
        except ValueError:
            return text
        return int(number) if number // 1 == number else number

    parser = argparse.ArgumentParser()
    _, unknown = parser.parse_known_args(nargs)
    for index, argument in enumerate(unknown):
        if argument.startswith("-"):
            if index + 1 >= len(unknown) or unknown[index + 1].startswith("-"):
                raise ValueError(f"{argument}: SageMaker doesn't support argparse actions for `store_true` or "
                                 "`store_false`; allowed: an explicit value (--flag True)")
            parser.add_argument(argument, type=infer)
    return {key: ast.literal_eval(value) if value in ("True", "False") else value
            for key, value in vars(parser.parse_args(nargs)).items()}


def env_var_path_add(env_var_name: str, path_to_add) -> str:
    """$env_var_name's paths with `path_to_add` appended (the caller sets it)."""
    paths = [p for p in os.environ.get(env_var_name, "").split(":") if p]
    return ":".join([*paths, str(path_to_add)])


class PrepareForLaunch:
    """`launcher` made ready to run as process `index` of a forked job (what `torch.multiprocessing.start_processes`
    calls): it sets LOCAL_RANK and RANK (`NPROC * NODE_RANK + index`) for a multi-process distributed type, or, with
    `debug`, joins a gloo group through the file store $ACCELERATE_DEBUG_RDV_FILE; FORK_LAUNCHED=1 in every case."""

    def __init__(self, launcher: Callable, distributed_type="NO", debug: bool = False):
        self.launcher = launcher
        self.distributed_type = DistributedType(distributed_type)
        self.debug = debug

    def __call__(self, index: int, *args):
        if self.debug:
            import torch.distributed as dist

            world_size = int(os.environ["WORLD_SIZE"])
            store = dist.FileStore(os.environ["ACCELERATE_DEBUG_RDV_FILE"], world_size)
            dist.init_process_group("gloo", rank=index, store=store, world_size=world_size)
        elif self.distributed_type in (DistributedType.MULTI_GPU, DistributedType.MULTI_MLU,
                                       DistributedType.MULTI_MUSA, DistributedType.MULTI_NPU,
                                       DistributedType.MULTI_XPU, DistributedType.MULTI_CPU,
                                       DistributedType.MULTI_NEURON):
            os.environ["LOCAL_RANK"] = str(index)
            processes_per_node = int(os.environ.get("NPROC", 1))
            os.environ["RANK"] = str(processes_per_node * int(os.environ.get("NODE_RANK", 0)) + index)
        os.environ["FORK_LAUNCHED"] = str(1)
        self.launcher(*args)
