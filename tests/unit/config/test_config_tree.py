"""The config tree: validation messages, Accelerate-file import, and the precedence of layers."""

import json
from pathlib import Path

import pytest

from accel.config import (
    LAUNCH_ENV,
    PACKAGED_DEFAULT,
    AccelConfig,
    ConfigError,
    ParallelismConfig,
    encode_for_workers,
    read_config_file,
    resolve_config,
    worker_config,
)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv(LAUNCH_ENV, raising=False)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_packaged_default_is_the_root_default_and_matches_builtins():
    assert PACKAGED_DEFAULT.read_text() == (ROOT / "default_config.yaml").read_text()
    assert resolve_config() == AccelConfig()


@pytest.mark.parametrize("text,message", [
    ("num_proceses: 2\n", "unknown key 'num_proceses'; did you mean 'num_processes'?"),
    ("mixed_precision: fp32\n", "key 'mixed_precision': bad value 'fp32'; allowed: one of no, fp16, bf16, fp8"),
    ("num_processes: 0\n", "key 'num_processes': bad value 0; allowed: an integer >= 1"),
    ("num_processes: '2'\n", "key 'num_processes': bad value '2'; allowed: an integer >= 1"),
    ("use_cpu: maybe\n", "key 'use_cpu': bad value 'maybe'; allowed: true or false"),
    ("main_process_port: 70000\n", "key 'main_process_port': bad value 70000; allowed: an integer from 1 to 65535"),
    ("parallelism:\n  zero_stage: 4\n", "key 'parallelism.zero_stage': bad value 4; allowed: an integer from 0 to 3"),
    ("parallelism:\n  tp_sise: 2\n", "unknown key 'parallelism.tp_sise'; did you mean 'tp_size'?"),
    ("parallelism:\n  pp_schedule: zigzag\n", "allowed: one of GPipe, 1F1B, Interleaved1F1B"),
    ("distributed_type: TPU\n", "key 'distributed_type': bad value 'TPU'"),
    ("num_processes: 3\nnum_machines: 2\nmain_process_ip: 10.0.0.1\n", "key 'num_processes': 3 is not divisible by num_machines=2"),
    ("num_machines: 2\nnum_processes: 2\n", "key 'main_process_ip': required when num_machines=2"),
    ("num_machines: 2\nnum_processes: 2\nmachine_rank: 2\nmain_process_ip: x\n", "key 'machine_rank': 2 is out of range"),
    ("gpu_ids: zero\n", "key 'gpu_ids': bad value 'zero'"),
    ("- a\n- b\n", "expected a mapping"),
    ("a: [\n", "not valid YAML at line"),
])
def test_bad_files_name_file_key_value_and_allowed(tmp_path, text, message):
    path = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_every_unknown_key_is_named_at_once(tmp_path):
    path = write(tmp_path / "typos.yaml", "mixed_precison: fp16\nnum_processes: 2\nnum_procesess: 2\nparallelism:\n"
                                          "  zero_stag: 2\n  tp_sise: 1\ndynamo_config:\n  dynamo_bakend: eager\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    assert str(info.value) == (
        f"{path}: unknown keys 'mixed_precison' (did you mean 'mixed_precision'?), 'num_procesess' (did you mean "
        "'num_processes'?), 'parallelism.zero_stag' (did you mean 'zero_stage'?), 'parallelism.tp_sise' (did you mean "
        "'tp_size'?), 'dynamo_config.dynamo_bakend' (did you mean 'dynamo_backend'?)")


def test_unknown_keys_without_a_close_match_list_the_known_keys_once_per_section(tmp_path):
    path = write(tmp_path / "odd.yaml", "foo: 1\nbar: 2\nparallelism:\n  baz: 3\nmixed_precison: fp16\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(path)
    message = str(info.value)
    assert message.startswith(f"{path}: unknown keys 'foo', 'bar', 'parallelism.baz', 'mixed_precison' (did you mean "
                              "'mixed_precision'?); known keys: checkpoint_async, ")
    assert message.count("known keys:") == 1
    assert message.count("known parallelism keys: activation_checkpointing, ") == 1
    assert "\n" not in message


def test_a_bad_value_before_an_unknown_key_is_the_error_and_one_after_it_waits(tmp_path):
    """The first mistake in the file is named: a bad value before any unknown key is that error (as before); after an
    unknown key the layer is still read for more unknown keys, and the bad value is named once they are fixed."""
    first = write(tmp_path / "first.yaml", "num_processes: 0\nnum_procesess: 2\n")
    with pytest.raises(ConfigError, match="key 'num_processes': bad value 0"):
        resolve_config(first)
    later = write(tmp_path / "later.yaml", "num_procesess: 2\nnum_processes: 0\nfoo_bar: 1\n")
    with pytest.raises(ConfigError, match=r"keys 'num_procesess' \(did you mean 'num_processes'\?\), 'foo_bar'"):
        resolve_config(later)


def test_missing_named_file():
    with pytest.raises(ConfigError, match="nope.yaml: config file not found"):
        resolve_config("nope.yaml")


def test_precedence_defaults_packaged_user_flags_arguments(tmp_path, monkeypatch):
    home_cfg = write(tmp_path / "home" / ".cache" / "accel" / "default_config.yaml",
                     "mixed_precision: bf16\ngradient_accumulation_steps: 2\nnum_processes: 2\n")
    # user file beats the packaged default
    cfg = resolve_config()
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps, cfg.num_processes) == ("bf16", 2, 2)
    assert cfg.rdzv_backend == "static"  # untouched keys keep the packaged default
    # $ACCEL_CONFIG_FILE beats ~/.cache/accel/default_config.yaml
    env_cfg = write(tmp_path / "env.yaml", "mixed_precision: fp16\n")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(env_cfg))
    assert resolve_config().mixed_precision == "fp16"
    assert resolve_config().gradient_accumulation_steps == 1
    # --config_file beats $ACCEL_CONFIG_FILE
    assert resolve_config(home_cfg).mixed_precision == "bf16"
    # launch flags beat the file
    cfg = resolve_config(home_cfg, {"mixed_precision": "no", "parallelism": {"zero_stage": 1}})
    assert cfg.mixed_precision == "no" and cfg.parallelism.zero_stage == 1 and cfg.num_processes == 2
    # flags errors name the flags
    with pytest.raises(ConfigError, match="accel launch flags: key 'mixed_precision'"):
        resolve_config(home_cfg, {"mixed_precision": "fp64"})
    # workers read the launched config, then Accelerator arguments win over it
    monkeypatch.setenv(LAUNCH_ENV, encode_for_workers(cfg))
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(write(tmp_path / "ignored.yaml", "mixed_precision: fp16\n")))
    assert worker_config().mixed_precision == "no"
    assert worker_config({"mixed_precision": "bf16"}).mixed_precision == "bf16"
    assert worker_config().parallelism.zero_stage == 1


def test_launch_channel_is_one_json_variable(monkeypatch):
    cfg = AccelConfig(num_processes=4, parallelism=ParallelismConfig(tp_size=2))
    encoded = encode_for_workers(cfg)
    assert json.loads(encoded)["parallelism"]["tp_size"] == 2
    monkeypatch.setenv(LAUNCH_ENV, encoded)
    assert worker_config() == cfg
    monkeypatch.setenv(LAUNCH_ENV, "{not json")
    with pytest.raises(ConfigError, match="ACCEL_LAUNCH_CONFIG: not valid JSON"):
        worker_config()


def test_save_and_load_round_trip(tmp_path):
    cfg = AccelConfig(num_processes=2, use_cpu=True, mixed_precision="bf16",
                      parallelism=ParallelismConfig(zero_stage=3, offload_optimizer=True, pp_microbatches=4))
    path = cfg.save(tmp_path / "sub" / "cfg.yaml")
    assert resolve_config(path) == cfg
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_derived_distributed_type():
    assert AccelConfig().resolved_distributed_type(cuda_available=True) == "NO"
    assert AccelConfig(num_processes=2).resolved_distributed_type(cuda_available=True) == "MULTI_GPU"
    assert AccelConfig(num_processes=2).resolved_distributed_type(cuda_available=False) == "MULTI_CPU"
    assert AccelConfig(num_processes=2, use_cpu=True).resolved_distributed_type(cuda_available=True) == "MULTI_CPU"


ACCELERATE_FSDP = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: true
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_use_orig_params: true
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""

ACCELERATE_DEEPSPEED = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 4
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
use_cpu: false
"""

ACCELERATE_MULTI_GPU = """\
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_GPU
downcast_bf16: 'no'
gpu_ids: 0,1
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
parallelism_config:
  parallelism_config_tp_size: 2
  parallelism_config_dp_replicate_size: 1
"""


def test_accelerate_config_files_load(tmp_path):
    fsdp = resolve_config(write(tmp_path / "fsdp.yaml", ACCELERATE_FSDP))
    assert fsdp.parallelism.zero_stage == 2 and fsdp.parallelism.offload_params and fsdp.parallelism.offload_optimizer
    assert fsdp.mixed_precision == "bf16" and fsdp.num_processes == 2 and fsdp.distributed_type is None

    ds = resolve_config(write(tmp_path / "ds.yaml", ACCELERATE_DEEPSPEED))
    assert ds.parallelism.zero_stage == 3 and ds.parallelism.offload_optimizer and not ds.parallelism.offload_params
    assert ds.gradient_accumulation_steps == 4 and ds.mixed_precision == "fp16"

    ddp = resolve_config(write(tmp_path / "ddp.yaml", ACCELERATE_MULTI_GPU))
    assert ddp.distributed_type == "MULTI_GPU" and ddp.gpu_ids == "0,1" and ddp.parallelism.tp_size == 2


def test_accelerate_sections_are_validated(tmp_path):
    path = write(tmp_path / "ds.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 5\n")
    with pytest.raises(ConfigError, match=r"ds.yaml: key 'deepspeed_config.zero_stage': bad value 5"):
        resolve_config(path)
    path = write(tmp_path / "fsdp.yaml", "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HALF\n")
    with pytest.raises(ConfigError, match="fsdp_sharding_strategy': bad value 'HALF'"):
        resolve_config(path)


def test_read_config_file_returns_only_given_keys(tmp_path):
    layer = read_config_file(write(tmp_path / "c.yaml", "num_processes: 4\nparallelism:\n  tp_size: 2\n"))
    assert layer == {"num_processes": 4, "parallelism": {"tp_size": 2}}


def test_a_failed_save_leaves_no_temporary_file(tmp_path):
    from accel.config import config_from_dict

    (tmp_path / "cfg.yaml").mkdir()  # the rename onto a folder fails
    with pytest.raises(OSError):
        config_from_dict({}).save(tmp_path / "cfg.yaml")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cfg.yaml"]
