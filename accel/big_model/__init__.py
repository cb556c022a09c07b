"""Big-model inference: device maps, offloading, hooks and dispatch (Accelerate's big_modeling)."""
