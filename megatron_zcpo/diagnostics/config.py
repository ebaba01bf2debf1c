"""The ``diagnostics:`` section of a run config: which KL failure-mode families run, how often, how much they sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from megatron_zcpo.algorithms.config import AlgorithmConfig

FAMILIES = ("grad_share", "f1", "f2", "f3", "f4", "f5", "f6", "f7")
# Families that split the loss into a reward and a KL branch: defined for the clipped surrogates only.
BRANCH_FAMILIES = ("grad_share", "f1", "f2", "f3", "f5")
BRANCH_ALGORITHMS = ("zcpo", "dapo", "grpo")


@dataclass
class DiagnosticsConfig:
    """The ``diagnostics:`` section: KL failure-mode diagnostics F1-F7 (see megatron_zcpo.diagnostics.runner).

    enabled: run them at all. families: any of grad_share (KL share of the first mini-batch's
    gradient), f1 (KL gradient at clipped tokens, measured before the last mini-batch), f2
    (reward-gradient cancellation), f3 (identical-reward groups), f4 (length vs drift
    correlation), f5 (KL share in the shortest / longest groups), f6 (concentration of the KL
    over tokens and positions), f7 (k1 sampling noise). every: run on steps where
    step % every == 0 (step 0 included). cancellation_tokens: uniform token sample of the first
    mini-batch for F2's global denominator. groups: groups sampled for the per-group shares (F2,
    F5); tokens_per_group: tokens sampled per sampled group for its cancellation rate (F2).
    top_fractions: token fractions of F6's concentration shares. position_buckets: increasing
    token positions (0-based) that bound F6's KL-by-position buckets. head_tokens: F6's share of
    Var(K) carried by the first head_tokens response tokens (the paper: 10). seed: mixed with the step
    to draw the samples (identically on every rank).
    """

    enabled: bool = False
    families: List[str] = field(default_factory=lambda: list(FAMILIES))
    every: int = 10
    cancellation_tokens: int = 32
    groups: int = 10
    tokens_per_group: int = 4
    top_fractions: List[float] = field(default_factory=lambda: [0.01, 0.1])
    position_buckets: List[int] = field(default_factory=lambda: [1, 10, 100, 1000])
    head_tokens: int = 10
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError naming ``diagnostics.<key>`` for a bad value."""
        if not isinstance(self.enabled, bool):
            raise ValueError(f"diagnostics.enabled: expected true or false, got {self.enabled!r}")
        if isinstance(self.families, str) or not all(isinstance(name, str) for name in self.families):
            raise ValueError(f"diagnostics.families: expected a list of family names, got {self.families!r}")
        unknown = [name for name in self.families if name not in FAMILIES]
        if unknown:
            raise ValueError(f"diagnostics.families: unknown {unknown}; known families: {', '.join(FAMILIES)}")
        if len(set(self.families)) != len(self.families):
            raise ValueError(f"diagnostics.families: {list(self.families)} names a family twice")
        for key, low in (
            ("every", 1),
            ("cancellation_tokens", 1),
            ("groups", 2),
            ("tokens_per_group", 1),
            ("head_tokens", 1),
            ("seed", 0),
        ):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"diagnostics.{key}: expected an integer >= {low}, got {value!r}")
        if not self.top_fractions or not all(_is_number(f) and 0 < f <= 1 for f in self.top_fractions):
            raise ValueError(
                f"diagnostics.top_fractions: expected a non-empty list of numbers in (0, 1], got {self.top_fractions!r}"
            )
        bounds = self.position_buckets
        if (
            not bounds
            or not all(isinstance(b, int) and not isinstance(b, bool) for b in bounds)
            or bounds[0] < 1
            or any(a >= b for a, b in zip(bounds, bounds[1:]))
        ):
            raise ValueError(
                f"diagnostics.position_buckets: expected strictly increasing integers >= 1, got {bounds!r}"
            )

    def check_algorithm(self, algorithm: AlgorithmConfig) -> None:
        """Raise ValueError naming ``diagnostics.families`` when a branch family is on for an algorithm
        without a reward / KL branch split (rpg, gvpo)."""
        branch = [name for name in self.families if name in BRANCH_FAMILIES]
        if self.enabled and branch and algorithm.name not in BRANCH_ALGORITHMS:
            raise ValueError(
                f"diagnostics.families: {branch} split the loss into reward and KL branches, defined "
                f"for algorithm.name in {BRANCH_ALGORITHMS}, not {algorithm.name!r}; "
                f"keep only {[n for n in self.families if n not in BRANCH_FAMILIES]}"
            )


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
