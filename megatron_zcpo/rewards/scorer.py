"""Scores groups of responses: the reward function in the worker pool, failure handling and overlong shaping."""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence

import torch

from megatron_zcpo.rewards.config import RewardConfig
from megatron_zcpo.rewards.overlong import overlong_loss_mask, overlong_penalty
from megatron_zcpo.rewards.pool import RewardWorkerPool

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward could not be produced (names the prompt and response)."""


class RewardFailureRateError(RewardError):
    """More of a rollout's reward calls failed than ``reward.max_failed_fraction`` allows."""


@dataclasses.dataclass
class FailureTally:
    """Reward calls and failed calls since :meth:`RewardScorer.start_tally`; ``example``: the first
    failure (where, its input and the reward's error)."""

    calls: int = 0
    failed: int = 0
    example: Optional[str] = None


@dataclasses.dataclass
class RewardBatch:
    """Per-response reward results of P groups of G responses; every field is [P, G].

    reward: float32, ``score + overlong_penalty`` (0 where not ``valid``).
    score: float32, the reward function's value (after failure handling).
    overlong_penalty: float32, the soft overlong penalty (0 when disabled).
    truncated: bool, generation stopped at the length cap.
    failed: bool, the reward call raised, timed out or killed its worker.
    valid: bool, False for aborted responses and for groups skipped after a failure ("skip-group").
    loss_mask: bool, the response takes part in the loss: ``valid`` and, with overlong filtering,
        not ``truncated``.
    """

    reward: torch.Tensor
    score: torch.Tensor
    overlong_penalty: torch.Tensor
    truncated: torch.Tensor
    failed: torch.Tensor
    valid: torch.Tensor
    loss_mask: torch.Tensor

    def select(self, groups: torch.Tensor) -> RewardBatch:
        """The rows (groups) ``groups`` ([K] int64 indices or [P] bool mask), as a new batch of K groups."""
        return RewardBatch(**{f.name: getattr(self, f.name)[groups] for f in dataclasses.fields(self)})

    @staticmethod
    def cat(batches: Sequence[RewardBatch]) -> RewardBatch:
        """Concatenate batches along the group dimension (all must have the same group size G)."""
        if not batches:
            raise ValueError("RewardBatch.cat needs at least one batch")
        return RewardBatch(
            **{f.name: torch.cat([getattr(b, f.name) for b in batches]) for f in dataclasses.fields(RewardBatch)}
        )

    @property
    def num_groups(self) -> int:
        return self.reward.shape[0]

    def metrics(self) -> Dict[str, float]:
        """Scalar summaries for the metrics log (means over valid responses)."""
        valid = self.valid
        count = int(valid.sum())

        def mean_over_valid(values: torch.Tensor) -> float:
            return float(values[valid].float().mean()) if count else math.nan

        return {
            "reward/mean": mean_over_valid(self.reward),
            "reward/score_mean": mean_over_valid(self.score),
            "reward/overlong_penalty_mean": mean_over_valid(self.overlong_penalty),
            "reward/truncated_fraction": mean_over_valid(self.truncated),
            "reward/failed": float(self.failed.sum()),
            "reward/invalid_responses": float((~valid).sum()),
        }


def _check_shapes(responses, ground_truths, response_lengths: torch.Tensor, truncated: torch.Tensor) -> None:
    """Raise ValueError unless P groups of G responses match ground_truths [P] and the [P, G] tensors."""
    num_groups, group_size = response_lengths.shape
    if len(responses) != num_groups or len(ground_truths) != num_groups:
        raise ValueError(
            f"responses ({len(responses)} groups) and ground_truths ({len(ground_truths)}) must match "
            f"response_lengths [{num_groups}, {group_size}]"
        )
    if truncated.shape != response_lengths.shape:
        raise ValueError(f"truncated {tuple(truncated.shape)} must match response_lengths {(num_groups, group_size)}")
    for p, group in enumerate(responses):
        if len(group) != group_size:
            raise ValueError(f"group {p} has {len(group)} responses, expected {group_size}")


class RewardScorer:
    """Scores groups of responses with ``config.function`` in a :class:`RewardWorkerPool`.

    Use as a context manager (or call :meth:`close`) so the workers stop. Not thread-safe: one
    ``score`` at a time.
    """

    def __init__(self, config: RewardConfig):
        self.config = config.validate()
        self.pool = RewardWorkerPool(
            config.function,
            num_workers=config.num_workers,
            timeout_s=config.timeout_s,
            start_method=config.start_method,
        )
        self.tally = FailureTally()

    def start_tally(self) -> None:
        """Count reward calls and failures from now on (a rollout's), for :meth:`check_failure_rate`."""
        self.tally = FailureTally()

    def check_failure_rate(self, what: str) -> Dict[str, float]:
        """``reward/failed_calls`` and ``reward/failed_fraction`` of the calls since :meth:`start_tally`.

        Raises :class:`RewardFailureRateError` (naming ``what``, e.g. "step 3's rollout", the count
        and the first failure's input and error) when the fraction is above
        ``reward.max_failed_fraction``.
        """
        tally, config = self.tally, self.config
        fraction = tally.failed / tally.calls if tally.calls else 0.0
        if fraction > config.max_failed_fraction:
            raise RewardFailureRateError(
                f"reward function {config.function!r} failed on {tally.failed} of the {tally.calls} responses of "
                f"{what} ({fraction:.0%}, above reward.max_failed_fraction={config.max_failed_fraction:g}); the run "
                f"stops rather than train on the scores reward.on_failure={config.on_failure!r} makes up for them. "
                f"Fix the reward function (or raise reward.max_failed_fraction). The first failure, on {tally.example}"
            )
        return {"reward/failed_calls": float(tally.failed), "reward/failed_fraction": fraction}

    def score(
        self,
        responses: Sequence[Sequence[str]],
        ground_truths: Sequence[str],
        response_lengths: torch.Tensor,
        truncated: torch.Tensor,
        metadata: Optional[Sequence[Mapping[str, Any]]] = None,
        scorable: Optional[torch.Tensor] = None,
    ) -> RewardBatch:
        """Score P groups of G responses.

        Args:
            responses: P lists of G response texts.
            ground_truths: P ground-truth answers.
            response_lengths: [P, G] generated tokens per response.
            truncated: [P, G] bool, stopped at the length cap.
            metadata: P dicts passed to the reward function (``uid`` is also used in error messages).
            scorable: [P, G] bool; False responses (e.g. aborted) are not scored and are not valid.
        Returns:
            a :class:`RewardBatch` of [P, G] tensors.
        Raises:
            RewardError: a NaN or non-number result, or a failure under ``on_failure="error"``.
        """
        _check_shapes(responses, ground_truths, response_lengths, truncated)
        num_groups, group_size = response_lengths.shape
        metadata = metadata if metadata is not None else [{} for _ in range(num_groups)]
        if scorable is None:
            scorable = torch.ones(num_groups, group_size, dtype=torch.bool)
        score, failed, valid = self._run_function(responses, ground_truths, metadata, scorable)
        if self.config.overlong_penalty:
            penalty = overlong_penalty(
                response_lengths,
                self.config.max_response_length,
                self.config.overlong_buffer,
                self.config.overlong_penalty_factor,
            )
        else:
            penalty = torch.zeros(num_groups, group_size, dtype=torch.float32)
        loss_mask = (valid & overlong_loss_mask(truncated)) if self.config.overlong_filter else valid.clone()
        return RewardBatch(
            reward=torch.where(valid, score + penalty, torch.zeros_like(score)),
            score=score,
            overlong_penalty=penalty,
            truncated=truncated.clone(),
            failed=failed,
            valid=valid,
            loss_mask=loss_mask,
        )

    def _run_function(self, responses, ground_truths, metadata, scorable: torch.Tensor):
        """(score, failed, valid), each [P, G], of the reward function on the ``scorable`` [P, G] responses."""
        num_groups, group_size = scorable.shape
        positions = [(p, j) for p in range(num_groups) for j in range(group_size) if scorable[p, j]]
        outcomes = self.pool.map([(responses[p][j], ground_truths[p], dict(metadata[p])) for p, j in positions])

        score = torch.zeros(num_groups, group_size, dtype=torch.float32)
        failed = torch.zeros(num_groups, group_size, dtype=torch.bool)
        valid = scorable.clone()
        failures = []
        self.tally.calls += len(positions)
        for (p, j), outcome in zip(positions, outcomes):
            where = self._describe(p, j, metadata[p])
            if outcome.status == "ok" and outcome.value is not None and not math.isnan(outcome.value):
                score[p, j] = outcome.value
            elif outcome.status == "ok":
                raise RewardError(
                    f"reward function {self.config.function!r} returned NaN for {where}; "
                    f"response begins {responses[p][j][:120]!r}"
                )
            elif outcome.status == "invalid":
                raise RewardError(
                    f"reward function {self.config.function!r} returned {outcome.error} for {where}; expected a number"
                )
            else:  # raised, timed out or killed its worker: on_failure decides
                failed[p, j] = True
                failures.append((where, outcome))
                if self.tally.example is None:
                    self.tally.example = (
                        f"{where} ({outcome.status}): response {responses[p][j][:200]!r}, ground truth "
                        f"{ground_truths[p]!r}:\n{(outcome.error or '').rstrip()}"
                    )
        first_failures = self.tally.failed == 0  # of this tally: only those print the reward's traceback
        self.tally.failed += len(failures)
        if failures:
            self._handle_failures(failures, score, failed, valid, first_failures)
        return score, failed, valid

    def score_completions(self, records: Sequence[Any], completions: Sequence[Sequence[Any]], tokenizer) -> RewardBatch:
        """Score engine completions: ``completions[p]`` are the G :class:`Completion` s of ``records[p]``.

        Records need ``answer``, ``uid``, ``data_source`` and ``extra_info`` (:class:`PromptRecord`);
        responses are decoded with ``tokenizer.batch_decode(skip_special_tokens=True)``; finish reason
        "length" marks truncation and "abort" makes a response unscorable (not valid).
        """
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completion groups")
        group_size = len(completions[0]) if completions else 0
        flat = [c for group in completions for c in group]
        texts = tokenizer.batch_decode([list(c.output_ids) for c in flat], skip_special_tokens=True)
        responses = [texts[p * group_size : (p + 1) * group_size] for p in range(len(records))]
        shape = (len(records), group_size)
        lengths = torch.tensor([len(c.output_ids) for c in flat], dtype=torch.int64).reshape(shape)
        truncated = torch.tensor([c.finish_reason == "length" for c in flat], dtype=torch.bool).reshape(shape)
        scorable = torch.tensor([c.finish_reason != "abort" for c in flat], dtype=torch.bool).reshape(shape)
        metadata = [{"uid": r.uid, "data_source": r.data_source, "extra_info": r.extra_info} for r in records]
        return self.score(responses, [r.answer for r in records], lengths, truncated, metadata, scorable)

    @staticmethod
    def _describe(prompt_index: int, response_index: int, metadata: Mapping[str, Any]) -> str:
        uid = metadata.get("uid")
        return f"prompt {prompt_index}" + (f" (uid {uid})" if uid else "") + f", response {response_index}"

    def _handle_failures(
        self,
        failures: List[tuple],
        score: torch.Tensor,
        failed: torch.Tensor,
        valid: torch.Tensor,
        with_traceback: bool = True,
    ) -> None:
        """Apply ``on_failure`` to the failed calls (already marked in ``failed``) and log them (the
        first failure's traceback when ``with_traceback``)."""
        config = self.config
        first_where, first = failures[0]
        counts = collections.Counter(outcome.status for _, outcome in failures)
        if config.on_failure == "error":
            raise RewardError(
                f"reward function {config.function!r} failed on {first_where} ({first.status}; "
                f"{len(failures)} failures in this batch; set reward.on_failure to zero/min/skip-group to "
                f"continue):\n{first.error}"
            )
        logger.warning(
            "reward function %r: %d call(s) failed (%s), handled as %r; first on %s%s",
            config.function,
            len(failures),
            ", ".join(f"{count} {status}" for status, count in sorted(counts.items())),
            config.on_failure,
            first_where,
            f":\n{first.error}" if with_traceback else " (a traceback as above)",
        )
        if config.on_failure == "min":
            score[failed] = config.min_reward
        elif config.on_failure == "skip-group":
            valid[failed.any(dim=1)] = False

    def close(self) -> None:
        """Stop the worker pool."""
        self.pool.close()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
