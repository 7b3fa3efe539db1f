"""Training examples: Flax models, data, the train CLI (extra: [examples])."""
