"""Accelerate's `accelerate.utils.launch` path: the module is accel.compat.launch (one module object under both names,
so patching either patches both)."""

import sys

from accel.compat import launch

sys.modules[__name__] = launch
