"""Accelerate's `accelerate.utils.progress` path: the module is accel.runtime.progress (one module object under both
names, so patching either patches both)."""

import sys

from accel.runtime import progress

sys.modules[__name__] = progress
