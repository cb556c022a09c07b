"""Accelerate's `accelerate.utils.memory` path: the module is accel.core.memory (one module object under both names, so
patching either patches both)."""

import sys

from accel.core import memory

sys.modules[__name__] = memory
