"""Accelerate's `accelerate.utils.operations` path: the module is accel.compat.operations (one module object under both
names, so patching either patches both)."""

import sys

from accel.compat import operations

sys.modules[__name__] = operations
