"""The one check a resolved config passes before accel starts any process for it.

`accel launch`, `accel env` and `accel config` all call `check_launchable`, so a config one of them accepts the
others accept too (and `accel config` never saves what `accel launch` would refuse). Workers validate what they
can see themselves (the real world size) when the Accelerator is built; this check knows `num_processes` instead.
"""

from __future__ import annotations

from accel.backends import check_available
from accel.config.degrees import check_world_layout
from accel.config.schema import AccelConfig, check_consistency


def check_launchable(cfg: AccelConfig, source: str = "config") -> AccelConfig:
    """Every rule, each a one-line ConfigError naming the key: the cross-field rules (fp8 needs torchao
    included), the parallel layout on exactly `num_processes` processes, the combinations accel has
    (`accel.backends.check_available`: offload, TP/PP with ZeRO, pipeline schedules), the styles of a given
    tensor-parallel plan (`parallelism.tp_plan`; a bad one would fail in every worker) and, when a torch.compile
    backend is asked for, that this torch has it. Returns `cfg`."""
    check_consistency(cfg, source)
    check_available(cfg.parallelism, cfg.num_processes)  # first: a refused combination is named as such
    check_world_layout(cfg.parallelism, cfg.num_processes, source)
    if cfg.parallelism.tp_plan:  # the styles (its names need the model: the workers check those); imports torch
        from accel.parallel.tensor_plan import check_plan_styles

        check_plan_styles(cfg.parallelism.tp_plan, f"{source}: key 'parallelism.tp_plan'")
    if cfg.dynamo_backend != "no":  # imports torch, only then
        from accel.transforms.compilation import compile_options

        compile_options(cfg)
    return cfg
