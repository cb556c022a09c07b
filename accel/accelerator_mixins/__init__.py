"""The `Accelerator`'s members by concern, mixed into the class in accel/accelerator.py (which keeps the
constructor, prepare, backward and accumulate): who this process is and how processes coordinate (`process`), the
training step around backward (`training_step`), collectives (`collectives`), data loaders (`data_loading`), the
parallel layout's views (`parallel_layout`), prepared models (`models`), checkpoints (`checkpointing`) and experiment
trackers (`experiment_tracking`). Each reads the attributes the constructor sets (`fields`)."""
