"""`accel launch`: run a training script on one or many processes, GPUs or machines.

    accel launch [flags] script.py [script args...]
    accel launch [flags] -m package.module [module args...]

Everything after the script (or module) name goes to it untouched, even arguments that look like our flags.
Before anything starts, the script (or module) must exist and the config must pass `check_launchable`, the
checks `accel env` and `accel config` run too (see checks.py); `--dry_run` stops there and prints the
resolved config (each value with where it came from) and the exact command.

How it runs:

* The config is resolved once (built-in defaults < packaged default < the user's config file <
  the `--deepspeed_config_file` JSON < the other flags) and handed to every worker in ONE environment
  variable, `ACCEL_LAUNCH_CONFIG` (JSON). When `gpu_ids` is not "all" (and not on CPU),
  `CUDA_VISIBLE_DEVICES` is set from it as well. Only the flags given form the override layer. `--cpu`
  also drops a file's `distributed_type` (it is derived again), `--multi_gpu` also sets `use_cpu: false`,
  and a `--num_processes` above 1 overrides a file's `distributed_type: NO` (which Accelerate writes for
  one process). For several processes the launcher fills in the derived `distributed_type` (MULTI_GPU
  or MULTI_CPU) before handing the config over.
* `accelerate launch`'s flags are taken too (--use_fsdp, --fsdp_*, --use_deepspeed, --offload_*_device, ...): see
  accelerate_flags.py. Those that describe training join the flags' layer as a config file's sections would.
* torch is imported only when needed: to count GPUs (not with --cpu) and to run torchrun's agent.
* One process in total: the script replaces the launcher (`os.execvpe` of the current Python); no torchrun,
  no rendezvous, and the script's exit code is the launcher's.
* Otherwise torchrun's elastic agent runs in this process (`torch.distributed.run.main`) with
  `--nproc_per_node num_processes // num_machines` and `--nnodes num_machines`:

  - one machine: c10d rendezvous on 127.0.0.1, on `main_process_port` when given (it must be free), else
    on port 0, i.e. the agent binds a free port itself (as `torchrun --standalone` does);
  - several machines, `rdzv_backend: static` (the default, as in Accelerate): `--node_rank machine_rank
    --master_addr main_process_ip --master_port main_process_port` (port 29500 when not given). Static
    rendezvous respects the node rank, so **`machine_rank` IS the node rank**: the workers of machine
    `machine_rank` get the global ranks `machine_rank * nproc_per_node + local_rank`, and machine_rank 0
    must be the machine at `main_process_ip`;
  - several machines, `rdzv_backend: c10d`: `--rdzv_backend c10d --rdzv_endpoint ip:port --rdzv_id <id>`
    where the id is derived from the ip, port, num_machines and num_processes, so all machines agree on it
    without being told. torchrun then assigns node ranks itself in arrival order, so `machine_rank` only
    says which machine hosts the rendezvous store (`--rdzv_conf is_host=1` on machine_rank 0, `is_host=0`
    on the others): machine_rank 0 must be the machine at main_process_ip.

When a worker fails, the agent stops the others; the launcher prints its summary line first (the rank that failed first
and its exception), that rank's traceback once, then one line per other failed rank (failure_report.py), and exits
with the failed worker's exit code (128 + N for a worker killed by signal N).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import os
import socket
import sys

from accel.cli import accelerate_flags, checks, config_flags, failure_report, forked_workers, job_reaper, kubeflow
from accel.cli import multinode, output
from accel.cli import fault_tolerance as ft_launch
from accel.cli import preemption as preempt
from accel.cli import shim as auto_shim
from accel.cli._common import DEFAULT_MULTI_MACHINE_PORT, UsageError, add_flag
from accel.cli import hang_report, rendezvous_wait
from accel.cli.hang_report import HangWatch
from accel.config.schema import C_INT_MAX
from accel.fault_tolerance import REPLICAS_DIVERGED_EXIT_CODE as REPLICAS_DIVERGED
from accel.config import (
    LAUNCH_ENV,
    AccelConfig,
    ConfigError,
    cuda_visible_devices,
    encode_for_workers,
)
from accel.config import resolve_launch_config as _resolve_launch_config

FLAGS_SOURCE = "accel launch flags"

# launch flag -> key of the config layer it sets: one per config key (config_flags.py, from the schema's specs), and
# the DeepSpeed JSON, read as its own layer between the config file and the other flags
_FLAG_KEYS = {**config_flags.FLAG_KEYS, "deepspeed_config_file": "deepspeed_config_file"}
# the flags that feed the config (`accel env` takes them too), Accelerate's among them
CONFIG_FLAGS = tuple(_FLAG_KEYS) + accelerate_flags.CONFIG_FLAGS


def launch_parser() -> argparse.ArgumentParser:
    """`accel launch`'s parser on its own (the flags a --hostfile launch passes on to each host)."""
    return register(argparse.ArgumentParser().add_subparsers())


def register(subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "launch",
        help="run a script on one or many processes, GPUs or machines",
        description="Run a training script with the resolved accel config (see `accel config`). "
        "Only the flags you give override the config file.",
        allow_abbrev=False,  # a script's own `--m...` must never be taken for one of our flags
    )
    add_flag(parser, "config_file", metavar="PATH", default=None,
             help="config file (default: $ACCEL_CONFIG_FILE, else ~/.cache/accel/default_config.yaml)")
    hw = parser.add_argument_group("hardware")
    add_flag(hw, "cpu", action="store_true", default=None, help="run on the CPU only (use_cpu: true)")
    add_flag(hw, "multi_gpu", action="store_true", default=None,
             help="one process per GPU (distributed_type: MULTI_GPU)")
    config_flags.add(hw, "gpu_ids", "mixed_precision")
    dist = parser.add_argument_group("processes and machines")
    config_flags.add(dist, "num_processes", "num_machines", "machine_rank", "main_process_ip", "main_process_port",
                     "rdzv_backend")
    add_flag(dist, "max_restarts", type=int, metavar="N", default=0, help="restarts of the worker group on failure")
    config_flags.add(dist, "collective_timeout")
    stop = parser.add_argument_group("preemption (SIGTERM asks the workers to save and stop: "
                                      "accelerator.preemption_requested)")
    config_flags.add(stop, "preemption_signal", "grace_period", "requeue")
    train = parser.add_argument_group("training")
    config_flags.add(train, "gradient_accumulation_steps", "checkpoint_async", "throughput_monitor",
                     "throughput_log_every", "parallelism.zero_stage", *config_flags.degree_keys(),
                     *(f"parallelism.{key}" for key in ("cp_comm_strategy", "pp_schedule", "pp_microbatches",
                                                        "activation_checkpointing", "zero_mixed_precision")),
                     "dynamo_backend", "dynamo_mode", "dynamo_use_fullgraph", "dynamo_use_dynamic",
                     "dynamo_use_regional_compilation")
    add_flag(train, "deepspeed_config_file", metavar="PATH", default=None,
             help="a DeepSpeed JSON config: its ZeRO stage, offload, batch sizes, clipping, accumulation and fp16/bf16 "
                  "are used (over the config file; the other flags win); DeepSpeed itself is not needed")
    add_flag(parser, "accelerate_shim", action="store_true", default=False,
             help="run a script written for Hugging Face Accelerate unchanged: `import accelerate` (and its "
                  "submodules) gives accel")
    add_flag(parser, "dry_run", action="store_true", default=False,
             help="print the resolved config (with where each value came from) and the exact command, start nothing")
    multinode.add_flags(parser)
    ft_launch.add_flags(parser)
    output.add_flags(parser)
    accelerate_flags.add_flags(parser)  # `accelerate launch`'s flags, hidden from --help
    parser.add_argument("-m", "--module", action="store_true",
                        help="treat the script as a Python module name, as `python -m` does")
    parser.add_argument("script", nargs="?", help="the script (or, with -m, the module) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments passed to the script untouched")
    parser.set_defaults(func=run_command)
    return parser


# -------------------------------------------------------------------------------------------------------
# pure helpers (unit-tested without starting processes)
# -------------------------------------------------------------------------------------------------------

def flag_overrides(args: argparse.Namespace) -> dict:
    """The override layer (raw, not yet validated) made of the flags the user actually gave, then the values of a
    cluster's environment that neither they nor the config file set (`srun`'s beat the file: multinode.py;
    a Kubernetes pod's do not: kubeflow.py)."""
    return flags_and_pod(args)[0]


def pod_env(args: argparse.Namespace, given: dict) -> kubeflow.PodEnv | None:
    """In a Kubernetes pod (Kubeflow's PET_*, PyTorchJob's WORLD_SIZE/RANK): its values for the keys that neither
    `given` nor the user's config file set. Not for a --hostfile head (it sets every host's values itself)."""
    if getattr(args, "hostfile", None):
        return None
    if not any(os.environ.get(name) for name in (*kubeflow.PET_VARIABLES.values(), kubeflow.NPROC_VARIABLE,
                                                  "WORLD_SIZE", "RANK")):
        return None
    from accel.config import read_config_file, user_config_path

    path = user_config_path(getattr(args, "config_file", None))
    file_values = read_config_file(path) if path is not None else {}
    return kubeflow.read(os.environ, given, file_values, str(path) if path is not None else "the config file")


def flags_and_pod(args: argparse.Namespace) -> tuple[dict, kubeflow.PodEnv | None]:
    """`flag_overrides` and the pod's values among them (with their sources), or None outside a pod."""
    raw: dict = {}
    for flag, key in _FLAG_KEYS.items():
        value = getattr(args, flag, None)
        if value is None:
            continue
        if "." in key:
            section, sub = key.split(".")
            raw.setdefault(section, {})[sub] = value
        else:
            raw[key] = value
    raw = accelerate_flags.add_config_overrides(raw, args)  # --use_fsdp, --fsdp_*, --offload_*_device, ...
    if getattr(args, "cpu", None):
        raw["use_cpu"] = True
        raw["distributed_type"] = None  # a file's MULTI_GPU yields to --cpu: derived again (NO or MULTI_CPU)
    if getattr(args, "multi_gpu", None):
        raw["use_cpu"] = False
        raw["distributed_type"] = "MULTI_GPU"
    raw.update(multinode.slurm_overrides(os.environ, raw))  # under `srun`: SLURM's node rank/count/main (flags win)
    multinode.refuse_mpi_launchers(os.environ, raw)  # `mpirun -np N accel launch`: N separate jobs
    pod = pod_env(args, raw)  # in a Kubernetes pod: PET_* or WORLD_SIZE/RANK, below the flags and the config file
    if pod is not None:
        raw.update(pod.values)
    return raw, pod


def resolve_launch_config(config_file: str | None, overrides: dict) -> AccelConfig:
    """Resolve the files and the flag layer once (the precedence rules live in `accel.config.resolve`)."""
    return _resolve_launch_config(config_file, overrides, FLAGS_SOURCE)


def nproc_per_node(cfg: AccelConfig) -> int:
    return cfg.processes_per_machine


def rendezvous_port(cfg: AccelConfig) -> int:
    """The port `build_torchrun_args` gets: the configured one, else 0 on one machine (the agent binds a
    free port itself) or 29500 on several."""
    if cfg.main_process_port is not None:
        return cfg.main_process_port
    return 0 if cfg.num_machines == 1 else DEFAULT_MULTI_MACHINE_PORT


def rdzv_id(cfg: AccelConfig, port: int) -> str:
    """A run id every machine derives identically from the shared settings (for c10d rendezvous)."""
    key = f"{cfg.main_process_ip or '127.0.0.1'}:{port}:{cfg.num_machines}:{cfg.num_processes}"
    return "accel-" + hashlib.sha1(key.encode()).hexdigest()[:12]


def build_torchrun_args(cfg: AccelConfig, script_argv: list[str], max_restarts: int = 0,
                        port: int | None = None, rdzv_conf: str = "") -> list[str]:
    """torchrun's argv for `cfg`. `script_argv` is `[script, *args]` or `["-m", module, *args]`; `rdzv_conf` is
    more rendezvous options (`key=value,...`)."""
    if port is None:
        port = rendezvous_port(cfg)
    argv = [
        "--nnodes", str(cfg.num_machines),
        "--nproc_per_node", str(nproc_per_node(cfg)),
        "--max_restarts", str(max_restarts),
    ]
    if cfg.num_machines == 1:
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", rdzv_id(cfg, port)]
    elif cfg.rdzv_backend == "static":
        argv += ["--rdzv_backend", "static", "--node_rank", str(cfg.machine_rank),
                 "--master_addr", str(cfg.main_process_ip), "--master_port", str(port)]
    else:
        # machine_rank 0 hosts the rendezvous store; the others only connect to it (even when, as in a
        # one-host test, the endpoint address is local to them too)
        argv += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"{cfg.main_process_ip}:{port}",
                 "--rdzv_id", rdzv_id(cfg, port)]
        rdzv_conf = ",".join(filter(None, (f"is_host={int(cfg.machine_rank == 0)}", rdzv_conf)))
    if rdzv_conf:
        argv += ["--rdzv_conf", rdzv_conf]
    # "--": the script's own arguments are never read as torchrun's (argparse took `--signal` for an ambiguous
    # abbreviation of --signals_to_handle and refused the launch)
    if script_argv and script_argv[0] == "-m":
        argv += ["--module", "--", *script_argv[1:]]
    elif script_argv:
        argv += ["--", *script_argv]
    return argv


def worker_env(cfg: AccelConfig) -> dict[str, str]:
    """The variables the launcher adds to the workers' environment: the resolved config (the one channel),
    and `CUDA_VISIBLE_DEVICES` when a GPU subset is asked for."""
    env = {LAUNCH_ENV: encode_for_workers(cfg)}
    visible = cuda_visible_devices(cfg)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def port_in_use(port: int, host: str = "") -> bool:
    """True when `port` cannot be bound on this machine (something listens on it, holds it bound, or it is
    privileged). TIME_WAIT leftovers of a finished run do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


# -------------------------------------------------------------------------------------------------------
# the command
# -------------------------------------------------------------------------------------------------------

def _script_argv(args: argparse.Namespace) -> list[str]:
    if not args.script:
        if args.module:
            raise UsageError("-m/--module needs a module name, e.g. `accel launch -m my_pkg.train`")
        raise UsageError("no script given; usage: accel launch [flags] script.py [script args...]")
    if args.module:
        checks.check_module(args.script, _shim_path(args))
        return ["-m", args.script, *args.script_args]
    if args.no_python:
        accelerate_flags.check_program(args.script)
    else:
        checks.check_script(args.script)
    return [args.script, *args.script_args]


def _shim_path(args: argparse.Namespace) -> list[str]:
    if not args.accelerate_shim:
        return []
    return shim_search_path()


def shim_search_path() -> list[str]:
    """The shim's folders for PYTHONPATH; a bad $ACCEL_ACCELERATE_VERSION is a UsageError (one line, exit 2)."""
    from accel.shim import ShimVersionError, search_path

    try:
        return search_path()
    except ShimVersionError as err:
        raise UsageError(str(err)) from None


_CUDA_QUERIED = [False]  # set when this launcher asked a CUDA build of torch about GPUs


def _check_hardware(cfg: AccelConfig) -> AccelConfig:
    """Fill in distributed_type and check the GPUs. torch is imported only when GPUs may be used."""
    wants_gpu = not cfg.use_cpu and cfg.distributed_type != "MULTI_CPU"
    visible = 0
    if wants_gpu:
        import torch

        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        _CUDA_QUERIED[0] = torch.version.cuda is not None  # the driver may be initialised here: workers must not fork
    if cfg.distributed_type == "MULTI_GPU" and visible == 0:
        raise UsageError("multi-GPU launch requested (--multi_gpu or distributed_type: MULTI_GPU) but no CUDA device "
                         "is visible; use --cpu")
    dist_type = cfg.resolved_distributed_type(cuda_available=visible > 0)
    if dist_type == "MULTI_GPU" and nproc_per_node(cfg) > visible:
        raise UsageError(f"num_processes={cfg.num_processes} means {nproc_per_node(cfg)} processes on this machine "
                         f"but only {visible} GPU(s) are visible; lower --num_processes or use --cpu")
    return dataclasses.replace(cfg, distributed_type=dist_type)


def run_command(args: argparse.Namespace) -> int:
    checks.check_flag_conflicts(args)
    accelerate_flags.prepare(args)  # refused flags, the DeepSpeed multi-node flags onto --hostfile/--include/...
    if not 0 <= args.max_restarts <= C_INT_MAX:
        raise UsageError(f"--max_restarts: bad value {args.max_restarts}; allowed: an integer from 0 to {C_INT_MAX}")
    preemptible = os.environ.get(multinode.HEAD_WATCH_ENV) != "1"  # a --hostfile head stops its launchers by SIGTERM
    multinode.stop_when_head_disconnects()  # a launcher started over ssh by --hostfile
    script_argv = _script_argv(args)
    if auto_shim.auto_shim(args):  # an Accelerate script, no Accelerate installed: through the shim (shim.py)
        args.accelerate_shim = args.shim_by_itself = True
    if args.hostfile:
        return multinode.run_on_hosts(args, script_argv, lambda more: checks.resolve_checked(
            args.config_file, {**flag_overrides(args), **more}, "accel launch", FLAGS_SOURCE, hold_warnings=True),
            launch_parser())
    # every config rule (shared with accel env and accel config), before starting any process; its warnings are
    # printed once every check below passed (a refusal is the one line)
    cfg = checks.resolve_checked(args.config_file, flag_overrides(args), "accel launch", FLAGS_SOURCE,
                                 hold_warnings=True)
    if ft_launch.runs_groups(cfg):  # torchft's lighthouse and one launcher per replica group (fault_tolerance.py)
        checks.release_warnings()
        if not args.dry_run:
            _say_start(args, cfg)
        return ft_launch.run_groups(args, cfg, script_argv)
    if args.accelerate_shim:
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (*shim_search_path(), os.environ.get("PYTHONPATH")) if p)
    visible = cuda_visible_devices(cfg)
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible  # before torch counts the GPUs

    one = cfg.num_processes == 1 and cfg.num_machines == 1
    if (one and not output.needs_agent(args) and not accelerate_flags.needs_agent(args, cfg) and not args.max_restarts
            and not cfg.requeue  # --requeue: the launcher requeues after the script stopped
            and not cfg.fault_tolerance.enabled):  # a replica group: torchrun's store serves torchft's Manager
        if cfg.distributed_type == "MULTI_GPU":
            cfg = _check_hardware(cfg)
        checks.release_warnings()
        if args.dry_run:
            return _dry_run(args, cfg, accelerate_flags.command(args, sys.executable, script_argv))
        _say_start(args, cfg)
        os.environ.update(accelerate_flags.worker_env(args))  # the process is replaced: its environment is theirs
        if args.no_python:  # the program itself, not python
            return _exec_single(cfg, script_argv, python=False)
        return _exec_single(cfg, script_argv)

    cfg = _check_hardware(cfg)
    port = rendezvous_port(cfg)
    if port and cfg.machine_rank == 0 and port_in_use(port):  # machine_rank 0 binds it (static and c10d alike)
        hint = " or leave it unset" if cfg.num_machines == 1 else ""
        raise UsageError(f"port {port} (--main_process_port / config main_process_port) is already in use on this "
                         f"machine (or cannot be bound); pick another port{hint}")
    torchrun_argv = (output.torchrun_flags(args) + accelerate_flags.torchrun_flags(args, cfg)
                     + preempt.torchrun_flags(cfg.preemption_signal, preemptible)
                     + build_torchrun_args(cfg, script_argv, args.max_restarts, port, accelerate_flags.rdzv_conf(args)))
    checks.check_torchrun_argv(torchrun_argv)  # what torchrun itself would refuse, refused now (dry run too)
    checks.release_warnings()
    if args.dry_run:
        return _dry_run(args, cfg, [sys.executable, "-m", "torch.distributed.run", *torchrun_argv])
    _say_start(args, cfg)
    os.environ.update(accelerate_flags.worker_env(args))  # before the thread default: a given count wins
    output.set_worker_threads(nproc_per_node(cfg), on_cpu=cfg.distributed_type == "MULTI_CPU")
    return _run_torchrun(cfg, torchrun_argv, preemptible)


def value_sources(args: argparse.Namespace, flags_source: str = FLAGS_SOURCE) -> dict:
    """Where each value came from (`checks.value_sources`), a Kubernetes pod's variables included: for --dry_run, the
    start line and `accel env`."""
    overrides, pod = flags_and_pod(args)
    sources = checks.dry_run_sources(args.config_file, overrides, flags_source)
    if pod is not None:  # the keys only its variables set (they joined the flags' layer): named after them
        sources.update({key: (pod.sources[key], value) for key, value in pod.values.items()})
    return sources


def _dry_run(args: argparse.Namespace, cfg: AccelConfig, command: list[str]) -> int:
    env = {**worker_env(cfg), **accelerate_flags.worker_env(args)}
    if args.accelerate_shim:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return checks.print_dry_run(cfg, value_sources(args), env, command)


def _say_start(args: argparse.Namespace, cfg: AccelConfig) -> None:
    """The start line (`checks.start_line`) on stderr; not from a replica group's own launcher (its head said it)."""
    if os.environ.get(ft_launch.GROUP_ENV) is None:
        note = auto_shim.NOTE if getattr(args, "shim_by_itself", False) else ""
        sys.stderr.write(checks.start_line(cfg, value_sources(args), note) + "\n")
        sys.stderr.flush()


def _exec_single(cfg: AccelConfig, script_argv: list[str], python: bool = True) -> int:
    env = {**os.environ, **worker_env(cfg)}
    command = [sys.executable, *script_argv] if python else script_argv
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(command[0], command, env)  # replaces this process: never returns


def _exit_code(code: int | None) -> int:
    if code is None or code == 0:
        return 1
    return 128 - code if code < 0 else code


@contextlib.contextmanager
def _announcing_restarts(watch=None):
    """One line when torchrun's agent restarts the worker group (torch says so only in its INFO log), naming the
    rank whose failure made it restart and its exception, then its traceback; a rank the agent stopped because of
    it is named as stopped by accel launch (`watch`, the HangWatch, knows which were still running; left untyped, so
    that mypy leaves the patches of torch's methods alone, as before)."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    original, original_monitor = SimpleElasticAgent._restart_workers, LocalElasticAgent._monitor_workers

    def monitor(agent, worker_group):
        agent._accel_last_result = result = original_monitor(agent, worker_group)
        if any(f.exitcode == REPLICAS_DIVERGED for f in (getattr(result, "failures", None) or {}).values()):
            agent._remaining_restarts = 0  # a restart would heal from the same diverged replicas: the job stops
        return result

    def restart(agent, worker_group):
        spec = worker_group.spec
        done = spec.max_restarts - agent._remaining_restarts
        failures = getattr(getattr(agent, "_accel_last_result", None), "failures", None) or {}
        stopped = (lambda rank: watch.stopped_by_launcher(rank, attempt=done - 1)) if watch else (lambda rank: False)
        # every failed rank, the first to end first (it is the cause more often than not), then its traceback
        lines = failure_report.restart_lines(failures, output.held_errors(failures), stopped, (
            f"restarting the worker group (restart {done} of {spec.max_restarts}, ACCEL_RESTART_COUNT={done} in the "
            "new workers)"))
        output.keep_in_logs(failures)
        sys.stderr.write("".join(f"{line}\n" for line in lines))
        sys.stderr.flush()
        return original(agent, worker_group)

    SimpleElasticAgent._restart_workers = restart
    LocalElasticAgent._monitor_workers = monitor
    try:
        yield
    finally:
        SimpleElasticAgent._restart_workers = original
        LocalElasticAgent._monitor_workers = original_monitor


_ended = failure_report.ended  # how a worker ended, and for a signal what it means


def _not_preempted(stop: preempt.PreemptionWatch, rank: int, code: int) -> None:
    """After a preemption request, a failed worker means no exit code 75: say so, in one line (a failed grace save
    must never pass for "saved, run again")."""
    if stop.requested_by is not None or stop.seen():
        sys.stderr.write(f"accel launch: the workers were asked to save and stop, but rank {rank} failed: exit code "
                         f"{code}, not {preempt.preemption.EXIT_CODE} (their grace save may be missing; see the lines "
                         "above)\n")


def _run_torchrun(cfg: AccelConfig, torchrun_argv: list[str], preemptible: bool = True) -> int:
    os.environ.update(worker_env(cfg))
    watch = HangWatch(cfg.collective_timeout, cfg.num_machines)  # a collective that times out: its stuck rank named
    os.environ.update(watch.worker_env())
    # SIGTERM (and preemption_signal) ask the workers to save and stop: preemption.py
    stop = preempt.PreemptionWatch(watch.run_dir, cfg.preemption_signal, cfg.grace_period, cfg.requeue,
                                   enabled=preemptible, machine_rank=cfg.machine_rank)
    os.environ.update(stop.worker_env())
    hang = None
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        forking = forked_workers.wanted(on_cpu=(cfg.distributed_type == "MULTI_CPU" or bool(cfg.use_cpu))
                                        and not _CUDA_QUERIED[0])
        with (watch.around_agent(), _announcing_restarts(watch), stop.around_agent(),
              rendezvous_wait.around_agent(cfg, lambda: watch.cleanup(keep=False)),
              job_reaper.reaping_workers(stop.stop_mark),  # no worker's process group outlives the job (or us)
              forked_workers.forking_workers() if forking else contextlib.nullcontext()):
            output.run_agent(torchrun_argv)  # torchrun's main, with accel's log layout (output.py)
    except ChildFailedError as exc:
        sys.stdout.flush()
        errors = output.held_errors(exc.failures)  # the workers' exceptions, which they left to us to print
        hidden = getattr(exc, "accel_hidden_lines", [])  # --local_ranks_filter: hidden failed ranks' last lines
        hang = watch.report(exc.failures, errors)
        if hang is not None:  # which rank never came (or left, or failed), what the others waited in
            sys.stderr.write("".join(f"{line}\n" for line in [*hang.lines[:1], *hidden, *hang.lines[1:]]))
            code = _exit_code(exc.failures[hang.first_rank].exitcode if hang.exitcode is None else hang.exitcode)
            _not_preempted(stop, hang.first_rank, code)
            return code
        first_rank = failure_report.order(exc.failures, errors, watch.stopped_by_launcher)[0]
        first = exc.failures[first_rank]
        lines = failure_report.failure_lines(exc.failures, first_rank, errors, watch.stopped_by_launcher, hidden)
        sys.stderr.write("".join(f"{line}\n" for line in lines))  # the summary first, the traceback once
        _not_preempted(stop, first_rank, _exit_code(first.exitcode))
        return _exit_code(first.exitcode)
    except SignalException as exc:
        in_group = os.environ.get(ft_launch.GROUP_ENV) is not None  # a replica group's: its head says how it ended
        stopped = stop.stopped_message()
        if stopped is not None:  # a preemption request's second signal or grace period, or no worker listened
            if not in_group:
                sys.stderr.write(stopped + "\n")
            return stop.stopped_code()
        if not in_group:
            sys.stderr.write(f"accel launch: stopped by signal {int(exc.sigval)}"
                             f"{hang_report.signal_name(int(exc.sigval))}; the workers were stopped\n")
        return 128 + int(exc.sigval)
    except SystemExit as exc:  # torchrun's own argument errors (checks.check_torchrun_argv refuses them first)
        if exc.code in (None, 0):
            return 0
        sys.stderr.write(f"accel launch: error: torchrun refused its arguments (exit code {exc.code})\n")
        return 2
    except ConfigError:
        raise
    except Exception as exc:  # rendezvous failures and the like: one line, no traceback
        message = " ".join(str(exc).split()) or "(no message)"
        sys.stderr.write(f"accel launch: error: torchrun failed: {type(exc).__name__}: {message}\n")
        return 1
    else:
        # 0, or preempt.preemption.EXIT_CODE when the workers stopped at a preemption request (a replica group's head
        # says it once for every group)
        return stop.finish(quiet=os.environ.get(ft_launch.GROUP_ENV) is not None)
    finally:
        watch.cleanup(keep=hang is not None and hang.keeps_folder)
