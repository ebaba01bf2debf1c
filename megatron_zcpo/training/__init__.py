"""The training passes: run and trainer config, batches, the rollout-step object, experience, update, metrics, the trainer."""
