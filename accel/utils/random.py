"""Accelerate's `accelerate.utils.random` path: the module is accel.core.seeding (one module object under both names, so
patching either patches both)."""

import sys

from accel.core import seeding

sys.modules[__name__] = seeding
