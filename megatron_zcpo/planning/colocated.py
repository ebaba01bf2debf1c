"""Per-GPU memory of colocated placement: the trainer and an SGLang engine on the same GPU, in turns.

A colocated GPU runs two phases (:mod:`megatron_zcpo.planning.step_time`): generation, with the
trainer's state offloaded to the host, and training, with the engine's memory released
(``release_memory_occupation``: weights and KV pool freed, refilled by the push). Each must fit:

* training: the trainer's peak of :func:`~megatron_zcpo.planning.planner.plan_memory` (reserve
  included) + what a released engine keeps (its CUDA context and CUDA-graph pools,
  :data:`ENGINE_RELEASED_BYTES`);
* generation: the engine's static pool (``mem_fraction_static`` x the GPU: weights + KV) + its
  runtime outside the pool (activations, CUDA graphs, :data:`ENGINE_RUNTIME_FRACTION` of the GPU)
  + the trainer's residue after offload (its reserve: CUDA context, NCCL buffers, fragmentation,
  the ``overhead`` row) + the push's bucket, which the trainer holds while the engine copies it
  (``rollout.sglang.client.bucket_bytes``, CUDA IPC).

:data:`ENGINE_RELEASED_BYTES` and :data:`ENGINE_RUNTIME_FRACTION` are assumptions, not measurements:
SGLang leaves ``1 - mem_fraction_static`` of the GPU for its runtime and sizes its default to
leave about that much. The same headroom policy as the planner's: "fits" leaves the margin,
"tight" does not (warned, the key to change named), "does not fit" only when the trainer's
modelled tensors alone exceed the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from megatron_zcpo.planning.memory_model import GIB
from megatron_zcpo.planning.planner import MemoryPlan

ENGINE_RELEASED_BYTES = 1.0 * GIB
ENGINE_RUNTIME_FRACTION = 0.05
MEM_FRACTION_KEY = "rollout.sglang.launch.mem_fraction_static"


@dataclass(frozen=True)
class ColocatedMemory:
    """The two phases of a colocated GPU: ``plan`` (the trainer's), the engine's ``mem_fraction``
    and the push's ``bucket_bytes``; bytes unless said."""

    plan: MemoryPlan
    mem_fraction: float
    bucket_bytes: float

    @property
    def training_bytes(self) -> float:
        """The trainer's peak beside a released engine."""
        return self.plan.total_bytes + ENGINE_RELEASED_BYTES

    @property
    def generation_bytes(self) -> float:
        """The engine's pool and runtime beside the offloaded trainer's residue and the push bucket."""
        capacity = self.plan.capacity_bytes
        engine = (self.mem_fraction + ENGINE_RUNTIME_FRACTION) * capacity
        return engine + self.plan.components["overhead"] + self.bucket_bytes

    @property
    def largest_mem_fraction(self) -> float:
        """The largest ``mem_fraction_static`` whose generation phase fits with the margin."""
        room = self.plan.capacity_bytes - self.plan.margin_bytes - self.plan.components["overhead"] - self.bucket_bytes
        return room / self.plan.capacity_bytes - ENGINE_RUNTIME_FRACTION

    @property
    def verdict(self) -> str:
        """ "fits", "tight" or "does not fit" (module docstring)."""
        if self.plan.verdict == "does not fit":
            return "does not fit"
        limit = self.plan.capacity_bytes - self.plan.margin_bytes
        return "fits" if max(self.training_bytes, self.generation_bytes) <= limit else "tight"

    def problems(self) -> List[str]:
        """What leaves no margin, each naming the key to change (empty when it fits)."""
        limit = self.plan.capacity_bytes - self.plan.margin_bytes
        found = []
        if self.generation_bytes > limit:
            found.append(
                f"generation: the engine's pool ({self.mem_fraction} of the GPU) and runtime, the trainer's reserve "
                f"and the {self.bucket_bytes / GIB:.2f} GiB push bucket need {self.generation_bytes / GIB:.2f} GiB: "
                f"lower {MEM_FRACTION_KEY} to {self.largest_mem_fraction:.2f} or below"
            )
        if self.training_bytes > limit:
            found.append(
                f"training: the trainer's {self.plan.total_bytes / GIB:.2f} GiB beside the released engine's "
                f"{ENGINE_RELEASED_BYTES / GIB:.2f} GiB leave no margin: see the layout above"
            )
        return found

    def to_dict(self) -> dict:
        """JSON-ready form, GiB."""
        return {
            "mem_fraction_static": self.mem_fraction,
            "training_gib": self.training_bytes / GIB,
            "generation_gib": self.generation_bytes / GIB,
            "capacity_gib": self.plan.capacity_bytes / GIB,
            "largest_mem_fraction_static": self.largest_mem_fraction,
            "verdict": self.verdict,
            "problems": self.problems(),
        }
