"""Accelerate's `accelerate.hooks` path: the module is accel.big_model.hooks (one module object under both names, so
patching either patches both)."""

import sys

from accel.big_model import hooks

sys.modules[__name__] = hooks
