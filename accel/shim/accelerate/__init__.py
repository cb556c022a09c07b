"""Found instead of Hugging Face Accelerate while `accel/shim` is on the path: `accelerate` becomes accel."""

from accel.shim import install

install()
