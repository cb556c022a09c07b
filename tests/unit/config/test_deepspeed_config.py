"""DeepSpeed JSON files (flag, config-file keys) and Accelerate's DeepSpeed/FSDP plugins, onto the config tree."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import pytest

from accel import Accelerator
from accel.cli import launch
from accel.cli.main import build_parser, main
from accel.config import (
    LAUNCH_ENV,
    AccelConfig,
    ConfigError,
    config_from_dict,
    DeepSpeedConfigWarning,
    ParallelismConfig,
    read_deepspeed_config,
    resolve_config,
)
from accel.config.plugins import DeepSpeedPlugin, FullyShardedDataParallelPlugin, apply_plugins

TYPICAL = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 2000,
    "wall_clock_breakdown": False,
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": "auto",
        "stage3_gather_16bit_weights_on_model_save": True,
    },
}
TYPICAL_IGNORED = {  # optimizer/scheduler are not: the JSON reaches prepare() (DummyOptim/DummyScheduler)
    "steps_per_print", "wall_clock_breakdown", "fp16.loss_scale", "fp16.initial_scale_power",
    "zero_optimization.offload_optimizer.pin_memory", "zero_optimization.overlap_comm",
    "zero_optimization.contiguous_gradients", "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save",
}


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ACCEL_CONFIG_FILE", raising=False)
    monkeypatch.delenv(LAUNCH_ENV, raising=False)


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else json.dumps(content, indent=2))
    return path


def ds_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, DeepSpeedConfigWarning)]


def ignored_keys(message: str) -> set[str]:
    listed = message.split("ignored: ", 1)[1].split(";", 1)[0]
    return {key.strip() for key in listed.split(",")}


def assert_typical(cfg: AccelConfig) -> None:
    par = cfg.parallelism
    assert (par.zero_stage, par.offload_optimizer, par.offload_params) == (3, True, False)
    assert (cfg.gradient_accumulation_steps, cfg.mixed_precision) == (4, "fp16")
    assert (par.micro_batch_size, par.train_batch_size, par.gradient_clipping) == (8, None, 1.0)
    assert isinstance(par.gradient_clipping, float)


# ----------------------------------------------------------------------------------------------------------
# the JSON onto the tree
# ----------------------------------------------------------------------------------------------------------

def test_typical_json_resolves_to_the_tree_with_one_warning_listing_the_ignored_keys(tmp_path):
    path = write(tmp_path / "ds.json", TYPICAL)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = resolve_config(overrides={"deepspeed_config_file": str(path)})
    assert_typical(cfg)
    messages = ds_warnings(record)
    assert len(messages) == 1
    assert "\n" not in messages[0] and messages[0].startswith(f"{path}: ")
    assert ignored_keys(messages[0]) == TYPICAL_IGNORED
    assert "your script creates" not in messages[0]  # optimizer/scheduler are carried to prepare(): not ignored
    assert cfg.deepspeed_json == TYPICAL and cfg.deepspeed_json_path == str(path)  # the JSON itself, for the workers
    # the layer holds only what the file says
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        layer = read_deepspeed_config(path)
    assert "your script creates" in ds_warnings(record)[0]  # not carried: optimizer/scheduler named, with why
    assert layer == {"gradient_accumulation_steps": 4, "mixed_precision": "fp16",
                     "parallelism": {"zero_stage": 3, "offload_optimizer": True, "offload_params": False,
                                     "micro_batch_size": 8, "gradient_clipping": 1.0}}


def test_no_warning_when_every_key_is_used(tmp_path):
    path = write(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        cfg = resolve_config(overrides={"deepspeed_config_file": str(path)})
    assert (cfg.parallelism.zero_stage, cfg.mixed_precision) == (2, "bf16")


def test_auto_values_leave_the_setting_to_the_other_layers(tmp_path):
    user = write(tmp_path / "c.yaml", "mixed_precision: bf16\ngradient_accumulation_steps: 2\n"
                                      "parallelism:\n  zero_stage: 2\n  offload_params: true\n")
    auto = write(tmp_path / "auto.json", {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "fp16": {"enabled": "auto"}, "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "auto"},
                              "offload_param": {"device": "auto"}},
    })
    assert read_deepspeed_config(auto) == {}
    cfg = resolve_config(user, {"deepspeed_config_file": str(auto)})
    assert (cfg.mixed_precision, cfg.gradient_accumulation_steps) == ("bf16", 2)
    assert (cfg.parallelism.zero_stage, cfg.parallelism.offload_params) == (2, True)
    assert cfg.parallelism.gradient_clipping is None and cfg.parallelism.micro_batch_size is None
    # without "auto" the JSON wins over the config file, and what it leaves out stays the file's
    given = write(tmp_path / "given.json", {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 8})
    cfg = resolve_config(user, {"deepspeed_config_file": str(given)})
    assert (cfg.parallelism.zero_stage, cfg.gradient_accumulation_steps, cfg.mixed_precision) == (3, 8, "bf16")
    assert cfg.parallelism.offload_params is True


def test_false_enabled_and_legacy_spellings(tmp_path):
    # enabled: false says "not this one", not "no mixed precision": the other layers decide
    assert read_deepspeed_config(write(tmp_path / "a.json", {"fp16": {"enabled": False}})) == {}
    layer = read_deepspeed_config(write(tmp_path / "b.json", {"bfloat16": {"enabled": True},
                                                              "zero_optimization": {"cpu_offload": True}}))
    assert layer == {"mixed_precision": "bf16", "parallelism": {"offload_optimizer": True}}


# ----------------------------------------------------------------------------------------------------------
# accel launch --deepspeed_config_file
# ----------------------------------------------------------------------------------------------------------

def parse(*argv: str):
    return build_parser().parse_args(["launch", *argv])


def test_flag_is_a_layer_above_the_config_file_and_below_the_other_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ds.json", TYPICAL)
    cfg_file = write(tmp_path / "c.yaml", "num_processes: 2\nmixed_precision: 'no'\ngradient_accumulation_steps: 8\n"
                                          "parallelism:\n  zero_stage: 1\n")
    args = parse("--config_file", str(cfg_file), "--deepspeed_config_file", "ds.json", "--mixed_precision", "bf16",
                 "--cpu", "train.py", "--deepspeed_config_file", "other.json")
    assert args.script_args == ["--deepspeed_config_file", "other.json"]  # the script's own arguments
    overrides = launch.flag_overrides(args)
    assert overrides["deepspeed_config_file"] == "ds.json"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = launch.resolve_launch_config(args.config_file, overrides)
    assert len(ds_warnings(record)) == 1
    assert cfg.mixed_precision == "bf16"                                  # the flag beats the JSON
    assert (cfg.parallelism.zero_stage, cfg.gradient_accumulation_steps) == (3, 4)  # the JSON beats the file
    assert (cfg.num_processes, cfg.use_cpu) == (2, True)                   # untouched keys: file and flags
    # what the workers get is the resolved tree, not the file: they never read the JSON again
    launched = config_from_dict(json.loads(launch.worker_env(cfg)[LAUNCH_ENV]))
    assert launched == cfg and launched.parallelism.gradient_clipping == 1.0
    assert launch.build_torchrun_args(cfg, ["train.py"])[-1] == "train.py"


def test_flag_through_the_command_line_warns_once_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write(tmp_path / "ds.json", TYPICAL)
    script = write(tmp_path / "train.py", "pass\n")
    launched = []
    monkeypatch.setattr(launch, "_exec_single", lambda cfg, argv: launched.append((cfg, argv)) or 0)
    assert main(["launch", "--cpu", "--deepspeed_config_file", "ds.json", str(script)]) == 0
    (cfg, argv), = launched
    assert_typical(cfg)
    assert argv == [str(script)]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0].startswith("accel launch: warning: ds.json: ")
    assert err[1].startswith("accel launch: 1 process (NO), ZeRO-3 (FSDP2), CPU offload, ")  # the start line
    assert ignored_keys(err[0]) == TYPICAL_IGNORED


def test_flag_errors_are_one_line_with_exit_code_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    script = write(tmp_path / "train.py", "pass\n")
    write(tmp_path / "bad.json", '{"zero_optimization": {"stage": 3,}}')
    monkeypatch.setattr(launch, "_exec_single", lambda cfg, argv: pytest.fail("must not launch"))
    assert main(["launch", "--cpu", "--deepspeed_config_file", "bad.json", str(script)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("accel launch: error: bad.json: not valid JSON at line 1 column 35")
    assert main(["launch", "--cpu", "--deepspeed_config_file", "missing.json", str(script)]) == 2
    err = capsys.readouterr().err
    assert err == ("accel launch: error: accel launch flags: key 'deepspeed_config_file': missing.json: DeepSpeed "
                   "config file not found\n")


# ----------------------------------------------------------------------------------------------------------
# deepspeed_config_file in config files
# ----------------------------------------------------------------------------------------------------------

ACCELERATE_DS_FILE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: ../ds_templates/zero3.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


def test_accelerate_yaml_section_with_a_path_relative_to_the_yaml(tmp_path, monkeypatch):
    write(tmp_path / "ds_templates" / "zero3.json", TYPICAL)
    yaml_path = write(tmp_path / "configs" / "accelerate.yaml", ACCELERATE_DS_FILE)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the path is the YAML's, not the current directory's
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = resolve_config(yaml_path)
    assert_typical(cfg)
    assert cfg.num_processes == 2
    messages = ds_warnings(record)
    assert len(messages) == 1 and messages[0].startswith(str(tmp_path / "ds_templates" / "zero3.json"))
    # the same through accel launch (the files are read once: still one warning)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert launch.resolve_launch_config(str(yaml_path), {"use_cpu": True}) == AccelConfig(
            **{**cfg.to_dict(), "use_cpu": True})
    assert len(ds_warnings(record)) == 1


def test_top_level_key_and_precedence_within_the_file(tmp_path):
    write(tmp_path / "ds.json", {"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto"},
                                 "gradient_accumulation_steps": 4})
    cfg = resolve_config(write(tmp_path / "c.yaml", "deepspeed_config_file: ds.json\nmixed_precision: bf16\n"
                                                    "gradient_accumulation_steps: 2\nparallelism:\n  zero_stage: 1\n"))
    # "auto" leaves mixed precision to the file; stage and accumulation given in the JSON win
    assert (cfg.mixed_precision, cfg.parallelism.zero_stage, cfg.gradient_accumulation_steps) == ("bf16", 2, 4)
    # a JSON without a stage keeps the file's, and DEEPSPEED's default stage 2 is not forced on it
    write(tmp_path / "nostage.json", {"gradient_clipping": 0.5})
    cfg = resolve_config(write(tmp_path / "d.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                    "  deepspeed_config_file: nostage.json\n"))
    assert (cfg.parallelism.zero_stage, cfg.parallelism.gradient_clipping) == (0, 0.5)
    # Accelerate's "none" answer means no file
    cfg = resolve_config(write(tmp_path / "e.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                    "  deepspeed_config_file: none\n  zero_stage: 1\n"))
    assert cfg.parallelism.zero_stage == 1


def test_accelerate_section_gradient_clipping_and_float_fields(tmp_path):
    cfg = resolve_config(write(tmp_path / "a.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                                    "  zero_stage: 2\n  gradient_clipping: 1\n"))
    assert cfg.parallelism.gradient_clipping == 1.0 and isinstance(cfg.parallelism.gradient_clipping, float)
    par = ParallelismConfig(gradient_clipping=0.25, micro_batch_size=4)
    assert resolve_config(AccelConfig(parallelism=par).save(tmp_path / "s.yaml")).parallelism == par
    for bad, allowed in (("-1", "a number >= 0 (or null)"), ("'1.0'", "a number >= 0"), (".nan", "a number")):
        with pytest.raises(ConfigError, match=r"key 'parallelism.gradient_clipping': bad value .*allowed: "
                           + re.escape(allowed)):
            resolve_config(write(tmp_path / "bad.yaml", f"parallelism:\n  gradient_clipping: {bad}\n"))
    with pytest.raises(ConfigError, match="key 'gradient_clipping': bad value True"):
        ParallelismConfig(gradient_clipping=True)


# ----------------------------------------------------------------------------------------------------------
# errors: one line naming the file, the key, the value and what is allowed
# ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("content,message", [
    ('{"zero_optimization": {"stage": 3', "not valid JSON at line 1 column"),
    ('{"a": 1, "a": 2}', "key 'a' appears twice"),
    ('[{"zero_optimization": {"stage": 3}}]', "expected a JSON object of DeepSpeed keys at the top level, got list"),
    ({"zero_optimization": {"stage": 5}},
     "key 'zero_optimization.stage': bad value 5; allowed: an integer from 0 to 3 or \"auto\""),
    ({"zero_optimization": {"stage": "3"}}, "key 'zero_optimization.stage': bad value '3'"),
    ({"zero_optimization": {"offload_param": {"device": "nvme", "nvme_path": "/nvme"}}},
     "key 'zero_optimization.offload_param.device': 'nvme' offload is not supported by accel; allowed: none, cpu"),
    ({"zero_optimization": {"offload_optimizer": {"device": "NVMe"}}},
     "key 'zero_optimization.offload_optimizer.device': 'nvme' offload is not supported"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "key 'zero_optimization.offload_optimizer.device': bad value 'gpu'; allowed: none, cpu, nvme"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}},
     "keys 'fp16.enabled' and 'bf16.enabled' are both true; allowed: at most one"),
    ({"fp16": {"enabled": "yes"}}, "key 'fp16.enabled': bad value 'yes'; allowed: true, false or \"auto\""),
    ({"fp16": True}, "key 'fp16': expected a JSON object, got True"),
    ({"zero_optimization": 3}, "key 'zero_optimization': expected a JSON object, got 3"),
    ({"gradient_accumulation_steps": 0}, "key 'gradient_accumulation_steps': bad value 0; allowed: an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "key 'train_micro_batch_size_per_gpu': bad value 2.5"),
    ({"gradient_clipping": -1.0}, "key 'gradient_clipping': bad value -1.0; allowed: a number >= 0 or \"auto\""),
])
def test_bad_json_files_are_one_line_errors_naming_the_file(tmp_path, content, message):
    path = write(tmp_path / "ds.json", content)
    for resolve in (lambda: resolve_config(overrides={"deepspeed_config_file": str(path)}),
                    lambda: resolve_config(write(tmp_path / "c.yaml", "deepspeed_config_file: ds.json\n"))):
        with pytest.raises(ConfigError) as info:
            resolve()
        text = str(info.value)
        assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_missing_json_named_in_a_yaml_names_the_yaml_and_its_key(tmp_path):
    yaml_path = write(tmp_path / "c.yaml", "distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                           "  deepspeed_config_file: nope.json\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(yaml_path)
    assert str(info.value) == (f"{yaml_path}: key 'deepspeed_config.deepspeed_config_file': {tmp_path / 'nope.json'}: "
                               "DeepSpeed config file not found")
    both = write(tmp_path / "d.yaml",
                 "deepspeed_config_file: a.json\ndeepspeed_config:\n  deepspeed_config_file: b.json\n")
    with pytest.raises(ConfigError, match="'deepspeed_config_file' and 'deepspeed_config.deepspeed_config_file' both"):
        resolve_config(both)
    with pytest.raises(ConfigError, match="key 'deepspeed_config_file': bad value 3; allowed: the path"):
        resolve_config(write(tmp_path / "e.yaml", "deepspeed_config_file: 3\n"))


# ----------------------------------------------------------------------------------------------------------
# plugins
# ----------------------------------------------------------------------------------------------------------

def test_deepspeed_plugin_from_a_file_a_dict_or_arguments(tmp_path):
    path = write(tmp_path / "ds.json", TYPICAL)
    with pytest.warns(DeepSpeedConfigWarning, match="optimizer"):
        from_file = DeepSpeedPlugin(hf_ds_config=str(path), zero3_init_flag=True, zero3_save_16bit_model=True)
    expected = {"gradient_accumulation_steps": 4, "mixed_precision": "fp16",
                "parallelism": {"zero_stage": 3, "offload_optimizer": True, "offload_params": False,
                                "micro_batch_size": 8, "gradient_clipping": 1.0}}
    assert from_file.to_layer() == expected
    assert from_file.deepspeed_config["zero_optimization"]["stage"] == 3  # the JSON stays readable
    with pytest.warns(DeepSpeedConfigWarning):
        assert DeepSpeedPlugin(hf_ds_config=TYPICAL, gradient_accumulation_steps=4).to_layer() == expected
    plugin = DeepSpeedPlugin(zero_stage=2, offload_optimizer_device="cpu", offload_param_device="none",
                             gradient_accumulation_steps=2, gradient_clipping=1)
    assert plugin.to_layer() == {"gradient_accumulation_steps": 2, "parallelism": {
        "zero_stage": 2, "offload_optimizer": True, "offload_params": False, "gradient_clipping": 1.0}}
    # "auto" arguments defer, like "auto" in the file
    assert DeepSpeedPlugin(zero_stage=1, gradient_accumulation_steps="auto").to_layer() == {
        "parallelism": {"zero_stage": 1}}


def test_deepspeed_plugin_without_a_stage_means_stage_2_unless_the_config_asks_for_zero():
    assert DeepSpeedPlugin().to_layer() == {"parallelism": {"zero_stage": 2}}
    assert DeepSpeedPlugin().to_layer(AccelConfig()) == {"parallelism": {"zero_stage": 2}}
    assert DeepSpeedPlugin().to_layer(AccelConfig(parallelism=ParallelismConfig(zero_stage=3))) == {}
    # a DeepSpeed config without a stage is DeepSpeed's business (stage 0 by default): nothing is forced
    assert DeepSpeedPlugin(hf_ds_config={"gradient_clipping": 0.5}).to_layer() == {
        "parallelism": {"gradient_clipping": 0.5}}


@pytest.mark.parametrize("kwargs,message", [
    (dict(zero_stage=4), "DeepSpeedPlugin: argument 'zero_stage': bad value 4; allowed: an integer from 0 to 3"),
    (dict(gradient_clipping=-1), "argument 'gradient_clipping': bad value -1; allowed: a number >= 0"),
    (dict(offload_optimizer_device="nvme"), "argument 'offload_optimizer_device': 'nvme' offload is not supported"),
    (dict(offload_param_device="disk"), "argument 'offload_param_device': bad value 'disk'; allowed: none, cpu"),
    (dict(offload_param_nvme_path="/nvme"), "argument 'offload_param_nvme_path': '/nvme' is not supported by accel"),
    (dict(enable_msamp=True), "argument 'enable_msamp': True is not supported by accel"),
    (dict(transformer_moe_cls_names="MixtralSparseMoeBlock"), "argument 'transformer_moe_cls_names'"),
    (dict(hf_ds_config=3), "argument 'hf_ds_config': bad value of type int"),
    (dict(hf_ds_config="missing.json"),
     "DeepSpeedPlugin: argument 'hf_ds_config': missing.json: DeepSpeed config file not found"),
    (dict(hf_ds_config={"zero_optimization": {"stage": 3}}, zero_stage=2),
     "argument 'zero_stage' gives zero_stage=2 but DeepSpeedPlugin(hf_ds_config=...) gives 3"),
    (dict(hf_ds_config={"zero_optimization": {"stage": 9}}),
     "DeepSpeedPlugin(hf_ds_config=...): key 'zero_optimization.stage': bad value 9"),
])
def test_deepspeed_plugin_errors_name_the_argument(kwargs, message):
    with pytest.raises(ConfigError) as info:
        DeepSpeedPlugin(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_deepspeed_plugin_agreeing_arguments_and_unknown_names():
    plugin = DeepSpeedPlugin(hf_ds_config={"zero_optimization": {"stage": 3}}, zero_stage=3, enable_msamp=False)
    assert plugin.to_layer() == {"parallelism": {"zero_stage": 3}}
    with pytest.raises(TypeError, match="zero_stag"):
        DeepSpeedPlugin(zero_stag=3)


class ShardingStrategy:  # stands in for torch.distributed.fsdp.ShardingStrategy (an enum with .name)
    def __init__(self, name: str) -> None:
        self.name = name


@pytest.mark.parametrize("strategy,stage", [
    ("FULL_SHARD", 3), ("shard_grad_op", 2), ("NO_SHARD", 0), ("HYBRID_SHARD", 3), ("HYBRID_SHARD_ZERO2", 2),
    (1, 3), (2, 2), (3, 0), (4, 3), ("5", 2),
    (ShardingStrategy("FULL_SHARD"), 3), (ShardingStrategy("_HYBRID_SHARD_ZERO2"), 2),
    (ShardingStrategy("NO_SHARD"), 0),
])
def test_fsdp_plugin_sharding_strategies_map_to_zero_stages(strategy, stage):
    layer = FullyShardedDataParallelPlugin(sharding_strategy=strategy).to_layer()
    assert layer == {"parallelism": {"zero_stage": stage}}


def test_fsdp_plugin_with_torch_enums_reshard_and_offload():
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    plugin = FullyShardedDataParallelPlugin(sharding_strategy=fsdp.ShardingStrategy.SHARD_GRAD_OP,
                                            cpu_offload=fsdp.CPUOffload(offload_params=True), fsdp_version=1,
                                            auto_wrap_policy="TRANSFORMER_BASED_WRAP", use_orig_params=True,
                                            activation_checkpointing=False)
    assert plugin.to_layer() == {"parallelism": {"zero_stage": 2, "offload_params": True, "offload_optimizer": True}}
    assert FullyShardedDataParallelPlugin(reshard_after_forward=False, fsdp_version=2).to_layer() == {
        "parallelism": {"zero_stage": 2}}
    assert FullyShardedDataParallelPlugin(reshard_after_forward="NO_SHARD").to_layer() == {
        "parallelism": {"zero_stage": 0}}
    assert FullyShardedDataParallelPlugin(cpu_offload=False).to_layer() == {
        "parallelism": {"offload_params": False, "offload_optimizer": False, "zero_stage": 3}}
    if hasattr(fsdp, "CPUOffloadPolicy"):
        assert FullyShardedDataParallelPlugin(cpu_offload=fsdp.CPUOffloadPolicy()).to_layer()["parallelism"][
            "offload_params"] is True
    assert FullyShardedDataParallelPlugin(activation_checkpointing=True).to_layer() == {
        "parallelism": {"activation_checkpointing": "full", "zero_stage": 3}}
    # no strategy: FULL_SHARD, unless the config already asks for a stage
    assert FullyShardedDataParallelPlugin().to_layer() == {"parallelism": {"zero_stage": 3}}
    assert FullyShardedDataParallelPlugin().to_layer(AccelConfig(parallelism=ParallelismConfig(zero_stage=2))) == {}


@pytest.mark.parametrize("kwargs,message", [
    (dict(sharding_strategy="HALF_SHARD"), "argument 'sharding_strategy': bad value 'HALF_SHARD'; allowed: FULL_SHARD"),
    (dict(sharding_strategy=9), "argument 'sharding_strategy': bad value 9"),
    (dict(sharding_strategy="NO_SHARD", reshard_after_forward=True), "'sharding_strategy' ('NO_SHARD') and "
                                                                     "'reshard_after_forward' (True) disagree"),
    (dict(cpu_offload="yes"), "argument 'cpu_offload': bad value 'yes'"),
    (dict(fsdp_version=3), "argument 'fsdp_version': bad value 3; allowed: 1 or 2"),
    (dict(mixed_precision_policy={"param_dtype": "bf16"}), "argument 'mixed_precision_policy'"),
    (dict(activation_checkpointing="always"), "argument 'activation_checkpointing': bad value 'always'"),
    (dict(param_init_fn=print), "argument 'param_init_fn'"),
])
def test_fsdp_plugin_errors_name_the_argument(kwargs, message):
    with pytest.raises(ConfigError) as info:
        FullyShardedDataParallelPlugin(**kwargs)
    assert str(info.value).startswith("FullyShardedDataParallelPlugin: ") and message in str(info.value)


def test_apply_plugins_gives_the_plugin_accelerator_argument_precedence(tmp_path, monkeypatch):
    # plain Accelerator arguments beat the plugin; the plugin's parallelism beats parallelism_config's
    args = {"mixed_precision": "bf16", "parallelism": ParallelismConfig(tp_size=2).__dict__.copy()}
    plugin = DeepSpeedPlugin(hf_ds_config={"fp16": {"enabled": True}, "zero_optimization": {"stage": 3}})
    layer = apply_plugins(args, deepspeed_plugin=plugin)
    assert layer["mixed_precision"] == "bf16"
    assert (layer["parallelism"]["zero_stage"], layer["parallelism"]["tp_size"]) == (3, 2)
    assert apply_plugins({"cpu": True}) == {"cpu": True}
    # the stage default looks at the files (or the launched config) only when the plugin names no stage
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(write(tmp_path / "c.yaml", "parallelism:\n  zero_stage: 1\n")))
    assert apply_plugins({}, fsdp_plugin=FullyShardedDataParallelPlugin()) == {}
    assert apply_plugins({}, fsdp_plugin=FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD")) == {
        "parallelism": {"zero_stage": 3}}
    with pytest.raises(ConfigError, match="both given"):
        apply_plugins({}, DeepSpeedPlugin(zero_stage=2), FullyShardedDataParallelPlugin())
    with pytest.raises(ConfigError, match="a dict of several plugins"):
        apply_plugins({}, deepspeed_plugin={"a": DeepSpeedPlugin(), "b": DeepSpeedPlugin()})
    with pytest.raises(ConfigError, match="expected accel.DeepSpeedPlugin"):
        apply_plugins({}, fsdp_plugin="FULL_SHARD")


def test_plugins_are_exported_under_accelerates_names():
    import accel
    import accel.utils

    assert accel.DeepSpeedPlugin is DeepSpeedPlugin and accel.utils.DeepSpeedPlugin is DeepSpeedPlugin
    assert accel.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin
    assert accel.utils.FullyShardedDataParallelPlugin is FullyShardedDataParallelPlugin


def test_activation_checkpointing_from_every_source(tmp_path):
    """Accelerate's FSDP `fsdp_activation_checkpointing: true`, a DeepSpeed JSON's `activation_checkpointing`
    section and the launch flag all set `parallelism.activation_checkpointing`."""
    yaml_file = write(tmp_path / "fsdp.yaml", "fsdp_config:\n  fsdp_activation_checkpointing: true\n")
    assert resolve_config(yaml_file).parallelism.activation_checkpointing == "full"
    ds = {"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False}}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = resolve_config(write(tmp_path / "c.yaml", f"deepspeed_config_file: {write(tmp_path / 'ds.json', ds)}\n"))
    assert cfg.parallelism.activation_checkpointing == "full"
    assert {"activation_checkpointing.partition_activations", "activation_checkpointing.cpu_checkpointing"} <= \
        ignored_keys(ds_warnings(record)[0])
    args = parse("--activation_checkpointing", "selective", "train.py")
    cfg = launch.resolve_launch_config(None, launch.flag_overrides(args))
    assert cfg.parallelism.activation_checkpointing == "selective"


# ----------------------------------------------------------------------------------------------------------
# the JSON carried to the Accelerator: Accelerate's automatic DeepSpeedPlugin, DummyOptim / DummyScheduler
# ----------------------------------------------------------------------------------------------------------

DUMMY_JSON = {
    "train_micro_batch_size_per_gpu": "auto",
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.99]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
}


def assert_exposes_and_builds(accelerator, expected: dict) -> None:
    """`deepspeed_plugin.deepspeed_config` is the JSON, and DummyOptim/DummyScheduler build its sections."""
    import torch

    from accel.utils import DummyOptim, DummyScheduler

    plugin = accelerator.deepspeed_plugin
    assert isinstance(plugin, DeepSpeedPlugin) and accelerator.state.deepspeed_plugin is plugin
    assert plugin.deepspeed_config == expected and "optimizer" in plugin.deepspeed_config  # what HF Trainer reads
    model = torch.nn.Linear(3, 1)
    dummy = DummyOptim(model.parameters(), lr=0.05, weight_decay=0.01)
    _, optimizer, scheduler = accelerator.prepare(model, dummy, DummyScheduler(dummy, total_num_steps=8,
                                                                               warmup_num_steps=3))
    built = optimizer.optimizer
    assert type(built) is torch.optim.AdamW
    assert (built.defaults["lr"], built.defaults["weight_decay"], built.defaults["betas"]) == (0.05, 0.01, (0.9, 0.99))
    schedule = scheduler.scheduler
    assert type(schedule).__name__ == "WarmupDecayLR"
    assert (schedule.total_num_steps, schedule.warmup_num_steps, schedule.max_lrs) == (8, 3, [0.05])


def test_config_files_json_becomes_the_accelerators_deepspeed_plugin(tmp_path, monkeypatch):
    """Accelerate's yaml `deepspeed_config: {deepspeed_config_file: ...}`, read by the Accelerator itself."""
    ds_json = write(tmp_path / "ds.json", DUMMY_JSON)
    yaml_text = "use_cpu: true\ndistributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(write(tmp_path / "c.yaml", yaml_text)))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        accelerator = Accelerator()
    messages = ds_warnings(record)
    assert len(messages) == 1 and ignored_keys(messages[0]) == {"zero_optimization.overlap_comm"}  # read once
    assert accelerator.config.parallelism.zero_stage == 2 and accelerator.config.deepspeed_json_path == str(ds_json)
    assert_exposes_and_builds(accelerator, DUMMY_JSON)
    # Accelerate's usage errors name the file the JSON came from
    import torch

    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match=f"in the code at the same time: {re.escape(str(ds_json))} has an 'optimizer'"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_launched_json_reaches_the_workers_and_launch_flags_still_win(tmp_path, monkeypatch):
    """`accel launch --deepspeed_config_file ds.json --zero_stage 3`, with the worker's environment as the launcher
    sets it: the JSON travels in ACCEL_LAUNCH_CONFIG (the file is not read again) and the flag beats its stage 2."""
    monkeypatch.chdir(tmp_path)
    ds_json = write(tmp_path / "ds.json", DUMMY_JSON)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        cfg = launch.resolve_launch_config(None, launch.flag_overrides(parse(
            "--cpu", "--deepspeed_config_file", "ds.json", "--zero_stage", "3", "train.py")))
    monkeypatch.setenv(LAUNCH_ENV, launch.worker_env(cfg)[LAUNCH_ENV])
    ds_json.unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeepSpeedConfigWarning)  # reported by the launcher, not again per worker
        accelerator = Accelerator()
    assert accelerator.config.parallelism.zero_stage == 3  # the flag, over the JSON's stage 2
    assert accelerator.config.deepspeed_json_path == "ds.json"
    assert_exposes_and_builds(accelerator, DUMMY_JSON)
    assert accelerator.config.parallelism.zero_stage == 3  # the plugin's own layer (stage 2) was not applied


def test_a_later_layers_json_replaces_an_earlier_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.5, "optimizer": {"type": "SGD"}}
    write(tmp_path / "first.json", first)
    write(tmp_path / "second.json", DUMMY_JSON)
    cfg_file = write(tmp_path / "c.yaml", "deepspeed_config_file: first.json\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        from_file = resolve_config(cfg_file)
        both = resolve_config(cfg_file, {"deepspeed_config_file": "second.json"})
        flags_only = resolve_config(cfg_file, {"mixed_precision": "bf16"})
    assert (from_file.deepspeed_json, from_file.deepspeed_json_path) == (first, str(tmp_path / "first.json"))
    assert (both.deepspeed_json, both.deepspeed_json_path) == (DUMMY_JSON, "second.json")  # replaced, not merged
    assert (both.parallelism.zero_stage, both.parallelism.gradient_clipping) == (2, 0.5)  # typed keys: key by key
    assert flags_only.deepspeed_json == first  # a layer without a JSON keeps the earlier one
    assert resolve_config().deepspeed_json is None  # no JSON anywhere


def test_plugin_arguments_win_over_the_carried_json(tmp_path, monkeypatch):
    write(tmp_path / "ds.json", DUMMY_JSON)
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(write(tmp_path / "c.yaml", "use_cpu: true\n"
                                                                          "deepspeed_config_file: ds.json\n")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeepSpeedConfigWarning)
        own = DeepSpeedPlugin(zero_stage=1)
        assert Accelerator(deepspeed_plugin=own).deepspeed_plugin is own
        assert Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()).deepspeed_plugin is None
    monkeypatch.delenv("ACCEL_CONFIG_FILE")
    assert Accelerator(cpu=True).deepspeed_plugin is None  # no JSON: no plugin, as before


def test_carried_json_is_no_config_file_key_and_round_trips(tmp_path):
    cfg = AccelConfig(deepspeed_json=DUMMY_JSON, deepspeed_json_path="ds.json")
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # what the workers decode
    assert "deepspeed_json" not in AccelConfig().to_dict()  # unset: the dict (and saved files) as before
    assert "deepspeed_json" not in cfg.to_yaml()  # a config file names the JSON (deepspeed_config_file) instead
    with pytest.raises(ConfigError, match="unknown key 'deepspeed_json'"):
        resolve_config(write(tmp_path / "c.yaml", "deepspeed_json: {}\n"))
    with pytest.raises(ConfigError) as info:
        config_from_dict({"deepspeed_json": [1]}, "$ACCEL_LAUNCH_CONFIG")
    assert str(info.value) == ("$ACCEL_LAUNCH_CONFIG: key 'deepspeed_json': bad value of type list; allowed: a "
                               "DeepSpeed JSON object (or null)")


@pytest.mark.parametrize("plugin, file_stage, stage", [
    (lambda: FullyShardedDataParallelPlugin(), None, 3),  # no stage anywhere: FSDP's default
    (lambda: FullyShardedDataParallelPlugin(), "zero_stage: 2", 2),  # the file's stage stays
    (lambda: DeepSpeedPlugin(), "dp_shard_size: 1", 2),  # DeepSpeed's default
    (lambda: DeepSpeedPlugin(), "zero_stage: 1", 1),
    (lambda: DeepSpeedPlugin(zero_stage=3), "zero_stage: 1", 3),  # a stage of its own wins
])
def test_an_accelerator_with_a_plugin_builds_its_config_once(tmp_path, monkeypatch, plugin, file_stage, stage):
    """The plugin's default stage is decided from the layers under the arguments, without building a config from
    them: the Accelerator's config is the one config built."""
    from accel.config import schema

    text = "use_cpu: true\n" + (f"parallelism:\n  {file_stage}\n" if file_stage else "")
    monkeypatch.setenv("ACCEL_CONFIG_FILE", str(write(tmp_path / "c.yaml", text)))
    built = []
    post_init = schema.AccelConfig.__post_init__
    monkeypatch.setattr(schema.AccelConfig, "__post_init__", lambda self: (built.append(self), post_init(self))[1])
    the_plugin = plugin()
    accelerator = Accelerator(**{"fsdp_plugin" if isinstance(the_plugin, FullyShardedDataParallelPlugin)
                                 else "deepspeed_plugin": the_plugin})
    assert len(built) == 1 and built[0] is accelerator.config
    assert accelerator.config.parallelism.zero_stage == stage
