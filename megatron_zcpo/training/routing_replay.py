"""Mixture-of-experts routing replay: record each token's experts in one pass and route by them in another (R2, R3).

An MoE policy's log-probs depend on which experts its router picks, and a router near a tie picks
differently when its input moves by a rounding error: between the rollout engine and the trainer
(different kernels), or between the experience pass and the update passes of one rollout (the
first mini-batch's optimizer step moves the router and every layer below it). Routing replay
removes that mismatch (``train.routing_replay``):

* ``experience`` (R2): the experience pass records each token's top-k experts per MoE layer; every
  update pass of the rollout routes each token to those experts.
* ``rollout`` (R3): the rollout engine's experts (SGLang's ``return_routed_experts``, the embedded
  engine's) are replayed in the experience pass and in every update pass.
* ``none``: each pass routes freely; with engine routing attached the metrics still compare.

Only the discrete choice is replayed: the gate weights are the router's own scores at the replayed
experts (``scores.gather``), so the router keeps its gradient, as megatron-core's own
``RouterReplay`` does. The hook is megatron-core's: every ``TopKRouter`` asks its
``router_replay`` for the top-k; :class:`RouterTap` takes that slot on each policy router (the
frozen reference routes freely) and remembers both the router's own choice and the experts used.

A token is named by (sample index, position in the sample's sequence), whatever micro-batch,
packing, context-parallel chunk or sequence-parallel shard it sits in (:func:`router_token_map`),
so routing recorded in the experience pass's micro-batches replays in the update's differently
grouped ones. Per step and rank the routing of this rank's samples and this stage's MoE layers is
kept as {sample: int16 [sequence, layers, top-k]} on the CPU.

Metrics (fractions over this step's tokens, all ranks): ``routing/rollout_token_mismatch`` (tokens
whose experts differ from the engine's in at least one layer, experience pass),
``routing/rollout_pair_mismatch`` (the same per token and layer), ``routing/update_pair_mismatch``
(update passes: experts used vs the reference: the engine's, or R2's recorded; 0 under replay)
and ``routing/update_router_drift`` (update passes: the router's own choice vs the reference).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.training.batch import MicroBatch, RolloutSample
from megatron_zcpo.utils.runtime import unwrap

MODES = ("none", "experience", "rollout")


class RouterTap:
    """Takes megatron-core's ``router.router_replay`` slot of one router (global layer ``layer``).

    ``target`` [tokens, k] (with ``replayed`` [tokens] bool: which tokens follow it) is set for the
    next forward; ``chosen`` / ``used`` keep the router's own top-k and the experts actually used
    in the last forward (router token order).
    """

    def __init__(self, layer: int):
        self.layer = layer
        self.target: Optional[torch.Tensor] = None
        self.replayed: Optional[torch.Tensor] = None
        self.chosen: Optional[torch.Tensor] = None
        self.used: Optional[torch.Tensor] = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """megatron-core's replay call: (gate scores [tokens, k], expert indices [tokens, k])."""
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        self.chosen = self.used = chosen.detach()
        if self.target is None:
            return probs, chosen
        if self.target.shape != chosen.shape:
            raise RuntimeError(
                f"routing replay of layer {self.layer}: {tuple(self.target.shape)} recorded experts "
                f"for a router that sees {tuple(chosen.shape)} tokens x top-k"
            )
        replayed = self.replayed.to(chosen.device).unsqueeze(-1)
        used = torch.where(replayed, self.target.to(chosen.device, chosen.dtype), chosen)
        self.used = used
        return scores.gather(1, used), used


def router_token_map(
    mb: MicroBatch, sequence_lengths: Sequence[int], sp_rank: int = 0, sp_size: int = 1
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Which token each row of this rank's router input is: (sample [n], position [n]) int64.

    megatron's layers see a micro-batch as [s, b, h] (sequence-major), scattered along s over the
    TP ranks under sequence parallelism (``sp_size`` = TP, this rank's chunk ``sp_rank``); a router
    flattens it to n = s/sp_size * b rows. Padding (a row past its sequence, packing and CP
    padding, a padding micro-batch) gets sample -1. ``sequence_lengths[i]``: sample i's sequence
    length (:attr:`RolloutSample.sequence_length`).
    """
    rows, width = mb.tokens.shape
    indices = torch.tensor(mb.sample_indices, dtype=torch.long)
    lengths = torch.tensor([sequence_lengths[i] for i in mb.sample_indices], dtype=torch.long)
    position = mb.position_ids.cpu().long()
    if mb.packed_seq_params is None:  # padded rows [b, S]: row r is sample r
        owner = indices.unsqueeze(1).expand(rows, width)
        valid = position < lengths.unsqueeze(1)
    elif not mb.sample_indices:  # a padding micro-batch
        owner, valid = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.bool)
    else:  # one packed row [1, T]: each sequence's (CP-local: 1/CP of its padded length) tokens in turn
        packed = mb.packed_seq_params
        bounds = (
            (packed.cu_seqlens_q_padded if packed.cu_seqlens_q_padded is not None else packed.cu_seqlens_q).cpu().long()
        )
        context_parallel = int(bounds[-1]) // width
        ordinal = torch.repeat_interleave(torch.arange(len(indices)), (bounds[1:] - bounds[:-1]) // context_parallel)
        owner, valid = indices[ordinal].unsqueeze(0), position < lengths[ordinal].unsqueeze(0)
    owner = torch.where(valid, owner, torch.full_like(owner, -1))
    chunk = width // sp_size
    pick = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    return owner.t()[pick].reshape(-1), position.t()[pick].reshape(-1)


@dataclass
class StepRouting:
    """One rollout step's routing on this rank, each as {sample: int16 [sequence, layers of this stage, k]}.

    ``engine``: the rollout engine's experts (when the samples carry them); ``reference``: what the
    update passes compare with and, under replay, route by: the experience pass's record (R2) or
    the engine's; ``pairs``: metric name -> [differing, total] (token, layer) pairs;
    ``token_flags``: {sample: bool [sequence]} tokens whose experience-pass experts differ from the
    engine's in some layer.
    """

    engine: Dict[int, torch.Tensor] = field(default_factory=dict)
    reference: Dict[int, torch.Tensor] = field(default_factory=dict)
    pairs: Dict[str, List[int]] = field(default_factory=dict)
    token_flags: Dict[int, torch.Tensor] = field(default_factory=dict)

    def count(self, name: str, differing: int, total: int) -> None:
        entry = self.pairs.setdefault(name, [0, 0])
        entry[0] += differing
        entry[1] += total


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[n, k] x [n, k] -> [n] bool: the same set of experts (order free)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


class RoutingReplay:
    """Routing record / replay / comparison on the routers of this rank's policy stage.

    ``mode`` is ``train.routing_replay``; ``top_k`` the model's experts per token. Create it once
    per trainer (it takes the routers' replay slots), then per step :meth:`begin` and, around every
    forward of a pass (``ModelChunks.around_forward``), :meth:`micro_batch`.
    """

    def __init__(self, policy, mode: str, top_k: int, sp_size: int = 1, sp_rank: int = 0):
        from megatron.core.transformer.moe.router import TopKRouter

        if mode not in MODES:
            raise ValueError(f"train.routing_replay must be one of {MODES}, got {mode!r}")
        self.mode, self.top_k, self.sp_size, self.sp_rank = mode, top_k, sp_size, sp_rank
        self.taps: List[RouterTap] = []
        self._routers = []
        for module in unwrap(policy).modules():
            if isinstance(module, TopKRouter):
                module.router_replay = RouterTap(module.layer_number - 1)  # megatron numbers layers from 1
                self.taps.append(module.router_replay)
                self._routers.append(module)
        self.taps.sort(key=lambda tap: tap.layer)
        self.step: Optional[StepRouting] = None
        self._lengths: Sequence[int] = ()

    def begin(self, samples: Sequence[RolloutSample], mine: Sequence[int]) -> StepRouting:
        """This step's :class:`StepRouting` for this rank's samples ``mine``: the engine's experts
        of this stage's layers when the samples carry them (``RolloutSample.routed_experts``).
        Raises ValueError naming the sample when R3 has no (or misshaped) engine routing."""
        self._lengths = [s.sequence_length for s in samples]
        self.step = StepRouting()
        carried = [i for i in mine if samples[i].routed_experts is not None]
        if self.mode == "rollout" and len(carried) < len(mine):
            missing = next(i for i in mine if samples[i].routed_experts is None)
            raise ValueError(
                f"train.routing_replay=rollout: sample {missing} carries no routed experts (the engine "
                f"must return them: SGLang >= 0.5.7 with --enable-return-routed-experts, or the "
                f"embedded engine)"
            )
        layers = torch.tensor([tap.layer for tap in self.taps], dtype=torch.long)
        for i in carried:
            routing = torch.as_tensor(samples[i].routed_experts)
            if routing.dim() < 2 or routing.shape[0] != self._lengths[i] or routing[0].numel() % self.top_k:
                raise ValueError(
                    f"sample {i}: routed experts of shape {tuple(routing.shape)} do not cover its "
                    f"{self._lengths[i]} input tokens x (layers x top-{self.top_k})"
                )
            self.step.engine[i] = routing.reshape(routing.shape[0], -1, self.top_k)[:, layers].to(torch.int16)
        if self.mode != "experience":
            self.step.reference = self.step.engine
        return self.step

    def _targets(
        self, routing: Dict[int, torch.Tensor], owner: torch.Tensor, position: torch.Tensor, slot: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """(``routing``'s experts [n, k] int64, known [n] bool) of layer ``slot`` for mapped tokens."""
        target = torch.zeros(owner.numel(), self.top_k, dtype=torch.long)
        known = torch.zeros(owner.numel(), dtype=torch.bool)
        for sample in owner.unique().tolist():
            if sample in routing:
                rows = owner == sample
                target[rows] = routing[sample][position[rows], slot].long()
                known |= rows
        return target, known

    @contextlib.contextmanager
    def micro_batch(self, mb: MicroBatch, pass_name: str) -> Iterator[None]:
        """Around one forward of this stage on ``mb`` in pass ``pass_name`` ("experience" or
        "update"): set the replayed experts, then record and compare what the routers did."""
        step = self.step
        if step is None or not self.taps:
            yield
            return
        owner, position = router_token_map(mb, self._lengths, self.sp_rank, self.sp_size)
        # The experience pass compares with (and under R3 routes by) the engine; the update passes
        # with the reference (R2's record or the engine's).
        routing = step.engine if pass_name == "experience" else step.reference
        targets = [self._targets(routing, owner, position, slot) for slot in range(len(self.taps))] if routing else []
        replay = self.mode == "rollout" or (self.mode == "experience" and pass_name == "update")
        for tap, (target, known) in zip(self.taps, targets if replay else []):
            tap.target, tap.replayed = target, known
        try:
            yield
        finally:
            for tap in self.taps:
                tap.target = tap.replayed = None
        if targets:
            self._compare(pass_name, owner, position, targets)
        if pass_name == "experience" and self.mode == "experience":
            self._record(owner, position)

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Within the block the policy's routers route freely, unrecorded: the reference forward of a
        LoRA policy (the same routers, adapters off) neither replays nor overwrites the pass's record."""
        taps = [router.router_replay for router in self._routers]
        for router in self._routers:
            router.router_replay = None
        try:
            yield
        finally:
            for router, tap in zip(self._routers, taps):
                router.router_replay = tap

    def _record(self, owner: torch.Tensor, position: torch.Tensor) -> None:
        """R2: keep each token's experts from this experience-pass forward."""
        chosen = torch.stack([tap.chosen.cpu() for tap in self.taps], dim=1).to(torch.int16)  # [n, layers, k]
        for sample in owner.unique().tolist():
            if sample < 0:
                continue
            store = self.step.reference.get(sample)
            if store is None:
                store = self.step.reference[sample] = torch.zeros(
                    self._lengths[sample], len(self.taps), self.top_k, dtype=torch.int16
                )
            rows = owner == sample
            store[position[rows]] = chosen[rows]

    def _compare(self, pass_name: str, owner, position, targets) -> None:
        """Count (token, layer) pairs whose experts differ from the reference (and, against the
        engine in the experience pass, flag the tokens)."""
        step, layers_differ = self.step, []
        for tap, (target, known) in zip(self.taps, targets):
            chosen, used = tap.chosen.cpu(), tap.used.cpu()
            if pass_name == "experience":
                differ = ~_same_experts(chosen, target) & known
                step.count("rollout_pair_mismatch", int(differ.sum()), int(known.sum()))
                layers_differ.append(differ)
            else:
                step.count("update_pair_mismatch", int((~_same_experts(used, target) & known).sum()), int(known.sum()))
                step.count("update_router_drift", int((~_same_experts(chosen, target) & known).sum()), int(known.sum()))
        if layers_differ:
            differ = torch.stack(layers_differ).any(dim=0)
            for sample in owner.unique().tolist():
                if sample in step.engine:
                    flags = step.token_flags.setdefault(sample, torch.zeros(self._lengths[sample], dtype=torch.bool))
                    rows = owner == sample
                    flags[position[rows]] |= differ[rows]

    def metrics(self, mine: Sequence[int]) -> Dict[str, float]:
        """The step's routing fractions (see the module doc), the same on every rank. Collective
        (all ranks): (token, layer) pairs are disjoint across ranks (samples over DP, chunks over
        CP and SP, layers over PP), so they add up; a token's flags are ORed over the ranks that
        hold its layers and chunks, then counted once per data-parallel replica."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_zcpo.utils.devices import compute_device

        step = self.step
        names = ("rollout_pair_mismatch", "update_pair_mismatch", "update_router_drift")
        pairs = torch.tensor(
            [step.pairs.get(name, [0, 0]) for name in names] if step else [[0, 0]] * 3,
            dtype=torch.float64,
            device=compute_device(),
        )
        dist.all_reduce(pairs)
        out = {f"routing/{name}": float(d / t) for name, (d, t) in zip(names, pairs.tolist()) if t > 0}
        compared = [i for i in mine if step is not None and i in step.engine]  # the same on the replica's ranks
        flags = torch.cat(
            [torch.zeros(0, dtype=torch.bool)]
            + [step.token_flags.get(i, torch.zeros(self._lengths[i], dtype=torch.bool)) for i in compared]
        )
        flags = flags.to(compute_device(), torch.float32)
        for group in (ps.get_model_parallel_group(), ps.get_context_parallel_group()):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        counted = torch.tensor([float(flags.sum()), float(flags.numel())], dtype=torch.float64, device=compute_device())
        dist.all_reduce(counted, group=ps.get_data_parallel_group())
        if counted[1] > 0:
            out["routing/rollout_token_mismatch"] = float(counted[0] / counted[1])
        return out
