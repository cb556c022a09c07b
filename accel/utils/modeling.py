"""Accelerate's `accelerate.utils.modeling` path: the module is accel.big_model.modeling (one module object under both
names, so patching either patches both)."""

import sys

from accel.big_model import modeling

sys.modules[__name__] = modeling
