"""Accelerate's `accelerate.local_sgd` path: the module is accel.fault_tolerance.semi_sync (one module object under
both names, so patching either patches both)."""

import sys

from accel.fault_tolerance import semi_sync

sys.modules[__name__] = semi_sync
