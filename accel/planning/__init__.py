"""Memory estimates and the parallel-layout planner (`accel estimate`, `accel plan`)."""
