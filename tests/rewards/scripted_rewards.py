"""Reward functions that misbehave on purpose, imported by dotted path in the reward-pool workers (no tests here)."""

import os
import time


def scripted_reward(response, ground_truth, metadata):
    """1.0 if response == ground_truth else 0.0, except for scripted responses that crash, hang, kill the
    worker or return NaN / a non-number."""
    if response == "crash":
        raise ValueError(f"scripted crash for {metadata.get('uid')}")
    if response == "hang":
        time.sleep(3600)
    if response == "exit":
        os._exit(3)
    if response == "nan":
        return float("nan")
    if response == "text":
        return "not a number"
    return float(response == ground_truth)
