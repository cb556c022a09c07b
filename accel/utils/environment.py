"""Accelerate's `accelerate.utils.environment` path: the module is accel.compat.environment (one module object under
both names, so patching either patches both)."""

import sys

from accel.compat import environment

sys.modules[__name__] = environment
