"""Model transformations of the recipe that are not a parallel dimension: activation checkpointing, compilation
(regional or whole-model, and the torch.compile options), and the repeated blocks both of them (and FSDP2) wrap.
Each is a plain function of the model and the config, applied by accel/backends/recipe.py in its fixed order."""
