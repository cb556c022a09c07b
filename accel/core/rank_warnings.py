"""Warnings once per job instead of once per process: on every launched process but global rank 0, the warnings
that say the same thing on every rank are ignored.

Ignored there: accel's own warnings (raised in an `accel.*` module) and DeprecationWarning,
PendingDeprecationWarning and FutureWarning from anywhere (they are about code, which every rank shares).
Still shown on every rank: anything else (a UserWarning or RuntimeWarning may be about this rank's data), all
logging and all errors. The filters are appended, so they only fill in for Python's defaults: a filter the
user set (`-W error`, PYTHONWARNINGS, warnings.simplefilter) still decides, on every rank alike.
`ACCEL_WARNINGS_ALL_RANKS=1` turns this off.
"""

from __future__ import annotations

import os
import warnings

ALL_RANKS_ENV = "ACCEL_WARNINGS_ALL_RANKS"
SAME_ON_EVERY_RANK = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)


def warn_once_per_job(environ=os.environ) -> bool:
    """Install the filters on a non-main rank of a launched job (RANK set, not 0). Returns whether it did."""
    rank = environ.get("RANK", "0").strip() or "0"
    if rank == "0" or environ.get(ALL_RANKS_ENV, "").lower() in ("1", "true", "yes"):
        return False
    warnings.filterwarnings("ignore", module=r"accel(\.|$)", append=True)
    for category in SAME_ON_EVERY_RANK:
        warnings.filterwarnings("ignore", category=category, append=True)
    return True
