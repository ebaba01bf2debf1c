"""Per-GPU memory planner for ZCPO training with megatron-core: breakdown, fit check, layout search.

The memory model (what is counted, and how) is :mod:`megatron_zcpo.planning.memory_model`; this
module totals it per (stage, phase) into a :class:`MemoryPlan` and searches the layouts that fit.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.memory_model import (
    COMPONENTS,
    GIB,
    RECOMPUTE_CHOICES,
    Hardware,
    Layout,
    Workload,
    divisors,
    stage_parameters,
    stage_phase_components,
)


@dataclass
class MemoryPlan:
    """Per-GPU memory of one layout on its most loaded (stage, phase); bytes unless said.

    ``components`` maps each name of :data:`COMPONENTS` to bytes; ``totals`` maps every evaluated
    "stage/phase" to its total, so the runner-up is visible too.
    """

    model: ModelConfig
    layout: Layout
    workload: Workload
    hardware: Hardware
    stage: str
    phase: str
    parameters_on_gpu: int
    components: Dict[str, float]
    totals: Dict[str, float]

    @property
    def total_bytes(self) -> float:
        """Sum of the components of the most loaded stage and phase."""
        return sum(self.components.values())

    @property
    def capacity_bytes(self) -> float:
        """Memory of one GPU."""
        return self.hardware.gpu_memory_gib * GIB

    @property
    def margin_bytes(self) -> float:
        """The margin a fitting plan leaves besides its reserve (``Hardware.margin_fraction`` of the GPU)."""
        return self.hardware.margin_fraction * self.capacity_bytes

    @property
    def verdict(self) -> str:
        """Headroom policy (:mod:`~megatron_zcpo.planning.memory_model`): "fits" (the total, the
        ``overhead`` reserve for the CUDA context, NCCL buffers, the push bucket and fragmentation
        included, leaves the margin), "tight" (it does not: a run may go out of memory; warned,
        not refused), "does not fit" (the modelled tensors alone exceed the GPU: refused)."""
        if self.total_bytes + self.margin_bytes <= self.capacity_bytes:
            return "fits"
        return "tight" if self.total_bytes - self.components["overhead"] <= self.capacity_bytes else "does not fit"

    @property
    def fits(self) -> bool:
        """Whether the plan fits with its reserve and margin (:attr:`verdict` "fits")."""
        return self.verdict == "fits"

    def tight_reason(self) -> str:
        """Why a tight plan is tight (empty unless :attr:`verdict` is "tight")."""
        if self.verdict != "tight":
            return ""
        free = self.capacity_bytes - self.total_bytes
        reserve = self.components["overhead"]
        if free >= 0:
            return (
                f"{free / GIB:.2f} GiB left besides the {reserve / GIB:.2f} GiB reserve (CUDA context, NCCL "
                f"buffers, push bucket, fragmentation), under the {self.margin_bytes / GIB:.2f} GiB margin "
                "for the model's error and routing beyond the imbalance factor"
            )
        return (
            f"the modelled tensors use {-free / GIB:.2f} GiB of the {reserve / GIB:.2f} GiB reserve for the CUDA "
            "context, NCCL buffers, the push bucket and fragmentation"
        )

    def to_dict(self) -> dict:
        """JSON-ready form: layout, workload, hardware, components and totals in GiB, verdict."""
        return {
            "layout": dataclasses.asdict(self.layout),
            "workload": dataclasses.asdict(self.workload),
            "hardware": dataclasses.asdict(self.hardware),
            "num_gpus": self.layout.num_gpus,
            "model_parameters": self.model.num_parameters,
            "active_parameters": self.model.num_active_parameters,
            "parameters_on_gpu": self.parameters_on_gpu,
            "most_loaded": {"stage": self.stage, "phase": self.phase},
            "components_gib": {key: value / GIB for key, value in self.components.items()},
            "total_gib": self.total_bytes / GIB,
            "capacity_gib": self.capacity_bytes / GIB,
            "totals_gib": {key: value / GIB for key, value in self.totals.items()},
            "fits": self.fits,
            "verdict": self.verdict,
            "tight_reason": self.tight_reason(),
        }


def plan_memory(model: ModelConfig, layout: Layout, workload: Workload, hardware: Hardware = Hardware()) -> MemoryPlan:
    """Per-GPU memory of ``model`` trained at ``layout`` on ``workload``, for the most loaded GPU.

    Evaluates the first and the last pipeline stage (one stage when PP = 1) in the train and the
    experience phase and returns the breakdown of the largest. Raises ``ValueError`` naming the
    offending key on an inconsistent input.
    """
    model.validate()
    layout.validate(model)
    workload.validate()
    hardware.validate()
    stages = ("first",) if layout.pipeline_parallel == 1 else ("first", "last")
    evaluated = {
        (stage, phase): stage_phase_components(model, layout, workload, hardware, stage, phase)
        for stage in stages
        for phase in ("train", "experience")
    }
    totals = {key: sum(value.values()) for key, value in evaluated.items()}
    stage, phase = max(totals, key=lambda key: totals[key])
    return MemoryPlan(
        model=model,
        layout=layout,
        workload=workload,
        hardware=hardware,
        stage=stage if layout.pipeline_parallel > 1 else "only",
        phase=phase,
        parameters_on_gpu=stage_parameters(model, layout, stage),
        components=evaluated[(stage, phase)],
        totals={f"{s}/{p}": total for (s, p), total in totals.items()},
    )


def candidate_layouts(
    model: ModelConfig,
    num_gpus: int,
    *,
    hardware: Hardware = Hardware(),
    base: Layout = Layout(),
    recompute_options: Sequence[str] = RECOMPUTE_CHOICES,
) -> List[Layout]:
    """Every valid layout of ``model`` on exactly ``num_gpus`` GPUs, most preferred first.

    TP divides the node size (TP across nodes is never worth its all-reduces), PP divides the
    layers, CP is a power of two, DP takes the rest. Sequence parallelism and the distributed
    optimizer come from ``base``; no virtual pipeline. Order: fewest GPUs per model replica
    (TP * PP * CP), then the cheapest recompute in ``recompute_options`` order, then the larger TP
    (inside a node), then the smaller CP (its ring exchange sits on every layer), then the smaller
    PP (its bubble shrinks with the many micro-batches of an RL step). Mixture-of-experts models
    also try every expert parallelism that divides the experts and a stage's ranks (with
    ``base``'s expert tensor parallelism, and 1), the smaller EP first (less all-to-all).
    """
    if num_gpus < 1:
        raise ValueError(f"num_gpus must be at least 1, got {num_gpus}")
    for option in recompute_options:
        if option not in RECOMPUTE_CHOICES:
            raise ValueError(f"recompute_options: {option!r} is not one of {RECOMPUTE_CHOICES}")
    powers_of_two = [2**k for k in range(num_gpus.bit_length()) if num_gpus % 2**k == 0]
    candidates, seen = [], set()
    for tp in divisors(hardware.gpus_per_node):
        for pp in divisors(model.num_layers):
            for cp in powers_of_two:
                if num_gpus % (tp * pp * cp):
                    continue
                for (rank, recompute), (ep, etp) in itertools.product(
                    enumerate(recompute_options), _expert_options(model, base)
                ):
                    layout = dataclasses.replace(
                        base,
                        tensor_parallel=tp,
                        pipeline_parallel=pp,
                        context_parallel=cp,
                        data_parallel=num_gpus // (tp * pp * cp),
                        virtual_pipeline=None,
                        recompute=recompute,
                        expert_parallel=ep,
                        expert_tensor_parallel=etp,
                    )
                    same = (tp, pp, cp, recompute, ep, layout.expert_tensor)  # ETP unset is ETP = TP
                    try:
                        layout.validate(model)
                    except ValueError:
                        continue
                    if same not in seen:
                        seen.add(same)
                        candidates.append(((tp * pp * cp, rank, -tp, cp, pp, ep), layout))
    return [layout for _, layout in sorted(candidates, key=lambda item: item[0])]


def _expert_options(model: ModelConfig, base: Layout) -> List[tuple]:
    """(EP, ETP) pairs to try: ``base``'s for a dense model; every EP dividing the experts, with
    ``base``'s ETP and with ETP 1, for a mixture-of-experts model."""
    if not model.is_moe:
        return [(base.expert_parallel, base.expert_tensor_parallel)]
    return [(ep, etp) for ep in divisors(model.num_experts) for etp in (base.expert_tensor_parallel, 1)]


def fitting_plans(
    model: ModelConfig,
    workload: Workload,
    num_gpus: int,
    *,
    hardware: Hardware = Hardware(),
    base: Layout = Layout(),
    recompute_options: Sequence[str] = RECOMPUTE_CHOICES,
) -> List[MemoryPlan]:
    """Plans of every layout from :func:`candidate_layouts` that fits, most preferred first."""
    plans = (
        plan_memory(model, layout, workload, hardware)
        for layout in candidate_layouts(
            model, num_gpus, hardware=hardware, base=base, recompute_options=recompute_options
        )
    )
    return [plan for plan in plans if plan.fits]


def suggest_layout(
    model: ModelConfig,
    workload: Workload,
    num_gpus: int,
    *,
    hardware: Hardware = Hardware(),
    base: Layout = Layout(),
    recompute_options: Sequence[str] = RECOMPUTE_CHOICES,
) -> Optional[MemoryPlan]:
    """The plan of the most preferred fitting layout on ``num_gpus`` GPUs, or None if none fits."""
    plans = fitting_plans(model, workload, num_gpus, hardware=hardware, base=base, recompute_options=recompute_options)
    return plans[0] if plans else None


def render_plan(plan: MemoryPlan, width: int = 88) -> str:
    """The plan as a plain-text table (rich), one row per component, then the total and verdict."""
    from rich.console import Console
    from rich.table import Table

    table = Table()
    table.add_column("component")
    table.add_column("memory", justify="right")
    table.add_column("share", justify="right")
    for name in COMPONENTS:
        value = plan.components[name]
        label = "overhead (reserve)" if name == "overhead" else name
        table.add_row(label, format_bytes(value), f"{value / plan.total_bytes:.0%}")
    table.add_section()
    table.add_row(
        "total",
        format_bytes(plan.total_bytes),
        f"{plan.total_bytes / plan.capacity_bytes:.0%} of {plan.capacity_bytes / GIB:.1f}",
    )
    verdict = {"fits": "fits", "tight": "TIGHT: " + plan.tight_reason(), "does not fit": "does NOT fit"}[plan.verdict]
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None, force_terminal=False)
    console.print(
        f"{plan.layout.describe()}  ({plan.layout.num_gpus} GPUs; most loaded: {plan.stage} stage, {plan.phase} phase)",
        soft_wrap=True,
    )
    console.print(table)
    console.print(f"{format_count(plan.parameters_on_gpu)} parameters on the GPU; {verdict}.", soft_wrap=True)
    if plan.model.is_moe and plan.layout.expert_parallel > 1:
        console.print(
            f"experts: the busiest expert-parallel rank, {plan.workload.expert_imbalance:.2f}x the mean routed tokens "
            "(--expert-imbalance)",
            soft_wrap=True,
        )
    workload = plan.workload
    console.print(
        f"logits_kl: the token statistics' {workload.token_stats_kernels} backend "
        f"(train.token_stats_backend={workload.token_stats_backend})",
        soft_wrap=True,
    )
    return buffer.getvalue()


def format_count(count: float) -> str:
    """A parameter count a reader can take in: ``32.76B``, ``494.0M``, ``310.3K``, ``96``."""
    for scale, suffix, digits in ((1e9, "B", 2), (1e6, "M", 1), (1e3, "K", 1)):
        if count >= scale:
            return f"{count / scale:,.{digits}f}{suffix}"
    return f"{count:.0f}"


def format_bytes(value: float) -> str:
    """Memory with its unit, so that a tiny model's components are not all ``0.00``: ``55.68 GiB``,
    ``3.4 MiB``, ``12.0 KiB``."""
    if value >= GIB:
        return f"{value / GIB:.2f} GiB"
    for scale, unit in ((2**20, "MiB"), (2**10, "KiB")):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"
