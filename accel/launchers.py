"""Accelerate's `notebook_launcher` and `debug_launcher`: run a function on several processes from inside Python
(a notebook, a test), with torch's own elastic launcher (`torch.distributed.launcher.api.elastic_launch`, what
torchrun runs) forking the workers. The workers see the accel config as `accel launch`'s workers do."""

from __future__ import annotations

import contextlib
import os
from typing import Callable

from accel.core.restarts import export_restart_count
from accel.config import LAUNCH_ENV, AccelConfig, encode_for_workers


@contextlib.contextmanager
def _worker_config(cfg: AccelConfig):
    """The config the forked workers read, set in this process's environment while they start."""
    old = os.environ.get(LAUNCH_ENV)
    os.environ[LAUNCH_ENV] = encode_for_workers(cfg)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(LAUNCH_ENV, None)
        else:
            os.environ[LAUNCH_ENV] = old


def notebook_launcher(function: Callable, args: tuple = (), num_processes: int | None = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: dict | None = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: str | None = None) -> None:
    """Run `function(*args)` on `num_processes` forked processes per node (one: in this process). A worker's
    failure raises torch's `ChildFailedError` here, after `max_restarts` restarts of the whole group."""
    import torch

    from accel.core.probes import is_cuda_available, nvml_cuda_check

    num_processes = num_processes or 1
    if num_processes == 1 and num_nodes == 1:
        with _worker_config(AccelConfig(mixed_precision=mixed_precision)):
            function(*args)
        return
    if torch.cuda.is_initialized():
        raise RuntimeError("notebook_launcher: CUDA was already initialised in this process, so its workers cannot be "
                           "forked; restart the kernel and do not touch CUDA before calling notebook_launcher")
    gpus = is_cuda_available()
    cfg = AccelConfig(num_processes=num_processes * num_nodes, num_machines=num_nodes, mixed_precision=mixed_precision,
                      use_cpu=not gpus, machine_rank=node_rank, main_process_ip=master_addr)
    conf = dict(rdzv_conf or {})
    if rdzv_backend == "static":
        conf["rank"] = node_rank
    # until the workers are forked, whatever asks torch about CUDA in this process asks NVML (the CUDA runtime
    # initialised here would make every worker fail); the preloaded imports are skipped on a GPU machine, where
    # torch._dynamo's import may ask for the devices
    with nvml_cuda_check():
        _launch(function, args, cfg, num_processes, num_nodes, rdzv_backend,
                rdzv_endpoint or f"{master_addr}:{use_port}", conf, rdzv_id, max_restarts, monitor_interval,
                log_line_prefix_template, preload=not gpus)


def debug_launcher(function: Callable, args: tuple = (), num_processes: int = 2) -> None:
    """Run `function(*args)` on `num_processes` CPU processes on this machine (for tests and debugging)."""
    cfg = AccelConfig(num_processes=num_processes, use_cpu=True)
    # port 0: the agent's c10d store binds a free port itself, as `accel launch` does on one machine
    _launch(function, args, cfg, num_processes, 1, "c10d", "127.0.0.1:0", {}, "accel-debug", 0, 0.1, None)


def _in_fresh_state(function, *args):
    """A forked worker starts from no process state: the parent's (its own single-process one, if it made an
    Accelerator) is forgotten, so the worker's `PartialState()` joins the launched group.

    On CPU the gloo group connects its ranks at the first collective, not in `PartialState()` (torch's
    TORCH_GLOO_LAZY_INIT, unless the user set it): a notebook function may return on one worker before touching the
    state, and the others must not wait for it forever (Accelerate's fault-tolerance test does exactly this)."""
    from accel.runtime.state import PartialState

    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")
    export_restart_count()  # this fork imported accel before the agent set TORCHELASTIC_RESTART_COUNT

    PartialState._shared_state.clear()
    PartialState._instance = PartialState._carried = None
    return function(*args)


def _preload_for_workers() -> None:
    """Import in this process what every worker imports anyway, once, before forking: torch's optimizers import
    torch._dynamo when the first one is built (about 2 s of CPU), which each fork would otherwise repeat at every
    launch (a notebook or a test suite launching many times pays it per launch and per process)."""
    import torch._dynamo  # noqa: F401


def _launch(function, args, cfg, nproc, nnodes, rdzv_backend, endpoint, conf, run_id, max_restarts, monitor_interval,
            log_line_prefix_template, preload: bool = True) -> None:
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if preload:
        _preload_for_workers()

    config = LaunchConfig(min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc, run_id=run_id,
                          rdzv_endpoint=endpoint, rdzv_backend=rdzv_backend, rdzv_configs=conf,
                          max_restarts=max_restarts, monitor_interval=monitor_interval, start_method="fork",
                          log_line_prefix_template=log_line_prefix_template)
    with _worker_config(cfg):
        elastic_launch(config=config, entrypoint=_in_fresh_state)(function, *args)
