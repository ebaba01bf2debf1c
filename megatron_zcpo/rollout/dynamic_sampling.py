"""DAPO dynamic sampling: over-sample prompts, drop groups whose rewards all tie, refill until the batch is full."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import Any, Callable, Dict, List, Sequence

import torch

from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.rewards.scorer import RewardBatch

logger = logging.getLogger(__name__)

FILTER_ON_CHOICES = ("score", "reward")
ON_CAP_CHOICES = ("error", "partial")
SECTION = "rollout.dynamic_sampling"  # where the run configuration nests DynamicSamplingConfig


class DynamicSamplingError(RuntimeError):
    """The sampling cap was hit before the batch was full (with ``on_cap="error"``)."""


@dataclasses.dataclass
class DynamicSamplingConfig:
    """Dynamic sampling of one training batch.

    drop_tied_groups: drop groups whose values all tie (all correct or all wrong: no learning signal).
    filter_on: "score" ties on the reward function's value (the paper: all-correct / all-incorrect
        groups), "reward" on the final reward including the overlong penalty.
    oversample_factor: each round asks for ceil(missing groups * factor) prompts.
    max_rounds, max_prompts: the cap on generation rounds and on prompts drawn per batch (0: no cap).
    on_cap: "error" stops the run with a message; "partial" logs it and returns the groups kept so far.
    """

    drop_tied_groups: bool = True
    filter_on: str = "score"
    oversample_factor: float = 1.0
    max_rounds: int = 10
    max_prompts: int = 0
    on_cap: str = "error"

    def validate(self) -> DynamicSamplingConfig:
        """Raise ValueError naming every bad ``rollout.dynamic_sampling.<key>``; returns self."""
        problems = []
        if self.filter_on not in FILTER_ON_CHOICES:
            problems.append(f"{SECTION}.filter_on must be one of {list(FILTER_ON_CHOICES)}, got {self.filter_on!r}")
        if not self.oversample_factor >= 1.0:
            problems.append(f"{SECTION}.oversample_factor must be >= 1, got {self.oversample_factor!r}")
        if not isinstance(self.max_rounds, int) or self.max_rounds < 1:
            problems.append(f"{SECTION}.max_rounds must be an integer >= 1, got {self.max_rounds!r}")
        if not isinstance(self.max_prompts, int) or self.max_prompts < 0:
            problems.append(f"{SECTION}.max_prompts must be an integer >= 0 (0: no cap), got {self.max_prompts!r}")
        if self.on_cap not in ON_CAP_CHOICES:
            problems.append(f"{SECTION}.on_cap must be one of {list(ON_CAP_CHOICES)}, got {self.on_cap!r}")
        if problems:
            raise ValueError(f"invalid {SECTION} config:\n  " + "\n  ".join(problems))
        return self


@dataclasses.dataclass
class DynamicSamplingResult:
    """The kept groups, in generation order: K records, their K x G completions and [K, G] rewards.

    metrics: rounds, prompts drawn, groups kept / dropped (tied, invalid) / surplus, keep rate, cap hit.
    """

    records: List[PromptRecord]
    completions: List[List[Any]]
    rewards: RewardBatch
    metrics: Dict[str, float]


def round_seed(seed: int, step: int, round_index: int) -> int:
    """The sampling seed of generation round ``round_index`` of training step ``step``, in [0, 2**31).

    A function of (``rollout.seed``, step, round) only, so a run resumed from a checkpoint draws
    exactly the samples the uninterrupted run drew; the engines derive each request's seed from
    it and the request's (prompt, sample) position (see ``SGLangEngine.generate``).
    """
    digest = hashlib.blake2b(f"{seed}/{step}/{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


def tied_groups(values: torch.Tensor) -> torch.Tensor:
    """Which groups have all-equal values (no within-group contrast; a group of one always ties).

    Args:
        values: [P, G] per-response values of P groups.
    Returns:
        [P] bool.
    """
    return (values == values[:, :1]).all(dim=1)


def sample_groups(
    next_prompts: Callable[[int], Sequence[PromptRecord]],
    generate: Callable[[Sequence[PromptRecord]], List[List[Any]]],
    score: Callable[[Sequence[PromptRecord], List[List[Any]]], RewardBatch],
    num_groups: int,
    config: DynamicSamplingConfig,
) -> DynamicSamplingResult:
    """Collect ``num_groups`` groups with contrast, generating round after round.

    Each round draws ceil(missing * oversample_factor) prompts with ``next_prompts(count)``, samples
    their groups with ``generate(records)`` (G completions per record, e.g. ``engine.generate(
    [r.prompt_ids for r in records], params, n=G)``) and scores them with ``score(records,
    completions)`` (e.g. ``RewardScorer.score_completions``). Groups with an invalid response (aborted,
    or skipped after a reward failure) are dropped, and so are tied groups when ``drop_tied_groups``.
    Groups kept beyond ``num_groups`` are discarded (counted as surplus). When ``max_rounds`` or
    ``max_prompts`` runs out first, ``on_cap`` decides: raise :class:`DynamicSamplingError` or
    return the partial batch (K < num_groups; possibly 0).
    """
    config.validate()
    if num_groups < 1:
        raise ValueError(f"num_groups must be >= 1, got {num_groups}")
    records: List[PromptRecord] = []
    completions: List[List[Any]] = []
    batches: List[RewardBatch] = []
    counts = {"rounds": 0, "prompts": 0, "kept": 0, "dropped_tied": 0, "dropped_invalid": 0, "reward_failed": 0}
    while counts["kept"] < num_groups:
        missing = num_groups - counts["kept"]
        request = math.ceil(missing * config.oversample_factor)
        if config.max_prompts:
            request = min(request, config.max_prompts - counts["prompts"])
        if counts["rounds"] == config.max_rounds or request <= 0:
            break
        round_records = list(next_prompts(request))
        round_completions = generate(round_records)
        batch = score(round_records, round_completions)
        if batch.num_groups != len(round_records) or len(round_completions) != len(round_records):
            raise ValueError(
                f"round {counts['rounds']}: {len(round_records)} prompts but {len(round_completions)} completion "
                f"groups and {batch.num_groups} reward groups"
            )
        invalid = ~batch.valid.all(dim=1)
        values = batch.score if config.filter_on == "score" else batch.reward
        tied = (tied_groups(values) & ~invalid) if config.drop_tied_groups else torch.zeros_like(invalid)
        keep = (~invalid & ~tied).nonzero().flatten()
        counts["rounds"] += 1
        counts["prompts"] += len(round_records)
        counts["dropped_invalid"] += int(invalid.sum())
        counts["dropped_tied"] += int(tied.sum())
        counts["reward_failed"] += int(batch.failed.sum())
        counts["kept"] += len(keep)
        records.extend(round_records[i] for i in keep.tolist())
        completions.extend(round_completions[i] for i in keep.tolist())
        batches.append(batch.select(keep))

    surplus = max(0, counts["kept"] - num_groups)
    cap_hit = counts["kept"] < num_groups
    metrics = {
        "dynamic_sampling/rounds": float(counts["rounds"]),
        "dynamic_sampling/prompts": float(counts["prompts"]),
        "dynamic_sampling/groups_kept": float(min(counts["kept"], num_groups)),
        "dynamic_sampling/groups_dropped_tied": float(counts["dropped_tied"]),
        "dynamic_sampling/groups_dropped_invalid": float(counts["dropped_invalid"]),
        "dynamic_sampling/groups_surplus": float(surplus),
        "dynamic_sampling/keep_rate": counts["kept"] / counts["prompts"] if counts["prompts"] else 0.0,
        "dynamic_sampling/cap_hit": float(cap_hit),
    }
    if cap_hit:
        failed = (
            (
                f" (the reward function failed on {counts['reward_failed']} responses, whose reward.on_failure "
                f"scores tie their groups: fix it first)"
            )
            if counts["reward_failed"]
            else ""
        )
        message = (
            f"dynamic sampling kept {counts['kept']} of {num_groups} groups after {counts['rounds']} round(s) and "
            f"{counts['prompts']} prompts ({counts['dropped_tied']} groups dropped with tied {config.filter_on}s, "
            f"{counts['dropped_invalid']} as invalid): the cap {SECTION}.max_rounds={config.max_rounds} / "
            f"max_prompts={config.max_prompts} was hit{failed}. Raise the cap or the oversample_factor, or use data "
            f"of a difficulty that splits the groups"
        )
        if config.on_cap == "error":
            raise DynamicSamplingError(f"{message}; or set {SECTION}.on_cap=partial to train on the partial batch")
        logger.warning("%s; training on the partial batch (%s.on_cap=partial)", message, SECTION)
    rewards = RewardBatch.cat(batches).select(torch.arange(min(counts["kept"], num_groups)))
    return DynamicSamplingResult(records[:num_groups], completions[:num_groups], rewards, metrics)
