"""A reward function that holds a run after its first trained step until its launcher has relayed a stop signal."""

import os
import time

from megatron_zcpo.rewards.math import dapo_math_reward
from megatron_zcpo.training.preemption import STOP_FILE_ENV

GATE_ENV = "ZCPO_TEST_REWARD_GATE"  # the run's metrics.jsonl: the gate closes once it records a trained step


def gated_dapo_math_reward(response, ground_truth, metadata):
    """DAPO's math reward; once ``$ZCPO_TEST_REWARD_GATE`` (the run's metrics file) records a trained
    step, first waits (up to 8 s, under ``reward.timeout_s``) for the stop request the launcher writes
    to ``$ZCPO_STOP_FILE``. Steps after the first take ~0.1 s on a tiny model, faster than a test can
    watch the metrics and signal: so the second step cannot finish before the signal has reached the ranks."""
    metrics, stop_file = os.environ.get(GATE_ENV), os.environ.get(STOP_FILE_ENV)
    if metrics and stop_file and os.path.exists(metrics):
        with open(metrics) as records:
            trained = '"rollout/reward_mean"' in records.read()
        deadline = time.monotonic() + 8.0
        while trained and not os.path.exists(stop_file) and time.monotonic() < deadline:
            time.sleep(0.01)
    return dapo_math_reward(response, ground_truth, metadata)
