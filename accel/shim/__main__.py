"""`python -m accel.shim` prints the folders to put first on PYTHONPATH so `import accelerate` gives accel (with the
Accelerate distribution metadata libraries check); a bad $ACCEL_ACCELERATE_VERSION is one line and exit 2."""

import os
import sys

from accel.shim import ShimVersionError, search_path

try:
    print(os.pathsep.join(search_path()))
except ShimVersionError as err:
    print(f"accel: error: {err}", file=sys.stderr)
    sys.exit(2)
