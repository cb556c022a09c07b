"""Accelerate's `accelerate.utils.versions` module: version comparisons for an installed package or torch (the
functions live in accel.core.probes, beside the probes that use them)."""

import torch

from accel.core.probes import compare_versions, is_torch_version

torch_version = torch.torch_version.TorchVersion(torch.__version__)  # Accelerate's module constant

__all__ = ["compare_versions", "is_torch_version", "torch_version"]
