"""Accelerate's `accelerate.utils.ao` path: the module is accel.compat.ao (one module object under both names, so
patching either patches both)."""

import sys

from accel.compat import ao

sys.modules[__name__] = ao
