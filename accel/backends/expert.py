"""The path docs of earlier releases gave for `ExpertPlan`: the module is accel.parallel.expert (one module object
under both names)."""

import sys

from accel.parallel import expert

sys.modules[__name__] = expert
