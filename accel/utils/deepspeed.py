"""Accelerate's `accelerate.utils.deepspeed` path: the module is accel.compat.deepspeed (one module object under both
names, so patching either patches both)."""

import sys

from accel.compat import deepspeed

sys.modules[__name__] = deepspeed
