"""One rollout step as its passes share it: samples, assignment, micro-batches, experience, coefficients."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_zcpo.algorithms.response_stats import ResponseStats
from megatron_zcpo.training.batch import RolloutSample, StepMicroBatches


@dataclass
class MinibatchAssignment:
    """Which samples this rank trains on: the rollout's mini-batches and this DP rank's share of each."""

    minibatches: List[List[int]]  # global indices per mini-batch
    mine: List[List[int]]  # this DP rank's share of each mini-batch

    @property
    def my_indices(self) -> List[int]:
        """Every sample index this DP rank trains on, sorted."""
        return sorted(i for share in self.mine for i in share)


@dataclass
class ResponseTokenStats:
    """One response's per-token statistics from the experience pass (last pipeline stage only); with
    context parallelism, of this rank's tokens of the response (``token_index`` says which)."""

    old_logprob: torch.Tensor  # [R] log pi_old(y_t) at the sampling temperature
    ref_logprob: torch.Tensor  # [R] log pi_ref(y_t) at the sampling temperature (k1 = old - ref)
    entropy: torch.Tensor  # [R] entropy of pi_old at the sampling temperature
    kl: torch.Tensor  # [R] conditional KL(pi_old || pi_ref) over the full vocabulary, temperature 1
    token_index: torch.Tensor  # [R] int64 positions in the response (all of them without context parallelism)


@dataclass
class RolloutStep:
    """One rollout step, created once per rollout by PolicyTrainer.train_step and filled pass by pass.

    samples: the whole rollout (every rank); assignment: the mini-batches and this rank's share;
    experience: {sample index: ResponseTokenStats} of this rank's samples (the experience pass;
    last stage, {} elsewhere); coefficients: [N] frozen per-response coefficients and stats: the
    ResponseStats they were calibrated from (calibration; last stage, None elsewhere);
    micro_batches: this rank's micro-batches, each share collated once (None for a step put
    together by hand: every use collates afresh); index: the trainer step (0-based); routing: what
    the MoE routers were replayed with and recorded (None for a dense model). After
    calibration nothing changes until the next rollout: diagnostics and the update only read it.
    """

    samples: Sequence[RolloutSample]
    assignment: MinibatchAssignment
    experience: Dict[int, ResponseTokenStats] = field(default_factory=dict)
    coefficients: Optional[torch.Tensor] = None
    stats: Optional[ResponseStats] = None
    micro_batches: Optional[StepMicroBatches] = None
    index: int = 0
    routing: Optional[Any] = None  # MoE models: the step's StepRouting (megatron_zcpo.training.routing_replay)
