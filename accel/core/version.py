"""accel's version (here, below everything, so the CLI and `accel env` read it without the package facade)."""

__version__ = "0.1.0"
