"""Accelerate's `accelerate.utils.other` path: the module is accel.compat.other (one module object under both names, so
patching either patches both)."""

import sys

from accel.compat import other

sys.modules[__name__] = other
