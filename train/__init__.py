"""Training, data, checkpointing, export and generation for the `moe` models."""
