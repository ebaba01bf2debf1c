"""A reward function for runs of an untrained model: +1 or -1 by the response's length, so groups split."""


def length_parity_reward(response: str, ground_truth: str, metadata=None) -> float:
    """+1.0 for a response of an even number of characters, else -1.0 (ground truth and metadata unused)."""
    return 1.0 if len(response) % 2 == 0 else -1.0
