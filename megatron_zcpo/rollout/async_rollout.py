"""Asynchronous rollouts (``rollout.mode=async``): a producer keeps the engine busy with groups; the trainer
takes complete groups as soon as a step's worth exists; staleness is bounded by ``rollout.max_staleness``.

:class:`AsyncRollout` runs on global rank 0. Its thread admits prompts as groups
(:meth:`RolloutEngine.submit`: G samples each), scores every group as soon as its last sample has
finished, drops tied and invalid groups (dynamic sampling) and keeps the rest ready. The trainer's
:meth:`AsyncRollout.take` waits for ``prompts_per_step`` ready groups and takes the oldest; the
recipe pushes the weights after every step without draining (the engine pauses, the requests in
flight hold, and continue from their tokens: :mod:`megatron_zcpo.rollout.embedded_async`,
:mod:`megatron_zcpo.rollout.sglang.partial`), then calls :meth:`AsyncRollout.on_push`.

Versions: the trainer trains step s at weight version s (the version pushed after step s - 1), and
a token produced by version u is s - u versions stale there. Admission keeps it bounded: a group
admitted while the engine serves version v may be trained up to step v + k (k = ``max_staleness``),
and steps up to v + k train (v + k + 1) x B groups (B = ``prompts_per_step``), so groups are admitted
while taken + outstanding < (v + k + 1) x B: at most (k + 1) x B groups are in flight or ready. A
group dropped as tied or invalid frees its place at once (dynamic sampling's over-sampling needs no
``oversample_factor`` here: more admitted would only wait and age). Groups finish out of order, so a
slow one can still fall behind: ``on_stale`` "drop" drops every group with a token more
than k versions behind the step that would train it (counted in ``async/dropped_stale_groups``: no
trained token is ever staler than k), "correct" trains it with the importance-sampling correction
against each token's behaviour log-prob.

Checkpoints (:meth:`AsyncRollout.state`, plain values and tensors): the version, the counters, every
ready group whole (tokens, per-token versions and behaviour log-probs, rewards) and every group in
flight by its prompt. A resumed run trains the ready groups and generates the in-flight prompts again
from the start (their partial responses are not in the checkpoint), then draws new prompts where the
data position was: no prompt is trained twice or skipped.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import queue
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.rewards.scorer import RewardBatch
from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingConfig, DynamicSamplingError, tied_groups
from megatron_zcpo.rollout.engine import (
    STOP_POLL_S,
    Completion,
    RolloutEngine,
    RolloutError,
    RolloutInterrupted,
    SamplingParams,
)

ON_STALE = ("drop", "correct")
COUNTERS = ("admitted", "taken", "dropped_tied", "dropped_invalid", "dropped_stale")


def group_seed(seed: int, serial: int) -> int:
    """The sampling seed of the ``serial``-th group a run admits, in [0, 2**31)."""
    digest = hashlib.blake2b(f"{seed}/async/{serial}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**31


@dataclasses.dataclass
class AsyncGroup:
    """One prompt's G samples as the producer tracks them.

    ``serial``: admission order; ``index``: the prompt's row in the dataset's records (checkpoints);
    ``admitted_version``: the version the engine served when it was admitted; ``completions`` and
    ``rewards`` ([1, G]) once finished and scored."""

    serial: int
    record: PromptRecord
    index: int
    admitted_version: int
    future: Optional[concurrent.futures.Future] = None
    completions: Optional[List[Completion]] = None
    rewards: Optional[RewardBatch] = None

    @property
    def oldest_version(self) -> int:
        """The oldest weight version among its tokens (its admission version before it has any)."""
        versions = [v for c in self.completions or () for v in c.token_versions if v is not None]
        return min(versions, default=self.admitted_version)


@dataclasses.dataclass
class TakenGroups:
    """What :meth:`AsyncRollout.take` hands the trainer: K records, their K x G completions, [K, G] rewards."""

    records: List[PromptRecord]
    completions: List[List[Completion]]
    rewards: RewardBatch
    metrics: Dict[str, float]


class AsyncRollout:
    """The producer of asynchronous rollouts (module docstring).

    ``engine``: takes :meth:`RolloutEngine.submit`; ``dataset``: the prompt stream
    (:class:`~megatron_zcpo.data.dataset.PromptDataset`: ``next_batch``, ``records``); ``score``:
    (records, completions) -> RewardBatch; ``params``: the sampling parameters (each group gets its own
    seed from ``seed``); ``samples_per_prompt`` G; ``prompts_per_step`` B; ``max_staleness`` k;
    ``on_stale`` "drop" | "correct"; ``dynamic_sampling``: its ``drop_tied_groups``, ``filter_on`` and the
    cap on groups dropped while the trainer waits (``max_prompts``, else ``max_rounds`` x B; ``on_cap``). ``version``: the version the engine serves.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        dataset,
        score: Callable[[Sequence[PromptRecord], List[List[Completion]]], RewardBatch],
        params: SamplingParams,
        *,
        samples_per_prompt: int,
        prompts_per_step: int,
        max_staleness: int,
        on_stale: str,
        dynamic_sampling: DynamicSamplingConfig,
        seed: int,
        version: int,
    ):
        if on_stale not in ON_STALE:
            raise ValueError(f"rollout.on_stale must be one of {ON_STALE}, got {on_stale!r}")
        self.engine, self.dataset, self.score, self.params = engine, dataset, score, params
        self.group_size, self.batch, self.max_staleness, self.on_stale = (
            samples_per_prompt,
            prompts_per_step,
            max_staleness,
            on_stale,
        )
        self.sampling, self.seed, self.version = dynamic_sampling, seed, version
        self.cap = dynamic_sampling.max_prompts or dynamic_sampling.max_rounds * prompts_per_step
        self.counts = dict.fromkeys(COUNTERS, 0)
        self.since_take = dict.fromkeys(COUNTERS, 0)
        self.next_serial = 0
        self.in_flight: Dict[int, AsyncGroup] = {}  # submitted, not yet scored
        self.ready: List[AsyncGroup] = []
        self._finished: queue.Queue = queue.Queue()
        self._condition = threading.Condition()
        self._error: Optional[BaseException] = None
        self._closed = False
        self._thread: Optional[threading.Thread] = None
        self._index_of = {record.uid: row for row, record in enumerate(dataset.records)}
        self._pending_restore: List[AsyncGroup] = []

    # -- the trainer's side --------------------------------------------------------------------

    def start(self, state: Optional[Dict[str, Any]] = None) -> None:
        """Resume ``state`` (from :meth:`state`; None: a fresh run) and start the producer thread."""
        if state:
            self._restore(state)
        self._thread = threading.Thread(target=self._produce, name="async-rollout", daemon=True)
        self._thread.start()

    def take(self, trainer_version: int, stop_requested: Optional[Callable[[], int]] = None) -> TakenGroups:
        """``prompts_per_step`` ready groups, oldest first, for the step trained at ``trainer_version``;
        waits for them. Raises the producer's error, or :class:`DynamicSamplingError` when more than
        the cap of groups were dropped while waiting (``on_cap`` "error"; "partial": trains those ready),
        or ``RolloutInterrupted`` when ``stop_requested()`` (asked every ``STOP_POLL_S`` while waiting)
        says stop: nothing is taken, and the producer goes on (its state is what a checkpoint records)."""
        started = time.perf_counter()
        with self._condition:
            while True:
                self._raise_error()
                self._drop_stale(trainer_version)
                dropped = self.since_take["dropped_tied"] + self.since_take["dropped_invalid"]
                if len(self.ready) >= self.batch or (dropped > self.cap and self.ready):
                    break
                if dropped > self.cap and self.sampling.on_cap == "error":
                    raise DynamicSamplingError(
                        f"asynchronous rollouts dropped {dropped} groups (tied or invalid) while the trainer waited "
                        f"for {self.batch}, more than the cap {self.cap} (rollout.dynamic_sampling.max_prompts, else "
                        "max_rounds x prompts_per_step); set rollout.dynamic_sampling.on_cap=partial "
                        "to train on fewer groups, or use data of a difficulty that splits the groups"
                    )
                if stop_requested is not None and stop_requested():
                    raise RolloutInterrupted(f"a stop request while step {trainer_version + 1} waited for its groups")
                self._condition.wait(timeout=STOP_POLL_S if stop_requested is not None else 1.0)
            self.ready.sort(key=lambda g: (g.oldest_version, g.serial))
            taken, self.ready = self.ready[: self.batch], self.ready[self.batch :]
            self.counts["taken"] += len(taken)
            self.since_take["taken"] += len(taken)
            metrics = self._metrics(taken, trainer_version)
            self.since_take = dict.fromkeys(COUNTERS, 0)
            self._condition.notify_all()  # room to admit
        metrics["time/wait_for_data"] = time.perf_counter() - started
        return TakenGroups(
            [g.record for g in taken],
            [g.completions for g in taken],
            RewardBatch.cat([g.rewards for g in taken]),
            metrics,
        )

    def on_push(self, version: int) -> None:
        """The engine serves ``version`` now: ready groups it leaves behind are dropped (``on_stale`` drop)
        and admission has room again."""
        with self._condition:
            self.version = version
            self._drop_stale(version)
            self._condition.notify_all()

    def state(self) -> Dict[str, Any]:
        """The producer's checkpoint state (module docstring): plain values and tensors."""
        with self._condition:
            return {
                "data": self.dataset.state_dict(),
                "version": self.version,
                "next_serial": self.next_serial,
                "counts": dict(self.counts),
                "ready": [_group_state(g) for g in self.ready],
                "in_flight": [
                    {"serial": g.serial, "index": g.index, "admitted_version": g.admitted_version}
                    for g in sorted(self.in_flight.values(), key=lambda g: g.serial)
                ],
            }

    def close(self) -> None:
        """Stop admitting and end the requests in flight."""
        with self._condition:
            self._closed = True
            self._condition.notify_all()
        self._finished.put(None)
        if self._thread is not None:
            self._thread.join(timeout=60)
        self.engine.abort_requests()

    # -- the producer thread -------------------------------------------------------------------

    def _room(self) -> int:
        """Groups that may be admitted now (module docstring)."""
        allowed = (self.version + self.max_staleness + 1) * self.batch
        return allowed - self.counts["taken"] - len(self.in_flight) - len(self.ready)

    def _produce(self) -> None:
        try:
            for group in self._pending_restore:  # the prompts a checkpoint recorded in flight, first
                self._submit(group)
            self._pending_restore = []
            while True:
                for group in self._admit():
                    self._submit(group)
                try:
                    finished = self._finished.get(timeout=0.2)
                except queue.Empty:
                    continue
                if finished is None or self._closed:
                    return
                self._score(finished)
        except BaseException as error:  # handed to the trainer at its next take
            with self._condition:
                self._error = error
                self._condition.notify_all()

    def _admit(self) -> List[AsyncGroup]:
        """Draw the prompts there is room for and register them in flight, in one step with the data
        position (:meth:`state` sees both or neither)."""
        with self._condition:
            if self._closed:
                return []
            groups = []
            for record in self.dataset.next_batch(max(0, self._room())):
                groups.append(AsyncGroup(self.next_serial, record, self._index_of[record.uid], self.version))
                self.in_flight[self.next_serial] = groups[-1]
                self.next_serial += 1
                self._count("admitted")
            return groups

    def _submit(self, group: AsyncGroup) -> None:
        params = dataclasses.replace(self.params, seed=group_seed(self.seed, group.serial))
        group.future = self.engine.submit(group.record.prompt_ids, params, n=self.group_size)
        group.future.add_done_callback(lambda _, group=group: self._finished.put(group))

    def _score(self, group: AsyncGroup) -> None:
        """Score a finished group and file it: ready, or dropped (invalid, tied, stale)."""
        if group.future.cancelled():
            return
        group.completions = group.future.result()  # an engine error ends the producer (raised at take)
        group.rewards = self.score([group.record], [group.completions])
        invalid = not bool(group.rewards.valid.all())
        values = group.rewards.score if self.sampling.filter_on == "score" else group.rewards.reward
        tied = self.sampling.drop_tied_groups and bool(tied_groups(values)[0])
        with self._condition:
            self.in_flight.pop(group.serial, None)
            if invalid:
                self._count("dropped_invalid")
            elif tied:
                self._count("dropped_tied")
            else:
                self.ready.append(group)
                self._drop_stale(self.version)
            self._condition.notify_all()

    # -- bookkeeping (under the lock) ----------------------------------------------------------

    def _count(self, counter: str, groups: int = 1) -> None:
        self.counts[counter] += groups
        self.since_take[counter] += groups

    def _drop_stale(self, trainer_version: int) -> None:
        """``on_stale`` drop: ready groups with a token more than k versions behind ``trainer_version``."""
        if self.on_stale != "drop":
            return
        fresh = [g for g in self.ready if trainer_version - g.oldest_version <= self.max_staleness]
        self._count("dropped_stale", len(self.ready) - len(fresh))
        self.ready = fresh

    def _raise_error(self) -> None:
        error = self._error
        if error is None:
            return
        if isinstance(error, (RolloutError, DynamicSamplingError)):
            raise error
        raise RolloutError(f"the asynchronous rollout failed: {error!r}") from error

    def _metrics(self, taken: List[AsyncGroup], trainer_version: int) -> Dict[str, float]:
        lags = [trainer_version - v for g in taken for c in g.completions for v in c.token_versions]
        partial = [len(set(c.token_versions)) > 1 for g in taken for c in g.completions]
        kept = self.since_take["taken"]
        drawn = self.since_take["admitted"]
        return {
            "rollout/staleness_mean": sum(lags) / len(lags) if lags else 0.0,
            "rollout/staleness_max": float(max(lags, default=0)),
            "rollout/partial_fraction": sum(partial) / len(partial) if partial else 0.0,
            "async/groups_in_flight": float(len(self.in_flight)),
            "async/groups_ready": float(len(self.ready)),
            **{f"async/{name}_total": float(count) for name, count in self.counts.items()},
            "async/dropped_stale_groups": float(self.since_take["dropped_stale"]),
            "dynamic_sampling/prompts": float(drawn),
            "dynamic_sampling/groups_kept": float(kept),
            "dynamic_sampling/groups_dropped_tied": float(self.since_take["dropped_tied"]),
            "dynamic_sampling/groups_dropped_invalid": float(self.since_take["dropped_invalid"]),
        }

    def _restore(self, state: Dict[str, Any]) -> None:
        records = self.dataset.records
        self.dataset.load_state_dict(state["data"])
        self.version = int(state["version"])
        self.next_serial = int(state["next_serial"])
        self.counts = {name: int(state["counts"].get(name, 0)) for name in COUNTERS}
        self.ready = [_group_from_state(entry, records) for entry in state["ready"]]
        self._pending_restore = [
            AsyncGroup(int(e["serial"]), records[int(e["index"])], int(e["index"]), int(e["admitted_version"]))
            for e in state["in_flight"]
        ]
        for group in self._pending_restore:  # outstanding until generated again
            self.in_flight[group.serial] = group


def _group_state(group: AsyncGroup) -> Dict[str, Any]:
    """A ready group as checkpoint state."""
    return {
        "serial": group.serial,
        "index": group.index,
        "admitted_version": group.admitted_version,
        "completions": [
            {
                "prompt_ids": list(c.prompt_ids),
                "output_ids": list(c.output_ids),
                "output_logprobs": list(c.output_logprobs),
                "output_versions": c.token_versions,
                "finish_reason": c.finish_reason,
                "weight_version": c.weight_version,
            }
            for c in group.completions
        ],
        "rewards": {f.name: getattr(group.rewards, f.name) for f in dataclasses.fields(RewardBatch)},
    }


def _group_from_state(entry: Dict[str, Any], records: Sequence[PromptRecord]) -> AsyncGroup:
    index = int(entry["index"])
    return AsyncGroup(
        int(entry["serial"]),
        records[index],
        index,
        int(entry["admitted_version"]),
        completions=[Completion(**c) for c in entry["completions"]],
        rewards=RewardBatch(**{name: torch.as_tensor(value) for name, value in entry["rewards"].items()}),
    )
