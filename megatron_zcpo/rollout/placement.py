"""Colocated placement: the phase machine that hands every GPU back and forth between the trainer and the engine.

With ``rollout.placement=colocated`` the rollout engine (SGLang servers launched with
``--enable-memory-saver`` on the training GPUs, one per group of the server's TP size, or the
embedded engine) and the trainer share the devices, so at any moment only one of them holds its
big memory. One step goes through three phases, in this order, on every rank:

- generate: the engine holds its weights, KV cache and CUDA graphs; the trainer's parameters,
  gradients and optimizer states are on the host.
- train (:meth:`ColocatedPhases.to_train`): the engine releases everything (after a flush: a
  release must find it idle); once this rank's device has the room (a release may answer before
  the memory is free) the trainer's state comes back.
- update (:meth:`ColocatedPhases.to_update`): the optimizer states and gradients leave, the engine
  resumes its ``weights`` only, generation is paused, and the caller pushes the weights (CUDA IPC or
  disk); :meth:`ColocatedPhases.to_generate` then offloads the parameters, resumes the rest and only
  then continues generation (a request let through earlier would run on the freed KV cache), and
  health-checks the servers it lost (the one phase where they can generate; the next push brings
  the healthy ones back).

So the device holds at most max(trainer state, engine weights + trainer parameters, engine): never
both sides' full memory. At start-up the engine comes first (servers load their weights at launch
or are attached running): :func:`release_for_training` empties it before the trainer builds its
model, and the machine starts in the train phase. The engine side acts on rank 0 (it drives every
server); the ranks meet between the two sides' moves (``barrier``). Each transition checks what is
resident against :data:`RESIDENT` and raises :class:`~megatron_zcpo.rollout.memory.MemoryPhaseError`
otherwise.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

from megatron_zcpo.rollout.memory import WEIGHTS, MemoryPhaseError

PLACEMENTS = ("disaggregated", "colocated")
TRAINER_PARTS = ("params", "grads", "optimizer")
# What may be on the device in each phase: (trainer parts, engine regions; "*" = all the engine's).
RESIDENT = {
    "generate": ((), ("*",)),
    "train": (TRAINER_PARTS, ()),
    "update": (("params",), (WEIGHTS,)),
}
# The phase each transition starts from.
_FROM = {"train": ("generate",), "update": ("train",), "generate": ("update",)}


class ColocatedPhases:
    """This rank's side of colocated placement.

    ``trainer_state``: this rank's :class:`~megatron_zcpo.megatron.offload.TrainingStateOffload`;
    ``engine``: the rollout engine on rank 0 (None on the other ranks); ``barrier``: makes every
    rank meet (the run's Rank0Wait); ``free_bytes``: this rank's free device memory (None: not
    measurable, e.g. a CPU) — after a release, the trainer's state comes back only once it fits,
    polled every ``poll_s`` for up to ``release_timeout_s``; ``after_offload``: hands freed memory
    back to the device (``torch.cuda.empty_cache``). Starts in "train": the engine released
    everything (:func:`release_for_training`), the trainer's state is on the device. ``history``
    lists the phases entered, for logs and tests.
    """

    def __init__(
        self,
        trainer_state,
        engine=None,
        *,
        barrier: Callable[[], None] = lambda: None,
        free_bytes: Optional[Callable[[], Optional[int]]] = None,
        release_timeout_s: float = 300.0,
        poll_s: float = 0.5,
        after_offload: Callable[[], None] = lambda: None,
    ):
        self.trainer_state, self.engine, self.barrier = trainer_state, engine, barrier
        self.free_bytes, self.release_timeout_s, self.poll_s = free_bytes, release_timeout_s, poll_s
        self.after_offload = after_offload
        self.phase = "train"
        self.history: List[str] = ["train"]
        self.seconds: Dict[str, float] = {}  # the last entry into each phase took this long
        self._started = 0.0
        self.tags = colocatable_tags(engine) if engine is not None else ()
        self._check()

    def __repr__(self) -> str:
        return f"ColocatedPhases(phase={self.phase!r}, tags={self.tags})"

    # -- transitions ----------------------------------------------------------------------------

    def to_train(self) -> None:
        """The engine releases all its memory; the trainer's state comes back once it fits."""
        self._enter("train")
        if self.engine is not None:
            self.engine.release_memory(list(self.tags))
        self.barrier()
        self._wait_for_room(self.trainer_state.nbytes(TRAINER_PARTS))
        self.trainer_state.onload(TRAINER_PARTS)
        self._done("train")

    def to_update(self) -> None:
        """The optimizer states and gradients leave; the engine resumes its weights and pauses generation."""
        self._enter("update")
        self.trainer_state.offload(["optimizer", "grads"])
        self.after_offload()
        self.barrier()
        if self.engine is not None:
            self.engine.resume_memory([WEIGHTS])
            self.engine.pause_generation()
        self.barrier()
        self._done("update")

    def to_generate(self) -> None:
        """After the push: the parameters leave; the engine resumes its KV cache (and graphs), then generates;
        its lost servers that generate again rejoin at the next push."""
        self._enter("generate")
        self.trainer_state.offload(["params"])
        self.after_offload()
        self.barrier()
        if self.engine is not None:
            self.engine.resume_memory([tag for tag in self.tags if tag != WEIGHTS])
            self.engine.continue_generation()
            check_returning = getattr(self.engine, "check_returning_servers", None)  # SGLang's, not the embedded
            if check_returning is not None:
                check_returning()
        self.barrier()
        self._done("generate")

    # -- checks ---------------------------------------------------------------------------------

    def _enter(self, phase: str) -> None:
        self._started = time.perf_counter()
        if self.phase not in _FROM[phase]:
            raise MemoryPhaseError(f"colocated placement: {phase} cannot follow {self.phase} (order: {_FROM})")

    def _done(self, phase: str) -> None:
        self.seconds[phase] = time.perf_counter() - self._started
        self.phase = phase
        self.history.append(phase)
        self._check()

    def _check(self) -> None:
        """What is resident on this rank must be what :data:`RESIDENT` allows in this phase."""
        trainer, engine = RESIDENT[self.phase]
        resident = [part for part in TRAINER_PARTS if part not in self.trainer_state.offloaded]
        if sorted(resident) != sorted(trainer):
            raise MemoryPhaseError(
                f"colocated phase {self.phase}: the trainer holds {resident}, expected {list(trainer)}"
            )
        memory = getattr(self.engine, "memory", None)  # an engine that keeps its own ledger (embedded)
        if memory is not None:
            expected = set(memory.tags) if engine == ("*",) else set(engine)
            held = set(memory.tags) - memory.released
            if held != expected:
                raise MemoryPhaseError(
                    f"colocated phase {self.phase}: the engine holds {sorted(held)}, expected {sorted(expected)}"
                )

    def _wait_for_room(self, needed: int) -> None:
        """Until ``free_bytes()`` >= ``needed`` (a release that answered before its memory was free)."""
        if self.free_bytes is None:
            return
        deadline = time.monotonic() + self.release_timeout_s
        while True:
            free = self.free_bytes()
            if free is None or free >= needed:
                return
            if time.monotonic() > deadline:
                raise MemoryPhaseError(
                    f"the engine's memory is still held {self.release_timeout_s:g} s after its release answered: "
                    f"{free} B free, the trainer needs {needed} B (rollout.sglang.client.update_timeout_s)"
                )
            time.sleep(self.poll_s)


def colocatable_tags(engine) -> Tuple[str, ...]:
    """The memory tags ``engine`` releases; raises ``MemoryPhaseError`` when it cannot be colocated."""
    tags = tuple(engine.memory_tags())
    if WEIGHTS not in tags:
        raise MemoryPhaseError(
            f"rollout.placement=colocated: the {type(engine).__name__} cannot release its memory "
            "(SGLang servers need --enable-memory-saver: rollout.sglang.launch and examples/common/sglang_node.py "
            "with a colocated run config pass it)"
        )
    return tags


def release_for_training(engine) -> None:
    """Start-up of a colocated run (rank 0, before the trainer builds its model): the engine, launched
    or attached with its memory resident, releases all of it."""
    engine.release_memory(list(colocatable_tags(engine)))


def device_memory_hooks() -> Tuple[Optional[Callable[[], Optional[int]]], Callable[[], None]]:
    """(``free_bytes``, ``after_offload``) of :class:`ColocatedPhases` for this process's device: on
    CUDA the driver's free memory plus what this process's allocator caches unused, and
    ``empty_cache`` (the engine's processes can only map what the trainer handed back to the driver);
    without CUDA (None, nothing)."""
    from megatron_zcpo.utils.devices import has_cuda

    if not has_cuda():
        return None, lambda: None
    import torch

    def free_bytes() -> int:
        return int(torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated())

    return free_bytes, torch.cuda.empty_cache
