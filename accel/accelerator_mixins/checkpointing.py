"""The Accelerator's checkpoints: save_state/load_state (the whole training state, atomically, in the background when
asked), the objects and hooks registered for them, and the model's weights alone (save_model, get_state_dict,
save)."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import torch

from accel.accelerator_mixins.data_loading import DataLoading
from accel.accelerator_mixins.experiment_tracking import Tracking
from accel.accelerator_mixins.models import ModelHandling
from accel.accelerator_mixins.training_step import TrainingStep

_SAFETENSORS_ONLY_WARNED: list[bool] = []  # save_state(safe_serialization=False) warns once per process


def _warn_safetensors_only() -> None:
    """Accelerate's pickle checkpoints are never written: the files stay safetensors + JSON, which load_state (and
    Accelerate's loader, for the model files) reads the same way; say so once."""
    if not _SAFETENSORS_ONLY_WARNED:
        _SAFETENSORS_ONLY_WARNED.append(True)
        warnings.warn("save_state(safe_serialization=False): accel never writes pickle checkpoints; saving "
                      "safetensors + JSON as always (load_state reads them the same way)", UserWarning, stacklevel=3)


class Checkpointing(Tracking, DataLoading, TrainingStep, ModelHandling):
    """What a run carries, listed once by `_training_objects` (save_state, load_state and a healing replica read
    it), and the model files in Hugging Face's layout."""

    @property
    def save_iteration(self) -> int:
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Also save/restore these objects (anything with `state_dict` and `load_state_dict`) in save_state."""
        invalid = [f"Item at index {i} ({type(o).__name__}: {' '.join(str(o).split())[:80]})"
                   for i, o in enumerate(objects) if not (hasattr(o, "state_dict") and hasattr(o, "load_state_dict"))]
        if invalid:  # Accelerate's words for each ("Item at index N"), in one line
            raise ValueError("register_for_checkpointing: these objects lack state_dict/load_state_dict: "
                             + ", ".join(invalid))
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[..., None]) -> torch.utils.hooks.RemovableHandle:
        """Run `hook(models, weights, output_dir)` in `save_state` before anything is written (Accelerate's). `weights`
        are the models' state dicts about to be saved: removing one skips saving that model's weights (e.g. the
        hook saved it its own way into `output_dir`, the checkpoint folder being built); changing one changes
        what is saved. Returns a handle whose `remove()` unregisters the hook."""
        handle = torch.utils.hooks.RemovableHandle(self._save_model_state_pre_hook)
        self._save_model_state_pre_hook[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[..., None]) -> torch.utils.hooks.RemovableHandle:
        """Run `hook(models, input_dir)` in `load_state` before anything is loaded (Accelerate's): models the hook
        removes from `models` (it loaded them itself) are not loaded from the checkpoint. Returns a handle whose
        `remove()` unregisters the hook."""
        handle = torch.utils.hooks.RemovableHandle(self._load_model_state_pre_hook)
        self._load_model_state_pre_hook[handle.id] = hook
        return handle

    def _training_objects(self):
        from accel.checkpoint.training_state import TrainingObjects
        from accel.tracking import tracker_record

        return TrainingObjects(self.backend, self._models, self._optimizers, self._schedulers, self._dataloaders,
                               self._custom_objects, self.scaler, self.gradient_state.step,
                               save_hooks=list(self._save_model_state_pre_hook.values()),
                               load_hooks=list(self._load_model_state_pre_hook.values()),
                               trackers=tracker_record(self.trackers),
                               hook_view=lambda m: self.unwrap_model(m, keep_torch_compile=False),
                               exact_resume=self._exact_resume(), throughput=self.throughput,
                               set_step=self._set_step)

    def _set_step(self, step: int) -> None:
        self.gradient_state.step = step

    def _replicated(self) -> bool:
        """Every process holds the whole training state (DDP): the main process may save it alone."""
        return bool(getattr(self.backend, "replicated_state", False))

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   async_save: bool | None = None, **_: Any) -> str:
        """Save everything needed to continue (models, optimizers, schedulers, scaler, loaders, RNG, registered
        objects) atomically; with automatic naming, to `project_dir/checkpoints/checkpoint_<i>`.

        `async_save=True` (or the config's `checkpoint_async: thread | process`) returns once the tensors are
        copied off the live ones and writes them in the background; the folder appears, complete, when the write
        is done (`wait_for_checkpoint()` waits for it; so do the next save, load_state and end_training)."""
        from accel.checkpoint import layout
        from accel.checkpoint.training_state import save_training_state

        if not safe_serialization:
            _warn_safetensors_only()
        mode = self.config.checkpoint_async
        if async_save is not None:
            mode = ("thread" if mode == "no" else mode) if async_save else "no"
        self.wait_for_checkpoint()
        project = self.project_configuration
        target: str | os.PathLike
        if project.automatic_checkpoint_naming:
            if output_dir is not None:
                raise ValueError("save_state: output_dir is chosen by automatic_checkpoint_naming; pass no path")
            target = automatic = project.checkpoints_dir() / f"checkpoint_{project.iteration}"
            # where the main process saves alone (replicated state), it may have published this folder already
            alone = self.num_processes > 1 and self._replicated()
            if automatic.exists() and (self.is_main_process or not alone):
                raise ValueError(f"save_state: {automatic} already exists; set ProjectConfiguration(iteration=...) "
                                 "past the existing checkpoints")
        elif output_dir is None:
            raise ValueError("save_state: give output_dir, or Accelerator(project_config=ProjectConfiguration("
                             "project_dir=..., automatic_checkpoint_naming=True))")
        else:
            target = output_dir
        rotate = None
        if project.automatic_checkpoint_naming:
            folder, limit = project.checkpoints_dir(), project.total_limit
            rotate = lambda: layout.rotate(folder, limit)  # noqa: E731 (run by the main process once published)
        path = save_training_state(target, self._training_objects(), mode, self._checkpointer, rotate)
        if project.automatic_checkpoint_naming:
            project.iteration += 1
        return str(path)

    def wait_for_checkpoint(self) -> str | None:
        """Wait for an asynchronous `save_state` in flight (every process calls this); returns the folder it
        published, None when none was pending. A failure in the background is raised here, the same one-line
        CheckpointError on every process (the previous checkpoint stays the latest)."""
        from accel.checkpoint.training_state import wait_for_save

        published = wait_for_save(self._checkpointer)
        return None if published is None else str(published)

    def load_state(self, input_dir: str | None = None, **_: Any) -> None:
        """Restore what save_state wrote (RNG states last). With no path, the latest complete automatic checkpoint
        (half-written ones are never complete); when there is none yet, a FileNotFoundError (`NoCheckpointError`),
        so a script restarted by `accel launch --max_restarts N` catches it to start fresh on its first attempt."""
        from pathlib import Path

        from accel.checkpoint import layout
        from accel.checkpoint.training_state import load_training_state

        self.wait_for_checkpoint()
        project = self.project_configuration
        source: str | os.PathLike
        if input_dir is None:
            if not project.automatic_checkpoint_naming:
                raise ValueError("load_state: give input_dir, or use automatic_checkpoint_naming to load the latest")
            source = layout.latest_checkpoint(project.checkpoints_dir())
        else:
            source = input_dir
        manifest = load_training_state(source, self._training_objects())
        self._resume_trackers(manifest.get("trackers"))
        name = Path(source).name
        if project.automatic_checkpoint_naming and name.startswith("checkpoint_") and name[11:].isdigit():
            project.iteration = int(name[11:]) + 1

    def save(self, obj: Any, f, safe_serialization: bool = False) -> None:
        """Accelerate's `save`: write `obj` once, from the main process, atomically. With
        `safe_serialization`, `obj` must be a dict of tensors (safetensors); otherwise `torch.save` is used,
        as in Accelerate (load such files with `torch.load(weights_only=True)`)."""
        from pathlib import Path

        from accel.checkpoint.layout import fsync_dir, fsync_file

        from accel.checkpoint.main_save import main_process_writes

        path = Path(f)

        def write() -> None:
            tmp = path.with_name(f".{path.name}.tmp")
            if safe_serialization:
                from safetensors.torch import save_file

                save_file({k: v.contiguous() for k, v in obj.items()}, str(tmp), metadata={"format": "pt"})
            else:
                torch.save(obj, tmp)
            fsync_file(tmp)
            tmp.replace(path)
            fsync_dir(path.parent)

        main_process_writes("save", path, write, self.is_main_process, self._replicated())

    def get_state_dict(self, model: torch.nn.Module, unwrap: bool = True) -> dict:
        """The full (unsharded) state dict, on CPU, with the user's parameter names; tied weights are one tensor
        under each of their names (as `model.state_dict()` gives them)."""
        from accel.checkpoint.ties import share_tied

        if not unwrap:
            return model.state_dict()
        return share_tied(self.backend.full_state_dict(model), self.backend.tied_groups(model))

    def save_model(self, model: torch.nn.Module, save_directory: str, max_shard_size: int | str = "10GB",
                   safe_serialization: bool = True) -> None:
        """Save the full weights in Hugging Face's layout (sharded safetensors + index) from the main process;
        tied weights once, with the record that restores the tie. A transformers model's `config.json` is written
        beside them, so `from_pretrained(save_directory)` loads the trained model. Every file gets a checksum that
        `load_checkpoint_in_model` verifies; the folder's model (config.json included) is replaced in one step, its
        other files kept (model_io.save_state_dict_sharded)."""
        from accel.checkpoint.model_io import save_state_dict_sharded

        from accel.big_model.modeling import get_state_dict_offloaded_model, has_offloaded_params
        from accel.checkpoint.main_save import main_process_writes

        if any(has_offloaded_params(module) for module in model.modules()):  # big-model hooks: each module's weights
            state = get_state_dict_offloaded_model(model)  # brought in from the CPU or disk, one at a time
        else:
            state = self.get_state_dict(model)

        def write() -> None:
            config = getattr(self.unwrap_model(model), "config", None)
            # a transformers model: from_pretrained(save_directory) works; config.json is published with the weights
            extra = ({"config.json": lambda path: config.to_json_file(str(path))}
                     if config is not None and hasattr(config, "to_json_file") else None)
            save_state_dict_sharded(state, save_directory, max_shard_size=max_shard_size,
                                    safe_serialization=safe_serialization, extra_files=extra)

        # under DDP it may be called on the main process alone, as Accelerate allows
        main_process_writes("save_model", save_directory, write, self.is_main_process, self._replicated())
