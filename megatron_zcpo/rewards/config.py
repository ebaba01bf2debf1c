"""The ``reward:`` section of the run configuration."""

from __future__ import annotations

import dataclasses
import multiprocessing

ON_FAILURE_CHOICES = ("error", "zero", "min", "skip-group")


@dataclasses.dataclass
class RewardConfig:
    """How responses are scored.

    function: dotted path of the reward function, ``"pkg.module:function"`` or ``"pkg.module.function"``,
        called as ``fn(response: str, ground_truth: str, metadata: dict) -> float`` in a worker process
        (metadata: uid, data_source, extra_info of the prompt). Default: DAPO's +1/-1 math reward.
    num_workers, timeout_s, start_method: the worker pool; a call running past ``timeout_s`` seconds
        has its worker killed and replaced.
    on_failure: what a call that raised, timed out or killed its worker gives: "error" raises
        naming the prompt, "zero" scores it 0, "min" scores it ``min_reward``, "skip-group" drops its
        whole group from training. (A NaN or non-number result is always an error: it is a bug.)
    max_failed_fraction: above this share of a rollout's reward calls failing (raised, timed out),
        the run stops after that rollout naming the reward's error, the count and an example input:
        a reward function that fails that often is broken, and the scores ``on_failure`` gives
        would tie the groups (dynamic sampling then drops them). Below it the count is a metric
        (``reward/failed_calls``, ``reward/failed_fraction``).
    overlong_penalty, max_response_length, overlong_buffer, overlong_penalty_factor: DAPO's soft
        overlong punishment; ``max_response_length`` is the generation cap L_max (keep it equal to the
        rollout's max_new_tokens) and ``overlong_buffer`` is L_cache (paper: 20,480 and 4,096).
    overlong_filter: leave responses truncated at the length cap out of the loss.
    """

    function: str = "megatron_zcpo.rewards.math:dapo_math_reward"
    num_workers: int = 4
    timeout_s: float = 10.0
    start_method: str = "forkserver"
    on_failure: str = "min"
    min_reward: float = -1.0
    max_failed_fraction: float = 0.1
    overlong_penalty: bool = True
    max_response_length: int = 20480
    overlong_buffer: int = 4096
    overlong_penalty_factor: float = 1.0
    overlong_filter: bool = True

    def validate(self) -> RewardConfig:
        """Raise ValueError naming every bad ``reward.<key>``; returns self."""
        problems = []
        if not isinstance(self.function, str) or not self.function.strip():
            problems.append(f"reward.function must be a dotted path 'pkg.module:function', got {self.function!r}")
        if not isinstance(self.num_workers, int) or self.num_workers < 1:
            problems.append(f"reward.num_workers must be an integer >= 1, got {self.num_workers!r}")
        if not self.timeout_s > 0:
            problems.append(f"reward.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.start_method not in multiprocessing.get_all_start_methods():
            problems.append(
                f"reward.start_method must be one of {multiprocessing.get_all_start_methods()}, got {self.start_method!r}"
            )
        if self.on_failure not in ON_FAILURE_CHOICES:
            problems.append(f"reward.on_failure must be one of {list(ON_FAILURE_CHOICES)}, got {self.on_failure!r}")
        if not 0.0 <= self.max_failed_fraction <= 1.0:
            problems.append(f"reward.max_failed_fraction must be in [0, 1], got {self.max_failed_fraction!r}")
        if not isinstance(self.max_response_length, int) or self.max_response_length < 1:
            problems.append(f"reward.max_response_length must be an integer >= 1, got {self.max_response_length!r}")
        elif self.overlong_penalty and not 0 < self.overlong_buffer <= self.max_response_length:
            problems.append(
                f"reward.overlong_buffer must be in (0, reward.max_response_length={self.max_response_length}], "
                f"got {self.overlong_buffer!r}"
            )
        if self.overlong_penalty_factor < 0:
            problems.append(f"reward.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor!r}")
        if problems:
            raise ValueError("invalid reward config:\n  " + "\n  ".join(problems))
        return self
