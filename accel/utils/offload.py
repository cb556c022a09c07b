"""Accelerate's `accelerate.utils.offload` path: the module is accel.big_model.offload (one module object under both
names, so patching either patches both)."""

import sys

from accel.big_model import offload

sys.modules[__name__] = offload
