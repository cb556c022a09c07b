"""accel's command line (installed as `accel.cli`)."""
