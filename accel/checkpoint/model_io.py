"""Saving and loading model weights in Hugging Face's on-disk layout.

Layout written by :func:`save_state_dict_sharded` (and read by :func:`load_checkpoint_in_model`):

* everything fits in one shard: ``model.safetensors`` (or ``pytorch_model.bin``);
* otherwise ``model-00001-of-0000N.safetensors`` ... plus ``model.safetensors.index.json``::

      {"metadata": {"total_size": <bytes of all saved tensors>, "accel_tied": {alias: kept_name}},
       "weight_map": {tensor_name: shard_file_name}}

  (``pytorch_model-0000k-of-0000N.bin`` and ``pytorch_model.bin.index.json`` for the legacy format).

Tensors sharing storage (tied weights such as an embedding and an lm_head) are written once under the
first name in state-dict order. Safetensors files record the other names in their header metadata as
``"accel_tied": json.dumps({alias: kept_name})`` (in the file holding the kept name) so that loading
restores them. Legacy ``.bin`` shards store the alias as a second key referring to the same tensor
(``torch.save`` keeps the storage once), which ``torch.load(weights_only=True)`` restores shared.

Loading never unpickles arbitrary objects: ``.bin``/``.pt``/``.pth`` files go through
``torch.load(weights_only=True)`` only.

Checksums. Every file of a save (the shards, and extra files such as the ``config.json`` of ``Accelerator.save_model``)
gets ``layout.file_checksum`` (crc32, ``crc32:<8 hex>``), verified by :func:`load_checkpoint_in_model` before any
tensor is read, so a flipped bit or a same-size edit is a one-line ``CheckpointError`` naming the file, and the model
is left unchanged. Where they live:

* a sharded save: in its index, ``metadata.accel_checksums`` ({file: checksum}) and ``metadata.accel_index_checksum``
  (the index's own content, every key but that one, as ``layout.manifest_checksum`` computes it). Hugging Face's
  index format allows extra metadata keys (transformers and safetensors readers use ``weight_map`` only), the
  checksums travel with the index wherever the model is copied, and a later save by another tool rewrites the index,
  so they never describe files that tool wrote;
* a single-file save has no index, and the checksum cannot go into the safetensors header (it is part of the bytes
  checksummed; a ``.bin`` file has none), so a small sidecar ``accel_checksums.json`` is written last
  (``{"format": "accel-model-checksums", "version": 1, "files": {...}, "checksum": ...}``): Hugging Face loaders
  look for weights and configs by name and never open it.

Files written by other tools (no checksum anywhere) load as before, unchecked. A single-file save's header and sidecar
carry the same random ``accel_save_id``, so a ``model.safetensors`` another tool later writes into the folder
(``save_pretrained``) is not checked against the stale sidecar. A load verifies the files it reads (the weights);
``config.json`` is checksummed too, for tools that check a whole folder, but editing it does not stop a weights load.

A save is built in a temporary folder beside its target and replaces the model there in one step, keeping the
folder's other files (see :func:`save_state_dict_sharded`).

This module is the entry point other code imports; the code lives by concern: `model_files` (the layout's names and
index JSON), `model_state` (the full state dict), `model_writer`, `weights_files` (one file read safely: checksums,
checked descriptors, no pickle) and `model_reader` (loading into a model).
"""

from accel.checkpoint.model_files import (  # noqa: F401
    _FOLDER_CANDIDATES,
    CHECKSUMS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    _index_body,
    loads_json,
    parse_size,
    read_json,
)
from accel.checkpoint.model_reader import (  # noqa: F401
    CheckpointPlan,
    TensorLoader,
    _checked_shard_path,
    format_keys,
    load_checkpoint_in_model,
    resolve_dtype,
)
from accel.checkpoint.model_state import get_full_state_dict, unwrap_model  # noqa: F401
from accel.checkpoint.model_writer import save_state_dict_sharded
from accel.checkpoint.weights_files import (  # noqa: F401
    UnsafeWeightsError,
    safe_open_checked,
    torch_load_weights,
    verify_saved_file,
)

__all__ = [
    "SAFE_WEIGHTS_NAME",
    "SAFE_WEIGHTS_INDEX_NAME",
    "WEIGHTS_NAME",
    "WEIGHTS_INDEX_NAME",
    "CHECKSUMS_NAME",
    "parse_size",
    "save_state_dict_sharded",
    "load_checkpoint_in_model",
    "get_full_state_dict",
]
