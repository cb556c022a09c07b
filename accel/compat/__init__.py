"""Accelerate's helpers that exist for its scripts and consumers (its utils modules' code)."""
