"""Found instead of Hugging Face Accelerate while `accel/shim` is on the path: `accelerate` answers with accel.

Every attribute is accel's (`accelerate.Accelerator is accel.Accelerator`), except `__version__`: the Accelerate
release the shim answers as (accel.shim.ACCELERATE_VERSION or a pinned $ACCEL_ACCELERATE_VERSION), which libraries
compare against to choose code paths. `accel.__version__` stays accel's own.
"""

import accel as _accel
from accel.shim import accelerate_version as _accelerate_version
from accel.shim import register_alias as _register_alias

_register_alias()
__version__ = _accelerate_version()
__all__ = [name for name in _accel.__all__ if name != "__version__"] + ["__version__"]


def __getattr__(name: str):
    return getattr(_accel, name)


def __dir__():
    return sorted(set(__all__) | set(globals()))
