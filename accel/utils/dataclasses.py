"""Accelerate's `accelerate.utils.dataclasses` path: the module is accel.compat.dataclasses (one module object under
both names, so patching either patches both)."""

import sys

from accel.compat import dataclasses

sys.modules[__name__] = dataclasses
