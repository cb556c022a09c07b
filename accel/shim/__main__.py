"""`python -m accel.shim` prints the folder to put first on PYTHONPATH so `import accelerate` gives accel."""

from accel.shim import PATH

print(PATH)
