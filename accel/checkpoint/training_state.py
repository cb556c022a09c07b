"""`save_state` / `load_state`: everything needed to continue a run, written atomically, loaded safely.

On-disk layout of one checkpoint folder::

    accel_checkpoint.json        manifest: format, version, world size, step, the JSON skeleton of every
                                 non-tensor value, the jsonl/csv trackers' run and how far its files were
                                 written (`trackers`, to resume that log), and the size of every file (written
                                 last)
    state/shard-*.safetensors    model, optimizer, scheduler, scaler, data-loader and registered objects'
                                 tensors, written by torch.distributed.checkpoint: every rank writes its
                                 own part, replicated tensors once, loadable on another process count
    rng/rank_<r>.safetensors     rank r's torch (and CUDA) RNG states
    rng/rank_<r>.json            rank r's Python and NumPy RNG states

No pickle anywhere: tensors are safetensors, everything else JSON.

This module is the entry point other code imports; each concern lives in its own module: `run_state` (what a run
carries and its state tree), `rank_agreement` (how the ranks agree), `state_save`, `state_load`, `state_checks` (a
checkpoint checked before a load), `rng_states` and `heal_state` (the state in memory, for a fault-tolerant heal).
"""


from accel.checkpoint.run_state import (  # noqa: F401
    TrainingObjects,
    loader_state,
)
from accel.checkpoint.rank_agreement import (  # noqa: F401
    alone,
    first_cause,
)
from accel.checkpoint.rng_states import (  # noqa: F401
    _apply_rng,
    _save_rng,
    rng_snapshot,
    rng_state,
    write_rng,
)
from accel.checkpoint.state_checks import (  # noqa: F401
    _check_state_files,
    _checked_manifest,
    _read_header,
)
from accel.checkpoint.state_save import (  # noqa: F401
    FILE_BYTES,
    save_training_state,
    wait_for_save,
)
from accel.checkpoint.state_load import (  # noqa: F401
    OVERLAP_MIN_CPUS,
    STAGING_BYTES,
    _check_against_objects,
    load_training_state,
    state_reader,
)
from accel.checkpoint.heal_state import (  # noqa: F401
    capture_state,
    restore_state,
)
