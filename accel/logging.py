"""Accelerate's `accelerate.logging` path: the module is accel.runtime.logging (one module object under both names, so
patching either patches both)."""

import sys

from accel.runtime import logging

sys.modules[__name__] = logging
