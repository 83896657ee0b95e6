"""One training step and what it runs on: the wrapped model, the optimizers, FP8, batch size, stop requests, replicas."""
