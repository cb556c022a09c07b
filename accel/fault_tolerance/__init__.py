"""Fault tolerance without restarts (torchft) and semi-synchronous training (LocalSGD, DiLoCo).

Data parallelism whose membership can change: several *replica groups* (each one torchrun job of one or more
processes) train the same model; torchft's Lighthouse forms a quorum of the live groups at every step, gradients
are all-reduced over it, and the optimizer commits a step only when that all-reduce succeeded. A group that died
is restarted by its own torchrun and copies the weights and optimizer state from a live group (it "heals")
without reading a checkpoint. See docs/fault_tolerance.md.

The core never imports this package, except through the backend registry (a config with a `fault_tolerance`
section selects the `fault_tolerant` backend) and Accelerate's `accelerate.local_sgd` path (`accel/local_sgd.py`).
torchft itself is imported only when a job asks for fault tolerance (`pip install 'accel-train[ft]'`).
"""

from __future__ import annotations

# a worker that found the replica groups' weights different exits with this; accel launch does not restart its group
# (a restart would heal from the same diverged replicas): accel/fault_tolerance/fingerprint.py
REPLICAS_DIVERGED_EXIT_CODE = 76

MISSING_TORCHFT = ("fault tolerance needs torchft, which is not installed; install the extra: "
                   "pip install 'accel-train[ft]'  (or: pip install torchft)")


def require_torchft():
    """torchft's module, or one line naming the extra (an ImportError) when it is not installed."""
    try:
        import torchft
    except ImportError:
        raise ImportError(MISSING_TORCHFT) from None
    return torchft


def committed_steps(accelerator) -> int:
    """The optimizer steps the quorum of replica groups committed so far (with `semi_sync_method`: the
    synchronisations). A group that healed received it with the weights, so every live group reads the same number:
    bound the loop with it (`while committed_steps(accelerator) < max_steps:`) and the groups stop together, with the
    same weights, even after a restart."""
    steps = getattr(accelerator.backend, "committed_steps", None)
    if steps is None:
        raise ValueError("committed_steps: this Accelerator does not run under fault tolerance; allowed: a config "
                         "with fault_tolerance.enabled true (accel launch --fault_tolerance)")
    return int(steps)
