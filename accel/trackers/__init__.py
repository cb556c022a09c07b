"""The trackers themselves, one module per kind: `base` (Accelerate's `GeneralTracker` contract), `files` (accel's
own jsonl and csv trackers and their run folders) and `libraries` (the trackers of Accelerate's libraries:
TensorBoard, W&B, MLflow, ...). `accel.tracking` is their import path, with the table that picks them by name."""
