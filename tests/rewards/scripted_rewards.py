"""Reward functions that misbehave on purpose, imported by dotted path in the reward-pool workers (no tests here)."""

import os
import time


def scripted_reward(response, ground_truth, metadata):
    """1.0 if response == ground_truth else 0.0, except for scripted responses that crash, hang, kill the
    worker, return NaN / a non-number, the worker's process id ("pid") or a given number ("echo:<x>"), or take a while ("sleep:<seconds>", then 1.0)."""
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
    if response == "pid":
        return os.getpid()
    if response.startswith("sleep:"):
        time.sleep(float(response[len("sleep:") :]))
        return 1.0
    if response.startswith("echo:"):
        return float(response[len("echo:") :])
    return float(response == ground_truth)


def fails_unless_exact(response, ground_truth, metadata):
    """1.0 when the response is exactly the ground truth (what the start-up probe sends), else it
    raises: a reward function that passes the probe and then fails on most real answers."""
    if response == ground_truth:
        return 1.0
    raise KeyError("no boxed answer")
