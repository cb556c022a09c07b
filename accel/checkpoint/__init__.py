"""Checkpoints: Hugging Face-format model weights (`model_io`) and resumable training state
(`training_state`), both safetensors + JSON, written atomically (`layout`)."""

from accel.checkpoint.layout import CheckpointError, ProjectConfiguration

__all__ = ["CheckpointError", "ProjectConfiguration", "load_checkpoint_in_model", "save_state_dict_sharded"]


def __getattr__(name: str):
    if name in ("load_checkpoint_in_model", "save_state_dict_sharded", "get_full_state_dict", "parse_size"):
        from accel.checkpoint import model_io

        return getattr(model_io, name)
    raise AttributeError(f"module 'accel.checkpoint' has no attribute {name!r}")
