"""Training examples: Flax models, data and the train CLI (extra: [examples])."""
