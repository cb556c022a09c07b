"""`python -m accelerate ARGS...` under the shim: what Accelerate's `accelerate` console script runs (`accelerate
launch`, `config`, `env`, `estimate-memory`, `merge-weights`, `test`, ...), here accel's
(accel.commands.accelerate_cli, reached by the name the console script imports)."""

import importlib
import sys

sys.exit(importlib.import_module("accelerate.commands.accelerate_cli").main())
