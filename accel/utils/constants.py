"""Accelerate's `accelerate.utils.constants` path: the module is accel.core.constants (one module object under both
names, so patching either patches both)."""

import sys

from accel.core import constants

sys.modules[__name__] = constants
