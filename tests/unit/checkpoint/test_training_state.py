"""save_state / load_state on one process: layout, safety, errors, rotation, and what is restored."""

import copy
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from accel import Accelerator, GradScalerKwargs, ProjectConfiguration
from accel.checkpoint import layout, tree
from accel.checkpoint.layout import CheckpointError


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("ACCEL_CONFIG_FILE", "ACCEL_LAUNCH_CONFIG"):
        monkeypatch.delenv(name, raising=False)


def prepared(**kwargs):
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, **kwargs)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train_step(accelerator, model, optimizer, scheduler):
    accelerator.backward(model(torch.randn(2, 3)).pow(2).sum())
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()


def test_tree_codec_round_trips_json_unfriendly_values():
    value = {"t": (1, 2.5, None), 3: "int key", "inf": float("inf"), "nested": [{"x": torch.arange(3)}],
             "np": np.arange(4, dtype=np.uint32), "__weird__": 1}
    tensors = {}
    skeleton = tree.split(value, "root", tensors)
    text = json.dumps(skeleton)
    back = tree.join(json.loads(text), tensors)
    assert back["t"] == (1, 2.5, None) and back[3] == "int key" and math.isinf(back["inf"])
    assert torch.equal(back["nested"][0]["x"], torch.arange(3)) and back["__weird__"] == 1
    assert back["np"].dtype == np.uint32 and back["np"].tolist() == [0, 1, 2, 3]
    assert list(tensors) == ["root/nested/0/x"]
    with pytest.raises(tree.NotSerializable, match="root/f: value of type function"):
        tree.split({"f": lambda: 0}, "root", {})


def test_state_round_trip_restores_everything(tmp_path):
    accelerator, model, optimizer, scheduler = prepared(mixed_precision="fp16",
                                                         kwargs_handlers=[GradScalerKwargs(init_scale=256)])
    counter = torch.nn.Module()
    counter.register_buffer("n", torch.tensor([7]))
    accelerator.register_for_checkpointing(counter)
    for _ in range(2):
        train_step(accelerator, model, optimizer, scheduler)
    accelerator.scaler.update(64.0)
    random.seed(11)
    np.random.seed(12)
    torch.manual_seed(13)
    saved_weights = {k: v.clone() for k, v in model.state_dict().items()}
    saved_opt = copy.deepcopy(optimizer.state_dict())
    path = accelerator.save_state(str(tmp_path / "ckpt"))
    expected_draws = (random.random(), np.random.rand(), torch.rand(1))

    # damage every piece of live state, then load
    train_step(accelerator, model, optimizer, scheduler)
    counter.n.fill_(0)
    accelerator.scaler.update(2.0)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    accelerator.load_state(path)

    assert all(torch.equal(saved_weights[k], v) for k, v in model.state_dict().items())
    loaded_opt = optimizer.state_dict()
    assert loaded_opt["param_groups"] == saved_opt["param_groups"]
    for pid, st in saved_opt["state"].items():
        for name, value in st.items():
            assert torch.equal(loaded_opt["state"][pid][name], value), (pid, name)
    assert scheduler.get_last_lr() == [0.1 * 0.5 ** 2]
    assert counter.n.item() == 7
    assert accelerator.scaler.get_scale() == 64.0
    draws = (random.random(), np.random.rand(), torch.rand(1))
    assert draws[0] == expected_draws[0] and draws[1] == expected_draws[1] and torch.equal(draws[2], expected_draws[2])


def test_layout_is_safetensors_and_json_only(tmp_path):
    accelerator, model, optimizer, scheduler = prepared()
    train_step(accelerator, model, optimizer, scheduler)
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert names[0] == "accel_checkpoint.json"
    assert {"rng/rank_0.json", "rng/rank_0.safetensors"} <= set(names)
    assert all(n.endswith((".json", ".safetensors")) for n in names)
    manifest = json.loads((folder / "accel_checkpoint.json").read_text())
    assert manifest["format"] == "accel-checkpoint" and manifest["world_size"] == 1
    assert set(manifest["files"]) == set(names) - {"accel_checkpoint.json"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_load_errors_name_the_bad_file(tmp_path):
    accelerator, model, optimizer, scheduler = prepared()
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    with pytest.raises(CheckpointError, match="nowhere: checkpoint folder not found"):
        accelerator.load_state(str(tmp_path / "nowhere"))

    shard = next((folder / "state").glob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[:-8])
    with pytest.raises(CheckpointError, match=f"{shard.name}: damaged \\(size"):
        accelerator.load_state(str(folder))
    shard.write_bytes(b"\xff" * len(data))  # same size, garbage inside: its checksum differs
    with pytest.raises(CheckpointError, match=f"{shard.name}: damaged \\(its bytes do not match the checksum"):
        accelerator.load_state(str(folder))
    manifest_file = folder / "accel_checkpoint.json"
    manifest = json.loads(manifest_file.read_text())
    manifest_file.write_text(json.dumps({k: v for k, v in manifest.items() if k not in ("checksum", "checksums")}))
    with pytest.raises(CheckpointError, match=f"{shard.name}: damaged \\(not a safetensors file"):  # no checksums
        accelerator.load_state(str(folder))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name}: missing from checkpoint"):
        accelerator.load_state(str(folder))
    (folder / "accel_checkpoint.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="accel_checkpoint.json: damaged"):
        accelerator.load_state(str(folder))
    (folder / "accel_checkpoint.json").unlink()
    with pytest.raises(CheckpointError, match="accel_checkpoint.json: missing; .* not a complete accel checkpoint"):
        accelerator.load_state(str(folder))


def test_load_into_different_objects_is_refused(tmp_path):
    accelerator, model, optimizer, scheduler = prepared()
    path = accelerator.save_state(str(tmp_path / "ckpt"))
    accelerator.register_for_checkpointing(torch.nn.Module())
    with pytest.raises(CheckpointError, match="holds 0 custom but 1 were prepared/registered"):
        accelerator.load_state(path)


def test_register_for_checkpointing_checks_the_objects():
    accelerator, *_ = prepared()
    with pytest.raises(ValueError, match=r"lack state_dict/load_state_dict: Item at index 1 \(int: 42\)$"):
        accelerator.register_for_checkpointing(torch.nn.Module(), 42)


def test_automatic_naming_rotation_and_latest(tmp_path):
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator, model, optimizer, scheduler = prepared(project_config=project)
    values = []
    for _ in range(3):
        train_step(accelerator, model, optimizer, scheduler)
        values.append(model[0].weight.detach().clone())
        accelerator.save_state()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"]  # the oldest was rotated out
    (tmp_path / "checkpoints" / "checkpoint_9").mkdir()  # no manifest: never "latest"
    train_step(accelerator, model, optimizer, scheduler)
    accelerator.load_state()
    assert torch.equal(model[0].weight, values[-1])
    assert project.iteration == 3
    with pytest.raises(ValueError, match="chosen by automatic_checkpoint_naming"):
        accelerator.save_state(str(tmp_path / "x"))


def test_save_state_needs_a_place():
    accelerator, *_ = prepared()
    with pytest.raises(ValueError, match="give output_dir"):
        accelerator.save_state()
    with pytest.raises(ValueError, match="give input_dir"):
        accelerator.load_state()


def test_tied_weights_are_saved_once_under_one_name(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    folder = Path(accelerator.save_state(str(tmp_path / "ckpt")))
    assert json.loads((folder / "accel_checkpoint.json").read_text())["aliases"] == {"/models/0/1.weight": "/models/0/0.weight"}
    expected = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    accelerator.load_state(str(folder))
    assert torch.equal(model[0].weight, expected) and model[1].weight is model[0].weight


def test_interrupted_overwrite_is_explained(tmp_path):
    target = tmp_path / "ckpt"
    (tmp_path / ".old-ckpt-1234").mkdir()
    with pytest.raises(CheckpointError, match="previous checkpoint at .*\\.old-ckpt-1234"):
        layout.read_manifest(target)


def test_skeletons_of_pipeline_stages_merge_into_one():
    """Each stage saves its own tensors: the manifest's skeleton is the union, and an optimizer group's
    parameter names are united even when the stages hold as many parameters each."""
    stage0 = {"models": [{"a.weight": {"__tensor__": "/models/0/a.weight", "shape": [2], "dtype": "float32"}}],
              "optimizers": [{"param_groups": [{"lr": 0.1, "params": ["a.weight", "a.bias"]}]}], "step": 3}
    stage1 = {"models": [{"b.weight": {"__tensor__": "/models/0/b.weight", "shape": [2], "dtype": "float32"}}],
              "optimizers": [{"param_groups": [{"lr": 0.1, "params": ["b.weight", "b.bias"]}]}], "step": 3}
    merged = tree.merge([stage0, stage1])
    assert sorted(merged["models"][0]) == ["a.weight", "b.weight"]
    assert merged["optimizers"][0]["param_groups"][0] == {"lr": 0.1, "params": ["a.weight", "a.bias", "b.weight",
                                                                                 "b.bias"]}
    assert merged["step"] == 3
    assert tree.join(merged, {"/models/0/a.weight": torch.ones(2)})["models"][0]["b.weight"] is None


def test_a_failed_save_is_one_line_and_leaves_no_temporary(tmp_path, monkeypatch):
    """DCP nests every rank's traceback in a CheckpointException; the user gets the folder and the cause."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    def failing_save(*_, **__):
        cause = RuntimeError("Some tensors share memory, this will lead to duplicate memory on disk\n more lines")
        raise CheckpointException("CheckpointException ranks:dict_keys([0])", {0: (cause, None)})

    accelerator, *_ = prepared()
    monkeypatch.setattr(dcp, "save", failing_save)
    with pytest.raises(CheckpointError) as caught:
        accelerator.save_state(str(tmp_path / "ckpt"))
    assert str(caught.value) == (f"{tmp_path / 'ckpt'}: could not be saved: RuntimeError: Some tensors share memory, "
                                 "this will lead to duplicate memory on disk; nothing was published (a checkpoint "
                                 "already there is unchanged)")
    assert not any(p.name.startswith(".tmp") for p in tmp_path.iterdir())


def test_tied_weights_are_saved_once_and_stay_tied(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, x):
            return self.head(self.embed(x))

    accelerator = Accelerator(cpu=True)
    model = Tied()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.backward(model(torch.arange(4)).sum())
    optimizer.step()
    accelerator.save_state(str(tmp_path / "ckpt"))
    manifest = json.loads((tmp_path / "ckpt" / layout.MANIFEST).read_text())
    assert manifest["aliases"] == {"/models/0/head.weight": "/models/0/embed.weight"}
    with torch.no_grad():
        model.embed.weight.zero_()
    accelerator.load_state(str(tmp_path / "ckpt"))
    assert model.head.weight is model.embed.weight and model.embed.weight.abs().sum() > 0


def test_optimizer_of_tensors_no_prepared_model_holds_round_trips(tmp_path):
    """Accelerate saves an optimizer whatever it updates (its own tests prepare one model with another model's
    optimizer): its state is kept by position, as torch's state_dict keeps it, and loads back exactly."""
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    other = torch.nn.Linear(2, 3)  # never prepared
    optimizer = torch.optim.AdamW(other.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(torch.nn.Linear(3, 1), optimizer)
    other(torch.randn(4, 2)).sum().backward()
    optimizer.step()
    saved = copy.deepcopy(optimizer.optimizer.state_dict())
    accelerator.save_state(tmp_path / "state")
    optimizer.step()  # moves away from the checkpoint
    accelerator.load_state(tmp_path / "state")
    loaded = optimizer.optimizer.state_dict()
    assert loaded["param_groups"] == saved["param_groups"]
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(loaded["state"][index][key], value), (index, key)


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n, "history": torch.arange(self.n)}

    def load_state_dict(self, state: dict) -> None:
        self.n = int(state["n"])


def test_capture_and_restore_carry_what_save_state_saves():
    """A fault-tolerant heal's payload (capture_state on the live replica, restore_state on the healing one) is the
    checkpoint's set by the same code: weights, optimizer state, scheduler, registered object, `accelerator.step`,
    the throughput monitor's steps and the RNG states; a batch norm's statistics are copied (the live replica's next
    forward changes them while the peer reads)."""
    from accel.checkpoint.training_state import capture_state, restore_state

    from accel import ThroughputMonitorKwargs

    monitor = {"throughput_monitor": True, "kwargs_handlers": [ThroughputMonitorKwargs(flops_per_token=1.0)]}
    live, model, optimizer, scheduler = prepared(**monitor)
    counter = _Counter()
    live.register_for_checkpointing(counter)
    for _ in range(3):
        with live.accumulate(model):
            train_step(live, model, optimizer, scheduler)
        counter.n += 1
    sent = capture_state(live._training_objects())
    after_capture = torch.rand(3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.optimizer.state.values()]

    healing, model2, optimizer2, scheduler2 = prepared(**monitor)
    with torch.no_grad():
        for param in model2.parameters():
            param.add_(1.0)
    counter2 = _Counter()
    healing.register_for_checkpointing(counter2)
    restore_state(healing._training_objects(), sent, "a test's replica")
    assert all(torch.equal(model2.state_dict()[k], v) for k, v in weights.items())
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(optimizer2.optimizer.state.values(), moments, strict=True))
    assert scheduler2.scheduler.last_epoch == scheduler.scheduler.last_epoch == 3
    assert scheduler2.get_last_lr() == scheduler.get_last_lr()
    assert counter2.n == 3 and healing.step == live.step == 3 and healing.throughput.steps == 3
    assert torch.equal(torch.rand(3), after_capture)  # the RNG states: the live replica's at the capture


def test_capture_copies_what_the_next_forward_changes():
    from accel.checkpoint.training_state import capture_state

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.BatchNorm1d(2))
    sent = capture_state(accelerator._training_objects())
    before = sent["tensors"]["/models/0/running_mean"].clone()
    model(torch.randn(4, 2) + 5)  # training mode: the running mean moves
    assert torch.equal(sent["tensors"]["/models/0/running_mean"], before)
    assert not torch.equal(model.running_mean, before)
