"""The trainer's configuration: the ``parallel:`` and ``train:`` sections and the context-parallel limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_zcpo.megatron.model import MoETraining
from megatron_zcpo.utils.devices import KERNEL_BACKENDS, kernel_backend


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: model-parallel layout (DP = world / (TP*PP*CP))."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False
    # Timeout of every training process group's collectives (NCCL's watchdog kills the process past
    # it); rank 0's rollouts are waited for elsewhere (megatron_zcpo/recipe/rank0_wait.py).
    collective_timeout_s: float = 1800.0
    # Mixture-of-experts models: experts split over `expert` ranks (carved out of each stage's
    # TP x CP x DP ranks), each expert's MLP over `expert_tensor` ranks (null: as `tensor`).
    expert: int = 1
    expert_tensor: Optional[int] = None
    # Uneven pipeline stages (megatron-core's num_layers_in_first/last_pipeline_stage): the first and
    # last stage's layer counts, the other stages split the rest evenly; null: all stages even.
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    def validate(self) -> None:
        for key in ("tensor", "pipeline", "context", "expert"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if not self.collective_timeout_s > 0:
            raise ValueError(f"parallel.collective_timeout_s must be positive, got {self.collective_timeout_s}")
        for key in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1 (or null), got {getattr(self, key)}")
        if (self.first_stage_layers or self.last_stage_layers) and self.pipeline == 1:
            raise ValueError("parallel.first_stage_layers / parallel.last_stage_layers need parallel.pipeline > 1")
        if self.expert_tensor is not None and self.expert_tensor < 1:
            raise ValueError(f"parallel.expert_tensor must be >= 1 (or null), got {self.expert_tensor}")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tensor > 1")


IMPORTANCE_SAMPLING_MODES = ("truncate", "mask", "icepop")


@dataclass
class ImportanceSamplingConfig:
    """``train.importance_sampling``: the off-policy correction against the behaviour policy, per token.

    Per response token r = pi_old / pi_behaviour, with pi_behaviour the log-prob the rollout engine
    returned for that token (with partial rollouts each token's own weight version's; see
    :func:`megatron_zcpo.training.update.importance_weights`). ``mode`` "truncate" clamps r into
    [lower, upper] (truncated IS), "mask" weighs tokens inside it 1 and the rest 0, "icepop" keeps r
    inside it and zeroes the rest (IcePop's two-sided mask); a response with any token ratio below
    ``veto`` gets weight 0. ``sequence_mask``: a response whose geometric-mean ratio
    exp(mean log r) leaves [``sequence_lower``, ``sequence_upper``] gets weight 0 (sequence-level masking).
    """

    enabled: bool = False
    upper: float = 5.0
    lower: float = 0.5
    veto: float = 1e-4
    mode: str = "truncate"
    sequence_mask: bool = False
    sequence_lower: float = 0.5  # [ours: a response whose tokens are on average 2x less likely now]
    sequence_upper: float = 2.0  # [ours]

    def validate(self) -> None:
        if self.mode not in IMPORTANCE_SAMPLING_MODES:
            raise ValueError(
                f"train.importance_sampling.mode must be one of {IMPORTANCE_SAMPLING_MODES}, got {self.mode!r}"
            )
        if not 0 <= self.veto <= self.lower <= 1 <= self.upper:
            raise ValueError(
                "train.importance_sampling needs 0 <= veto <= lower <= 1 <= upper, got "
                f"veto={self.veto}, lower={self.lower}, upper={self.upper}"
            )
        if not 0 < self.sequence_lower <= 1 <= self.sequence_upper:
            raise ValueError(
                "train.importance_sampling needs 0 < sequence_lower <= 1 <= sequence_upper, got "
                f"sequence_lower={self.sequence_lower}, sequence_upper={self.sequence_upper}"
            )


@dataclass
class OptimizerSettings:
    """``train.optimizer``: AdamW through megatron-core's optimizer, LR schedule per rollout step.

    Rollout k (0-based) trains at the schedule's value at step k+1 (megatron's
    OptimizerParamScheduler): warm-up lr * (k+1) / warmup_steps, so the first rollout already
    learns; the decay reaches ``min_lr`` one step after the last rollout (``train.steps``).
    """

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 20
    schedule: str = "constant"  # constant | linear | cosine (decay after warm-up, over train.steps)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(
                f"train.optimizer needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}"
            )
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"train.optimizer.schedule must be constant|linear|cosine, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")


ROUTING_REPLAY_CHOICES = ("none", "experience", "rollout")


@dataclass
class TrainConfig:
    """The ``train:`` section: steps, batching and numerics of the update."""

    steps: int = 10
    seed: int = 1234
    mini_batches: int = 1
    micro_batch_tokens: int = 4096  # per micro-batch, before the context-parallel split
    packing: str = "thd"  # thd: padding-free packed sequences | padded: right-padded rows
    bf16: bool = False
    kl_chunk_size: int = 1024
    # Kernels of the token statistics (megatron_zcpo.ops): auto = Triton on CUDA when triton imports
    # (each kind of call checked against torch on its first use), else torch; torch | triton.
    token_stats_backend: str = "auto"
    reference_offload: bool = False
    recompute: Optional[str] = None  # None | "selective" | "full"
    selfcheck_tolerance: float = 1e-4  # step-0 policy == reference check; < 0 disables it
    # Start-up check of the loaded policy against transformers (megatron_zcpo.convert.verify):
    # None = on when model.path is a Hugging Face directory of at most 8B parameters; tolerance on
    # the max |log-prob difference|, None = 1e-3 (fp32) or 0.5 (bf16).
    verify_against_hf: Optional[bool] = None
    verify_tolerance: Optional[float] = None
    max_skipped_steps: int = 8  # this many consecutive optimizer steps skipped (non-finite) stop the run
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    importance_sampling: ImportanceSamplingConfig = field(default_factory=ImportanceSamplingConfig)
    moe: MoETraining = field(default_factory=MoETraining)
    # Mixture-of-experts routing replay (megatron_zcpo.training.routing_replay): none; experience
    # (R2: the update passes route each token as the experience pass did); rollout (R3: experience
    # and update passes route as the rollout engine did).
    routing_replay: str = "none"

    def validate(self) -> None:
        for key in ("steps", "mini_batches", "micro_batch_tokens", "kl_chunk_size", "max_skipped_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.packing not in ("thd", "padded"):
            raise ValueError(f"train.packing must be 'thd' or 'padded', got {self.packing!r}")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"train.recompute must be null, 'selective' or 'full', got {self.recompute!r}")
        if self.routing_replay not in ROUTING_REPLAY_CHOICES:
            raise ValueError(
                f"train.routing_replay must be one of {ROUTING_REPLAY_CHOICES}, got {self.routing_replay!r}"
            )
        if self.verify_tolerance is not None and not self.verify_tolerance > 0:
            raise ValueError(f"train.verify_tolerance must be > 0 (or null), got {self.verify_tolerance!r}")
        if self.token_stats_backend not in KERNEL_BACKENDS:
            raise ValueError(
                f"train.token_stats_backend must be one of {', '.join(KERNEL_BACKENDS)}, "
                f"got {self.token_stats_backend!r}"
            )


def check_token_stats_backend(train: TrainConfig, device) -> str:
    """ "torch" or "triton": what ``train.token_stats_backend`` selects on ``device`` (the ranks' compute device).

    Checked where the ranks start rather than in :meth:`TrainConfig.validate`, which may run on a
    machine without the ranks' GPU or triton. Raises ValueError naming the key where the backend
    cannot run there (triton without triton, or on CPU tensors without Triton's interpreter).
    """
    try:
        return kernel_backend(device, train.token_stats_backend)
    except ValueError as error:
        raise ValueError(f"train.token_stats_backend={train.token_stats_backend}: {error}") from None


def check_context_parallel(parallel: ParallelConfig, train: TrainConfig, algorithm, diagnostics: bool) -> None:
    """Refuse what context parallelism cannot do (each response is spread over the CP ranks).

    ``algorithm``: a built registry Algorithm; ``diagnostics``: whether diagnostics will run.
    Raises ValueError naming the key; a no-op when ``parallel.context == 1``.
    """
    if parallel.context == 1:
        return
    if train.packing != "thd":
        raise ValueError(
            "parallel.context > 1 needs train.packing = 'thd' (sequences are split into "
            "2*CP load-balanced chunks of a packed micro-batch)"
        )
    if not algorithm.token_separable:
        raise ValueError(
            f"parallel.context > 1 needs a loss that is a sum over tokens; algorithm {algorithm.name!r} "
            f"(algorithm.agg={algorithm.config.agg!r}, algorithm.f1_control={algorithm.config.f1_control!r}) "
            "needs whole responses on one rank (use agg token-mean or seq-mean-token-sum, and no match_masked_norm)"
        )
    if diagnostics:
        raise ValueError(
            "diagnostics need whole responses on one rank: set diagnostics.enabled = false with parallel.context > 1"
        )


def check_experts(model, parallel: ParallelConfig, train: TrainConfig, diagnostics: bool) -> None:
    """Refuse expert-parallel and routing settings the model or the trainer cannot use (``model``: a ModelConfig).

    Raises ValueError naming the key: ``parallel.expert`` > 1 or ``train.routing_replay`` on a dense
    model; megatron's MoE layer trains under TP only with sequence parallelism; routing replay
    with full recompute; the diagnostics' gradient probes sum a gradient over the model-parallel
    group, which with expert parallelism holds only some experts.
    """
    if not model.is_moe:
        if train.routing_replay != "none":
            raise ValueError(
                f"train.routing_replay={train.routing_replay!r} needs a mixture-of-experts model "
                f"(the {model.family} model has no routers)"
            )
        if parallel.expert != 1 or parallel.expert_tensor not in (None, parallel.tensor):
            raise ValueError(
                f"parallel.expert={parallel.expert}, parallel.expert_tensor={parallel.expert_tensor}: "
                f"the {model.family} model has no experts"
            )
        return
    if parallel.tensor > 1 and not parallel.sequence_parallel:
        raise ValueError(
            f"parallel.tensor={parallel.tensor} with a mixture-of-experts model needs "
            f"parallel.sequence_parallel=true (megatron-core's MoE layer refuses TP without it)"
        )
    if train.routing_replay != "none" and train.recompute == "full":
        raise ValueError(
            f"train.routing_replay={train.routing_replay!r} with train.recompute='full' is not supported "
            f"(the recomputed forward in the backward would route anew): use recompute null or 'selective'"
        )
    if diagnostics and parallel.expert > 1:
        raise ValueError(
            "diagnostics (their gradient probes) do not support parallel.expert > 1: "
            "set diagnostics.enabled = false or parallel.expert = 1"
        )


def check_resume_expert_parallel(saved: int, current: int, path) -> None:
    """Refuse a resume megatron-core cannot reshard: with expert parallelism (EP > 1) its optimizer
    keeps the experts' state in a second, chained optimizer, so a checkpoint saved at EP = 1 and one
    saved at EP > 1 hold differently keyed optimizer states. Raises ValueError naming ``parallel.expert``.
    (The weights alone, ``<checkpoint>/weights``, load at any EP as a model checkpoint.)"""
    if (int(saved) > 1) != (current > 1):
        raise ValueError(
            f"{path} was saved at parallel.expert={saved}; its optimizer state cannot resume at "
            f"parallel.expert={current} (megatron-core keeps expert optimizer state apart only under "
            f"expert parallelism): resume with parallel.expert {'> 1' if int(saved) > 1 else '= 1'}, "
            f"or start a new run from its weights (model.path={path}/weights)"
        )
