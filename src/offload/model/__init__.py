"""Finding layers, loading checkpoints, and the default model."""
