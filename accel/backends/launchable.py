"""The one check a resolved config passes before accel starts any process for it.

`accel launch`, `accel env` and `accel config` all call `check_launchable`, so a config one of them accepts the
others accept too (and `accel config` never saves what `accel launch` would refuse). Workers validate what they
can see themselves (the real world size) when the Accelerator is built; this check knows `num_processes` instead.
"""

from __future__ import annotations

from accel.backends import check_available
from accel.config.schema import (
    AccelConfig,
    ConfigError,
    check_consistency,
    data_parallel_sizes,
    divides_world,
    model_parallel_size,
)
from accel.config.degrees import check_expert_degree, sequence_parallel_size


def check_launchable(cfg: AccelConfig, source: str = "config") -> AccelConfig:
    """Every rule, each a one-line ConfigError naming the key: the cross-field rules (fp8 needs torchao
    included), the parallel layout on exactly `num_processes` processes, the combinations accel has
    (`accel.backends.check_available`: offload, TP/PP with ZeRO, pipeline schedules), the styles of a given
    tensor-parallel plan (`parallelism.tp_plan`; a bad one would fail in every worker) and, when a torch.compile
    backend is asked for, that this torch has it. Returns `cfg`."""
    check_consistency(cfg, source)
    check_available(cfg.parallelism, cfg.num_processes)  # first: a refused combination is named as such
    check_world_layout(cfg, source)
    if cfg.parallelism.tp_plan:  # the styles (its names need the model: the workers check those); imports torch
        from accel.parallel.tensor_plan import check_plan_styles

        check_plan_styles(cfg.parallelism.tp_plan, f"{source}: key 'parallelism.tp_plan'")
    if cfg.dynamo_backend != "no":  # imports torch, only then
        from accel.transforms.compilation import compile_options

        compile_options(cfg)
    return cfg


def check_world_layout(cfg: AccelConfig, source: str = "config") -> None:
    """tp x pp x sp/cp (x the data-parallel sizes) must fit `num_processes`, one process included: a config file
    alone (no launch) may leave num_processes at 1 for a world torchrun sets, but a launch starts exactly that many."""
    par = cfg.parallelism
    seq = sequence_parallel_size(par)
    if not divides_world(cfg.num_processes, par.tp_size, par.pp_size, seq):
        needed = model_parallel_size(par.tp_size, par.pp_size, seq)
        names = "tp_size x pp_size" + ("" if seq == 1 else " x cp_size" if par.cp_size > 1 else " x sp_size")
        raise ConfigError(f"{source}: key 'num_processes': {cfg.num_processes} is not divisible by {names} = "
                          f"{needed}; allowed: num_processes a multiple of {needed}, or a smaller "
                          f"{names.replace(' x ', '/')}")
    data_parallel_sizes(par, cfg.num_processes, f"{source}: parallelism")
    dp = cfg.num_processes // model_parallel_size(par.tp_size, par.pp_size, seq)
    check_expert_degree(getattr(par, "ep_size", 1), dp, f"{source}: parallelism")
