"""Accelerate's `accelerate.state` path: the module is accel.runtime.state (one module object under both names, so
patching either patches both)."""

import sys

from accel.runtime import state

sys.modules[__name__] = state
