"""The RL recipe: run configuration, the rollout side, the weight push, evaluation and the training loop."""
