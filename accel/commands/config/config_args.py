"""Accelerate's config-file dataclasses (`BaseConfig`, `ClusterConfig`, `SageMakerConfig`) and
`load_config_from_file`, over accel's config reader.

The files are accel's (`default_config_file` is the file `accel launch` reads); a file in Accelerate's own format is
read too. `load_config_from_file` validates with accel's reader (an unknown key or bad value is accel's one-line
ConfigError, a ValueError) and returns the Accelerate dataclass of the file's values; a file in accel's format is
resolved first and shown with Accelerate's field names.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from accel.config import default_user_config_path

default_config_file = str(default_user_config_path())
cache_dir = os.path.dirname(default_config_file)
default_yaml_config_file = default_config_file
default_json_config_file = os.path.join(cache_dir, "default_config.json")


def _enum_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {k: _enum_value(v) for k, v in value.items()} or None
    return value


@dataclass
class BaseConfig:
    """The keys every Accelerate config file has."""

    compute_environment: str
    distributed_type: str
    mixed_precision: str | None  # a file may leave it empty: "no" then
    use_cpu: bool
    debug: bool

    def __post_init__(self) -> None:
        from accel.runtime.state import DistributedType
        from accel.compat.dataclasses import ComputeEnvironment

        for name, kind in (("compute_environment", ComputeEnvironment), ("distributed_type", DistributedType)):
            value = getattr(self, name)
            if isinstance(value, str) and value in kind._value2member_map_:
                setattr(self, name, kind(value))
        if self.mixed_precision is None:
            self.mixed_precision = "no"

    def to_dict(self) -> dict:
        """The fields set (None left out), enums as their values, as Accelerate writes them."""
        values = {f.name: _enum_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {k: v for k, v in values.items() if v is not None}

    @classmethod
    def from_json_file(cls, json_file: str | None = None):
        return cls(**_known(cls, json.loads(Path(json_file or default_json_config_file).read_text())))

    def to_json_file(self, json_file: str) -> None:
        _atomic_text(Path(json_file), json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_yaml_file(cls, yaml_file: str | None = None):
        from accel.config.yaml_file import load_yaml_file

        return cls(**_known(cls, load_yaml_file(Path(yaml_file or default_yaml_config_file)) or {}))

    def to_yaml_file(self, yaml_file: str) -> None:
        import yaml

        _atomic_text(Path(yaml_file), yaml.safe_dump(self.to_dict(), sort_keys=True))


@dataclass
class ClusterConfig(BaseConfig):
    """A config for this machine or a cluster of machines (`compute_environment: LOCAL_MACHINE`)."""

    num_processes: int = -1
    machine_rank: int = 0
    num_machines: int = 1
    gpu_ids: Optional[str] = None
    main_process_ip: Optional[str] = None
    main_process_port: Optional[int] = None
    rdzv_backend: Optional[str] = "static"
    same_network: Optional[bool] = False
    main_training_function: str = "main"
    enable_cpu_affinity: bool = False
    fp8_config: Optional[dict] = None
    deepspeed_config: Optional[dict] = None
    fsdp_config: Optional[dict] = None
    parallelism_config: Optional[dict] = None
    megatron_lm_config: Optional[dict] = None
    mpirun_config: Optional[dict] = None
    downcast_bf16: bool = False
    tpu_name: Optional[str] = None
    tpu_zone: Optional[str] = None
    tpu_use_cluster: bool = False
    tpu_use_sudo: bool = False
    command_file: Optional[str] = None
    commands: Optional[list] = None
    tpu_vm: Optional[list] = None
    tpu_env: Optional[list] = None
    dynamo_config: Optional[dict] = None

    def __post_init__(self) -> None:
        for name in ("fp8_config", "deepspeed_config", "fsdp_config", "parallelism_config", "megatron_lm_config",
                     "mpirun_config", "dynamo_config"):
            if getattr(self, name) is None:
                setattr(self, name, {})
        super().__post_init__()


@dataclass
class SageMakerConfig(BaseConfig):
    """An Amazon SageMaker config (`compute_environment: AMAZON_SAGEMAKER`): read and written, never launched by
    accel (which runs `accel launch` on the instances instead)."""

    ec2_instance_type: str
    iam_role_name: str
    image_uri: Optional[str] = None
    profile: Optional[str] = None
    region: str = "us-east-1"
    num_machines: int = 1
    gpu_ids: str = "all"
    base_job_name: str = "accelerate-sagemaker-1"
    pytorch_version: str = "1.10.2"
    transformers_version: str = "4.17.0"
    py_version: str = "py38"
    sagemaker_inputs_file: Optional[str] = None
    sagemaker_metrics_file: Optional[str] = None
    additional_args: Optional[dict] = None
    dynamo_config: Optional[dict] = None
    enable_cpu_affinity: bool = False


_BASE_DEFAULTS = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "NO", "mixed_precision": "no",
                  "use_cpu": False, "debug": False}


def _known(cls, raw: dict) -> dict:
    """The file's values for `cls`'s fields (the required base ones defaulted, as Accelerate's older files lack
    some)."""
    names = {f.name for f in dataclasses.fields(cls)}
    values = {k: v for k, v in raw.items() if k in names}
    for key, default in _BASE_DEFAULTS.items():
        values.setdefault(key, default)
    return values


def _atomic_text(path: Path, text: str) -> None:
    from accel.checkpoint.layout import atomic_write

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path.parent, path.name, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def config_from_accel(cfg) -> ClusterConfig:
    """accel's resolved config (AccelConfig) with Accelerate's field names."""
    dynamo = {"dynamo_backend": cfg.dynamo_backend.upper(), "dynamo_mode": cfg.dynamo_mode,
              "dynamo_use_fullgraph": cfg.dynamo_use_fullgraph, "dynamo_use_dynamic": cfg.dynamo_use_dynamic,
              "dynamo_use_regional_compilation": cfg.dynamo_use_regional_compilation}
    distributed_type = cfg.distributed_type
    if distributed_type is None:
        import torch

        distributed_type = cfg.resolved_distributed_type(cuda_available=torch.cuda.is_available())
    return ClusterConfig(
        compute_environment=cfg.compute_environment, distributed_type=distributed_type,
        mixed_precision=cfg.mixed_precision, use_cpu=cfg.use_cpu, debug=False, num_processes=cfg.num_processes,
        machine_rank=cfg.machine_rank, num_machines=cfg.num_machines, gpu_ids=cfg.gpu_ids,
        main_process_ip=cfg.main_process_ip, main_process_port=cfg.main_process_port, rdzv_backend=cfg.rdzv_backend,
        same_network=cfg.same_network, dynamo_config=dynamo if cfg.dynamo_backend != "no" else {})


def load_config_from_file(config_file: str | None = None) -> BaseConfig:
    """The config file (`default_config_file` when None) as Accelerate's dataclass; FileNotFoundError for a
    missing file, accel's ConfigError (a ValueError) for a key or value accel's reader refuses."""
    from accel.config import build_config, read_config_file
    from accel.config.yaml_file import load_yaml_file

    if config_file is not None and not os.path.isfile(config_file):
        raise FileNotFoundError(f"config file {config_file} not found; allowed: an existing YAML or JSON config file "
                                "(or none: the default one, written by `accel config`)")
    path = Path(config_file or default_config_file)
    raw = json.loads(path.read_text()) if path.suffix == ".json" else load_yaml_file(path)
    raw = raw if isinstance(raw, dict) else {}
    if str(raw.get("compute_environment", "LOCAL_MACHINE")) != "LOCAL_MACHINE":
        return SageMakerConfig(**_known(SageMakerConfig, raw))
    layer = read_config_file(path)  # accel's validation: unknown keys, bad values, Accelerate's sections translated
    config = config_from_accel(build_config([layer], str(path)))
    names = {f.name for f in dataclasses.fields(ClusterConfig)}
    for key, value in raw.items():  # the file's own Accelerate keys as written (its fsdp_config: section, ...)
        if key in names and value is not None:
            setattr(config, key, value)
    config.__post_init__()
    return config
