"""The running job: process state, collectives, precision policy, gradient accumulation, logging."""
