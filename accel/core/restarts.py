"""Which attempt this process is under `accel launch --max_restarts N`."""

from __future__ import annotations

import os


def export_restart_count() -> None:
    """Set ACCEL_RESTART_COUNT: which attempt this is under `accel launch --max_restarts N` (0 = the first), from
    torchrun's TORCHELASTIC_RESTART_COUNT. Done on import, so a script can read it before making an Accelerator;
    outside torchrun a value the user set is kept (to rehearse a restart), else 0."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("ACCEL_RESTART_COUNT") or "0"
    os.environ["ACCEL_RESTART_COUNT"] = count
