"""Accelerate's `accelerate.big_modeling` path: the module is accel.big_model.dispatch (one module object under both
names, so patching either patches both)."""

import sys

from accel.big_model import dispatch

sys.modules[__name__] = dispatch
