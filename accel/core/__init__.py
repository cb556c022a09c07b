"""Leaf helpers that import nothing else of accel: optional-package probes, seeding, memory, constants, diagnostics."""
