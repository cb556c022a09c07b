"""The Accelerate version the shim answers as (accel/shim): here, below everything, so `accel env` reads it without
the shim's import machinery."""

from __future__ import annotations

import os
import re
import sys

ACCELERATE_VERSION = "1.15.0"  # the Accelerate release the shim answers as (accel/shim/accelerate-<it>.dist-info)
VERSION_ENV = "ACCEL_ACCELERATE_VERSION"  # pins another: the version libraries see, for their version checks


class ShimVersionError(ValueError):
    """$ACCEL_ACCELERATE_VERSION is not a release version."""


def accelerate_version() -> str:
    """The version `accelerate` answers as: `$ACCEL_ACCELERATE_VERSION` when set (checked), else ACCELERATE_VERSION."""
    pinned = os.environ.get(VERSION_ENV, "").strip()
    if not pinned:
        return ACCELERATE_VERSION
    if not re.fullmatch(r"[0-9]{1,4}(\.[0-9]{1,4}){1,3}", pinned):
        raise ShimVersionError(f"{VERSION_ENV}={pinned!r} is not a release version; allowed: numbers with dots, such "
                               f"as {ACCELERATE_VERSION} (the default), or unset")
    return pinned


# the shim's `accelerate` module (accel/shim/accelerate/__init__.py), found without importing the shim
FACADE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "shim", "accelerate", "__init__.py")


def shim_active() -> bool:
    """Whether `accelerate` is the shim's module in this process (the script imported Accelerate's names)."""
    return getattr(sys.modules.get("accelerate"), "__file__", None) == FACADE
