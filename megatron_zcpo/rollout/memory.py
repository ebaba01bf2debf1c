"""An inference engine's GPU memory regions under SGLang's memory saver, and a per-GPU ledger of who holds what.

SGLang started with ``--enable-memory-saver`` frees and re-maps its memory by tag through
``/release_memory_occupation`` and ``/resume_memory_occupation`` {tags}: "weights", "kv_cache"
(0.5.3.post3) and "cuda_graph" (0.5.23); no tags means every tag the release knows. A released
region's content is gone (the weights must be pushed again after ``weights`` is resumed), and
generating, or loading weights, into a released region is a use after free. :class:`EngineMemory`
is that state machine for one engine (the mock server and the embedded engine keep one, so a phase
out of order fails loudly on a CPU); :class:`MemoryLedger` books bytes per GPU for every owner
(engine regions, the trainer's parameters, gradients, optimizer states) and refuses a booking that
would exceed a GPU's capacity: memory is never booked twice.
"""

from __future__ import annotations

import threading
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from megatron_zcpo.rollout.engine import RolloutError

WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
MEMORY_TAGS = (WEIGHTS, KV_CACHE, CUDA_GRAPH)
# What each action needs resident (SGLang: generation runs the weights, the KV pool and the graphs).
NEEDS = {"generate": (WEIGHTS, KV_CACHE, CUDA_GRAPH), "update_weights": (WEIGHTS,)}


class MemoryPhaseError(RolloutError):
    """An engine was asked to use memory it had released, or to release/resume out of order."""


class MemoryLedger:
    """Bytes booked per GPU by (owner, region); ``capacity_bytes`` per GPU (None: unbounded).

    Thread-safe (the mock server books from its handlers, the trainer from the recipe).
    """

    def __init__(self, gpus: int, capacity_bytes: Optional[int] = None):
        self.gpus, self.capacity_bytes = int(gpus), capacity_bytes
        self._booked: Dict[Tuple[int, str, str], int] = {}
        self._lock = threading.Lock()

    def book(self, gpu: int, owner: str, region: str, nbytes: int) -> None:
        """Book ``nbytes`` on ``gpu`` for ``owner``'s ``region``; raises ``MemoryPhaseError`` when that
        region is booked already or the GPU would exceed its capacity (naming who holds the rest)."""
        with self._lock:
            key = (gpu, owner, region)
            if key in self._booked:
                raise MemoryPhaseError(f"GPU {gpu}: {owner}'s {region} is booked twice")
            used = self._used(gpu)
            if self.capacity_bytes is not None and used + nbytes > self.capacity_bytes:
                raise MemoryPhaseError(
                    f"GPU {gpu}: booking {owner}'s {region} ({nbytes} B) exceeds its {self.capacity_bytes} B; "
                    f"held: {self._holders(gpu)}"
                )
            self._booked[key] = int(nbytes)

    def free(self, gpu: int, owner: str, region: str) -> None:
        """Free ``owner``'s ``region`` on ``gpu`` (an error when it was not booked)."""
        with self._lock:
            if self._booked.pop((gpu, owner, region), None) is None:
                raise MemoryPhaseError(f"GPU {gpu}: {owner}'s {region} is freed but was not booked")

    def free_bytes(self, gpu: int) -> Optional[int]:
        """What ``gpu`` has left (None without a capacity)."""
        with self._lock:
            return None if self.capacity_bytes is None else self.capacity_bytes - self._used(gpu)

    def holders(self, gpu: int) -> Dict[str, int]:
        """{"owner/region": bytes} booked on ``gpu``."""
        with self._lock:
            return self._holders(gpu)

    def _used(self, gpu: int) -> int:
        return sum(n for (g, _, _), n in self._booked.items() if g == gpu)

    def _holders(self, gpu: int) -> Dict[str, int]:
        return {f"{owner}/{region}": n for (g, owner, region), n in self._booked.items() if g == gpu}


class EngineMemory:
    """One engine's memory regions on its GPUs (``gpus``), resident or released, booked in ``ledger``.

    ``sizes``: bytes per GPU of each region (the tags this engine's release knows: ``tags``).
    Starts resident (a server loads its weights and allocates its KV pool at launch).
    """

    def __init__(
        self,
        owner: str,
        gpus: Sequence[int],
        sizes: Dict[str, int],
        ledger: Optional[MemoryLedger] = None,
        tags: Sequence[str] = MEMORY_TAGS,
    ):
        self.owner, self.gpus, self.sizes, self.tags = owner, list(gpus), dict(sizes), tuple(tags)
        self.ledger = ledger or MemoryLedger(max(self.gpus, default=0) + 1)
        self.released: set = set()
        self.pending: List[str] = []  # released on the answer, freed later (a late release, see free_pending)
        for tag in self.tags:
            self._book(tag)

    def _book(self, tag: str) -> None:
        for gpu in self.gpus:
            self.ledger.book(gpu, self.owner, tag, self.sizes.get(tag, 0))

    def _free(self, tag: str) -> None:
        for gpu in self.gpus:
            self.ledger.free(gpu, self.owner, tag)

    def check_tags(self, tags: Optional[Iterable[str]]) -> List[str]:
        """The tags a request names (None or empty: every tag), checked against this release's."""
        chosen = list(dict.fromkeys(tags or self.tags))  # a tag named twice is one region
        unknown = [tag for tag in chosen if tag not in self.tags]
        if unknown:
            raise MemoryPhaseError(f"{self.owner}: unknown memory tags {unknown} (this release has {self.tags})")
        return chosen

    def release(self, tags: Optional[Iterable[str]], late: bool = False) -> List[str]:
        """Release ``tags`` (an error when one is released already). ``late``: mark them released
        but keep them booked until :meth:`free_pending` (a release that answers before the memory is free)."""
        chosen = self.check_tags(tags)
        again = [tag for tag in chosen if tag in self.released]
        if again:
            raise MemoryPhaseError(f"{self.owner}: {again} released twice")
        for tag in chosen:
            self.released.add(tag)
            if late:
                self.pending.append(tag)
            else:
                self._free(tag)
        return chosen

    def free_pending(self) -> None:
        """Free what a late release left booked."""
        while self.pending:
            self._free(self.pending.pop())

    def resume(self, tags: Optional[Iterable[str]]) -> List[str]:
        """Resume ``tags`` (an error when one is resident: it would be booked twice)."""
        chosen = self.check_tags(tags)
        resident = [tag for tag in chosen if tag not in self.released]
        if resident:
            raise MemoryPhaseError(f"{self.owner}: {resident} resumed but not released")
        self.free_pending()
        for tag in chosen:
            self._book(tag)
            self.released.discard(tag)
        return chosen

    def require(self, action: str) -> None:
        """Raise ``MemoryPhaseError`` when ``action`` ("generate", "update_weights") needs a released region."""
        missing = [tag for tag in NEEDS[action] if tag in self.tags and tag in self.released]
        if missing:
            raise MemoryPhaseError(f"{self.owner}: {action} while {missing} released (resume them first)")
