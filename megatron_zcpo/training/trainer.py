"""The policy trainer on megatron-core: one rollout step, identical on a laptop CPU and a 1,000-GPU cluster.

:meth:`PolicyTrainer.train_step` conducts one rollout step; every pass is a function of explicit
inputs that knows nothing of the trainer, and what the passes share travels in one
:class:`RolloutStep` created per rollout.

1. assign (:meth:`PolicyTrainer.start_step`): the rollout's samples are split into mini-batches
   that keep groups whole, and each mini-batch is dealt to data-parallel ranks (groups may be
   split across ranks); the step's micro-batches are collated once per share
   (:class:`~megatron_zcpo.training.batch.StepMicroBatches`). Every rank holds the whole
   rollout's metadata, so global normalisers need no communication.
2. experience (:func:`megatron_zcpo.training.experience.run_experience`, no grad, the sampling
   snapshot pi_old = pi_theta): per-token old log-prob, reference log-prob, entropy and exact
   conditional KL.
3. calibrate (:func:`megatron_zcpo.training.experience.calibrate`): per-response sums are
   all-gathered over data-parallel ranks (never tokens) and the registered algorithm turns them
   into per-response coefficients, frozen for the rollout. The diagnostics hook runs here when due.
4. update (:func:`megatron_zcpo.training.update.run_update`): per mini-batch, megatron-core's
   forward_backward_func with the algorithm's loss, gradient clipping and one optimizer step.
5. metrics: one all-reduce of everything the passes added (:class:`MetricAccumulator`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from megatron_zcpo.megatron.lora import AdaptersOffReference, LoraConfig, apply_lora
from megatron_zcpo.megatron.model import ModelConfig, build_gpt_model, transformer_config
from megatron_zcpo.megatron.offload import HostOffload
from megatron_zcpo.megatron.pipeline import ModelChunks, install_hidden_state_head
from megatron_zcpo.training.batch import (
    MicroBatchLayout,
    RolloutSample,
    StepMicroBatches,
    assign_data_parallel,
    collate_micro_batches,
    split_minibatches,
    units_of,
)
from megatron_zcpo.training.config import (
    ParallelConfig,
    TrainConfig,
    check_context_parallel,
    check_experts,
    check_resume_expert_parallel,
    check_token_stats_backend,
)
from megatron_zcpo.training.experience import (
    TokenStatsOptions,
    calibrate,
    experience_metrics,
    run_experience,
    selfcheck,
)
from megatron_zcpo.training.metrics import MetricAccumulator
from megatron_zcpo.training.preemption import StopCheck, UpdateProgress, stop_if_asked
from megatron_zcpo.training.rollout_step import MinibatchAssignment, ResponseTokenStats, RolloutStep
from megatron_zcpo.training.update import (
    LossInputs,
    PolicyUpdate,
    SkippedSteps,
    algorithm_loss,
    gradient_dot,
    gradient_vector,
    minibatch_normalizer,
    run_update,
)
from megatron_zcpo.utils.devices import compute_device, has_cuda

logger = logging.getLogger(__name__)

Weights = Union[Dict[str, torch.Tensor], str, os.PathLike, None]


@contextlib.contextmanager
def _timed(timings: Dict[str, float], name: str):
    """Add the seconds the block takes to ``timings[name]``."""
    started = time.perf_counter()
    yield
    timings[name] = time.perf_counter() - started


class PolicyTrainer:
    """Policy + frozen reference on megatron-core, trained by a registered RL algorithm.

    Call :func:`megatron_zcpo.setup_megatron` first. ``initial_weights`` (a global state dict, see
    :mod:`megatron_zcpo.megatron.weights`, or a model checkpoint directory, see
    :mod:`megatron_zcpo.checkpoint.io`) initialises the policy, and the reference unless
    ``reference_weights`` is given; without either, both start from the same seeded random
    initialisation. ``temperature`` is the rollout's sampling temperature: log-probs are those of
    the distribution the engine sampled from. ``diagnostics`` (see megatron_zcpo.diagnostics) has
    ``due(step) -> bool``, ``run(policy_update, rollout_step) -> dict`` and
    ``before_minibatch(policy_update, rollout_step, index) -> dict`` (a :class:`PolicyUpdate` and
    the :class:`RolloutStep`); when due, ``run`` runs between calibration and the update, on every rank.

    ``lora`` (``model.lora``): the policy is the frozen base plus LoRA adapters
    (:mod:`megatron_zcpo.megatron.lora`); only the adapters are trained, checkpointed and optimised, and
    the reference is the same model with the adapters off (no ``reference_weights``, no second model).
    ``lora_base``: {"path", "fingerprint"} of the base, recorded in checkpoints and checked on resume.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        algorithm_config,
        train: TrainConfig,
        parallel: ParallelConfig,
        *,
        initial_weights: Weights = None,
        reference_weights: Weights = None,
        temperature: float = 1.0,
        diagnostics=None,
        lora: Optional[LoraConfig] = None,
        lora_base: Optional[Dict[str, Any]] = None,
    ):
        from megatron.core import parallel_state as ps

        from megatron_zcpo.algorithms import build_algorithm

        self.algorithm = build_algorithm(algorithm_config)
        check_context_parallel(parallel, train, self.algorithm, diagnostics is not None)
        check_token_stats_backend(train, compute_device())
        self.model_config = model_config
        self.train_config = train
        self.parallel = parallel
        self.temperature = float(temperature)
        self.step = 0
        self.skips = SkippedSteps()  # optimizer steps skipped for non-finite values
        self.last_coefficients: Optional[torch.Tensor] = None
        self.diagnostics = diagnostics
        if lora is not None and reference_weights is not None:
            raise ValueError(
                "model.reference: a LoRA policy's reference is its base with the adapters off; leave it unset"
            )
        self.lora, self.lora_base = lora, lora_base
        self.reference_is_initial_policy = reference_weights is None
        check_experts(model_config, parallel, train, diagnostics is not None)
        self.config = transformer_config(
            model_config,
            tensor_parallel=parallel.tensor,
            pipeline_parallel=parallel.pipeline,
            context_parallel=parallel.context,
            sequence_parallel=parallel.sequence_parallel,
            params_dtype=torch.bfloat16 if train.bf16 else torch.float32,
            recompute=train.recompute,
            expert_parallel=parallel.expert,
            expert_tensor_parallel=parallel.expert_tensor,
            moe=train.moe,
            first_stage_layers=parallel.first_stage_layers,
            last_stage_layers=parallel.last_stage_layers,
        )
        self._build_models(initial_weights, reference_weights)
        self._build_optimizer()
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        # Only one replica of every value reports metrics (TP ranks compute the same numbers;
        # context-parallel ranks hold disjoint tokens, so they all report).
        self.reports_metrics = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        # Values every rank of a (DP x CP) replica knows whole (coefficients) are counted once.
        self.counts_once = self.dp_rank == 0 and self.cp_rank == 0

    def _build_models(self, initial_weights: Weights, reference_weights: Weights) -> None:
        """``self.models``: the policy (DDP-wrapped) and the frozen reference, loaded and headless
        (with LoRA: the adapted policy and its adapters-off view)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from megatron_zcpo.checkpoint.io import load_model_checkpoint
        from megatron_zcpo.megatron.weights import gather_global_state_dict, load_global_state_dict

        policy = build_gpt_model(self.model_config, self.config)
        reference = None if self.lora is not None else build_gpt_model(self.model_config, self.config)
        if initial_weights is None and reference is not None:
            # Same starting point for both: the reference is the initial policy.
            initial_weights = gather_global_state_dict(policy)
        loads = [(policy, initial_weights)]
        if reference is not None:
            loads.append((reference, initial_weights if reference_weights is None else reference_weights))
        for model, source in loads:
            if isinstance(source, dict):
                load_global_state_dict(model, source)
            elif source is not None:  # a model checkpoint directory: each rank reads only its own shard
                load_model_checkpoint(model, source)
        if self.lora is not None:  # the base is loaded: freeze it, add the adapters
            apply_lora(policy, self.lora, self.train_config.seed)
        for model in (policy, reference):
            if model is not None:
                install_hidden_state_head(model)
        if self.train_config.bf16:
            # megatron's mixed precision: the whole module in bf16 (norms included), inputs cast on
            # the first stage; the last stage keeps its bf16 hidden states (fp32_output=False): the
            # fused op computes exact fp32 logits from bf16 operands, as the output layer would see.
            from megatron.core.transformer.module import Float16Module

            from megatron_zcpo.megatron.weights import expert_biases_kept_in_float32

            with expert_biases_kept_in_float32(policy, reference):
                policy = Float16Module(self.config, policy)
                reference = Float16Module(self.config, reference) if reference is not None else None
        if reference is not None:
            reference.eval()
            for param in reference.parameters():
                param.requires_grad_(False)
        policy = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, use_distributed_optimizer=self.parallel.distributed_optimizer
            ),
            policy,
        )
        # Offloaded between uses through reused pinned host buffers (asynchronous copies).
        offload = (
            HostOffload(reference, pin=True)
            if reference is not None and self.train_config.reference_offload and has_cuda()
            else None
        )
        if reference is None:  # LoRA: the policy with its adapters off
            reference = AdaptersOffReference(policy)
        self.models = ModelChunks(policy, reference, {"fp32_output": False} if self.train_config.bf16 else {}, offload)
        self.routing = None  # MoE models: routing record / replay / comparison on the policy's routers
        if self.model_config.is_moe:
            from megatron.core import parallel_state as ps

            from megatron_zcpo.training.routing_replay import RoutingReplay

            sequence_parallel = self.parallel.sequence_parallel
            self.routing = RoutingReplay(
                policy,
                self.train_config.routing_replay,
                self.model_config.num_experts_per_tok,
                sp_size=self.parallel.tensor if sequence_parallel else 1,
                sp_rank=ps.get_tensor_model_parallel_rank() if sequence_parallel else 0,
            )
            self.models.around_forward = self.routing.micro_batch
            if isinstance(reference, AdaptersOffReference):  # the reference routes freely through the same routers
                reference.around_forward = self.routing.bypassed

    @property
    def policy(self):
        """This rank's chunk of the policy (megatron-core's DDP)."""
        return self.models.policy

    @property
    def reference(self):
        """This rank's chunk of the frozen reference."""
        return self.models.reference

    def _build_optimizer(self) -> None:
        """megatron-core's AdamW over the policy (``self.optimizer``) and its LR ``self.scheduler``."""
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        train, opt = self.train_config, self.train_config.optimizer
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.policy.no_sync
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=opt.lr,
                min_lr=opt.min_lr,
                weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1,
                adam_beta2=opt.adam_beta2,
                adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad,
                bf16=train.bf16,
                params_dtype=self.config.params_dtype,
                use_distributed_optimizer=self.parallel.distributed_optimizer,
            ),
            [self.policy],
        )
        decay_steps = max(train.steps, opt.warmup_steps) + 1  # see OptimizerSettings
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if opt.warmup_steps else opt.lr,
            max_lr=opt.lr,
            min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=decay_steps,
            lr_decay_style=opt.schedule,
            start_wd=opt.weight_decay,
            end_wd=opt.weight_decay,
            wd_incr_steps=decay_steps,
            wd_incr_style="constant",
        )
        self.scheduler.step(0)
        self.last_lr: Optional[float] = None  # the LR the last update applied

    # ----------------------------------------------------------------------------- one step
    def train_step(self, samples: Sequence[RolloutSample], stop_check: Optional[StopCheck] = None) -> Dict[str, float]:
        """Assign -> experience -> calibrate -> (diagnostics) -> update -> metrics on one rollout.

        Returns the step's global metrics (every rank). The rollout's frozen coefficients stay
        available as ``last_coefficients`` ([N] on the last pipeline stage, None elsewhere).
        ``stop_check`` (collective; every rank passes one or none): asked at the update's safe points
        (before the experience pass, before each mini-batch) with the :class:`UpdateProgress`; a signal
        name it returns stops the step there with :class:`UpdateInterrupted` (before the first
        mini-batch: the trainer's state is as the last completed step left it).
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        metrics, timings = MetricAccumulator(), {}
        step = self.start_step(samples)  # assign: mini-batches, this rank's share, its micro-batches
        stop_if_asked(stop_check, UpdateProgress(0, len(step.assignment.minibatches)))
        with _timed(timings, "time/experience"):
            if self.routing is not None:  # MoE: the engine's experts to replay or compare with
                step.routing = self.routing.begin(samples, step.assignment.my_indices)
            step.experience = run_experience(
                self.models, step.micro_batches(step.assignment.my_indices), self.token_stats
            )
        checked = {}
        if self.step == 0 and self.reference_is_initial_policy:
            checked = selfcheck(step.experience, self.train_config.selfcheck_tolerance)
        with _timed(timings, "time/calibrate"):
            if self.is_last_stage:
                step.coefficients, step.stats = calibrate(step.samples, step.experience, self.algorithm)
                self._add_experience_metrics(step, metrics)
            self.last_coefficients = step.coefficients
        update = self.policy_update()
        diagnostics, before_minibatch = self._diagnose(update, step, timings)
        stop_if_asked(stop_check, UpdateProgress(0, len(step.assignment.minibatches)))
        with _timed(timings, "time/update"):
            self._update(update, step, metrics, before_minibatch, stop_check)
        return self._step_metrics(step, metrics, checked, diagnostics, timings)

    def start_step(self, samples: Sequence[RolloutSample]) -> RolloutStep:
        """The rollout's :class:`RolloutStep`: its assignment and this rank's micro-batches (collated on use)."""
        return RolloutStep(
            samples,
            self.assign_minibatches(samples),
            micro_batches=StepMicroBatches(samples, self.micro_batch_layout),
            index=self.step,
        )

    def policy_update(self) -> PolicyUpdate:
        """What the update, the gradient probes and the diagnostics run with now (see :class:`PolicyUpdate`)."""
        return PolicyUpdate(
            models=self.models,
            optimizer=self.optimizer,
            algorithm=self.algorithm,
            loss=self.algorithm_loss,
            layout=self.micro_batch_layout,
            token_stats=self.token_stats,
            importance_sampling=self.train_config.importance_sampling,
            dp_size=self.dp_size,
            dp_rank=self.dp_rank,
            reports_metrics=self.reports_metrics,
            counts_once=self.counts_once,
            max_skipped_steps=self.train_config.max_skipped_steps,
        )

    @property
    def micro_batch_layout(self) -> MicroBatchLayout:
        """How this rank collates micro-batches (``train.packing``, ``train.micro_batch_tokens``, CP, SP)."""
        return MicroBatchLayout(
            token_budget=self.train_config.micro_batch_tokens,
            packing=self.train_config.packing,
            whole_groups=self.algorithm.needs_whole_groups,
            cp_rank=self.cp_rank,
            cp_size=self.cp_size,
            # Sequence parallelism scatters the sequence dimension over the TP ranks: pad to a multiple.
            sp_size=self.parallel.tensor if self.parallel.sequence_parallel else 1,
            # Expert parallelism's all-to-alls need the same micro-batch count on every DP rank.
            equal_count=self.parallel.expert > 1,
        )

    @property
    def token_stats(self) -> TokenStatsOptions:
        """How the fused op scores tokens: the true vocabulary, ``train.kl_chunk_size``, the sampling temperature,
        ``train.token_stats_backend``."""
        return TokenStatsOptions(
            vocab_size=self.model_config.vocab_size,
            chunk_size=self.train_config.kl_chunk_size,
            temperature=self.temperature,
            backend=self.train_config.token_stats_backend,
        )

    def _diagnose(self, update: PolicyUpdate, step: RolloutStep, timings: Dict[str, float]):
        """(metrics, before_minibatch) of the diagnostics hook when due, else ({}, None): ``run`` now, and a
        per-mini-batch callback adding the families that need moved ratios (F1) to the same metrics."""
        if self.diagnostics is None or not self.diagnostics.due(self.step):
            return {}, None
        with _timed(timings, "time/diagnostics"):
            out = self.diagnostics.run(update, step)

        def before_minibatch(index: int) -> None:
            out.update(self.diagnostics.before_minibatch(update, step, index))

        return out, before_minibatch

    def _add_experience_metrics(self, step: RolloutStep, metrics: MetricAccumulator) -> None:
        """The experience pass's token metrics (one replica) and the coefficients' (counted once); last stage."""
        if self.reports_metrics:
            experience_metrics(step.samples, step.experience, metrics)
        if self.counts_once:  # coefficients are identical on every DP and CP rank: count once
            for name, value in self.algorithm.coefficient_metrics(step.stats, step.coefficients).items():
                metrics.add(f"coef/{name}", value, 1.0)

    def _step_metrics(
        self,
        step: RolloutStep,
        metrics: MetricAccumulator,
        checked: Dict[str, float],
        diagnostics: Dict[str, float],
        timings: Dict[str, float],
    ) -> Dict[str, float]:
        """The step's global metrics: the passes' (one all-reduce), skips, self-check, diagnostics, timings."""
        import torch.distributed as dist

        out = metrics.reduce(contribute=self.reports_metrics)
        out["update/skipped_steps"] = float(len(self.skipped))
        for message in self.skipped if dist.get_rank() == 0 else []:
            logger.warning("%s", message)
        if self.routing is not None:
            out.update(self.routing.metrics(step.assignment.my_indices))
        out.update(checked)
        out.update(diagnostics)
        out.update(timings)
        out["train/lr"] = self.last_lr
        out["train/step"] = self.step
        trained_tokens = sum(len(s.response_ids) + len(s.prompt_ids) for s in step.samples)
        out["train/tokens_per_s"] = trained_tokens / max(timings["time/experience"] + timings["time/update"], 1e-9)
        return out

    # ----------------------------------------------------------------- the step's passes one at a time (tools, tests)
    def assign_minibatches(self, samples: Sequence[RolloutSample]) -> MinibatchAssignment:
        """Split the rollout into group-whole mini-batches and deal them to DP ranks."""
        lengths = [s.sequence_length for s in samples]
        groups = len({s.group_id for s in samples})
        # Dynamic sampling can return fewer groups (or samples) than planned: use as many
        # mini-batches as keep every DP rank busy.
        count = max(1, min(self.train_config.mini_batches, groups, len(samples) // self.dp_size))
        group_ids = [s.group_id for s in samples]
        minibatches = split_minibatches(group_ids, count)
        whole = self.algorithm.needs_whole_groups
        mine = [
            assign_data_parallel(units_of(mb, group_ids, whole), lengths, self.dp_size)[self.dp_rank]
            for mb in minibatches
        ]
        return MinibatchAssignment(minibatches=minibatches, mine=mine)

    def experience(
        self, samples: Sequence[RolloutSample], assignment: MinibatchAssignment
    ) -> Dict[int, ResponseTokenStats]:
        """{sample index: ResponseTokenStats} of this rank's samples (last stage; {} elsewhere); see
        :func:`megatron_zcpo.training.experience.run_experience`."""
        micro_batches = collate_micro_batches(samples, assignment.my_indices, self.micro_batch_layout)
        return run_experience(self.models, micro_batches, self.token_stats)

    def calibrate(self, samples: Sequence[RolloutSample], experience: Dict[int, ResponseTokenStats]):
        """(coefficients [N], ResponseStats) on the last stage, (None, None) elsewhere; see
        :func:`megatron_zcpo.training.experience.calibrate`."""
        if not self.is_last_stage:
            return None, None
        return calibrate(samples, experience, self.algorithm)

    def normalizer(self, samples: Sequence[RolloutSample], indices) -> float:
        """Global denominator of the loss aggregation over one mini-batch (all DP ranks)."""
        return minibatch_normalizer(samples, indices, self.algorithm.normalizer_unit)

    def algorithm_loss(self, inputs: LossInputs):
        """The registered algorithm's loss on one micro-batch's inputs (AlgorithmLoss)."""
        return algorithm_loss(self.algorithm, inputs)

    def update(self, step: RolloutStep, metrics: MetricAccumulator, before_minibatch=None) -> List[float]:
        """The LR schedule's step, then one optimizer step per mini-batch; returns the gradient norms.

        Rollout k trains at the schedule's step k+1 (``last_lr``). See
        :func:`megatron_zcpo.training.update.run_update`.
        """
        return self._update(self.policy_update(), step, metrics, before_minibatch)

    def _update(
        self,
        update: PolicyUpdate,
        step: RolloutStep,
        metrics: MetricAccumulator,
        before_minibatch=None,
        stop_check: Optional[StopCheck] = None,
    ) -> List[float]:
        """:meth:`update` with ``update`` (the one the step's diagnostics saw); ``stop_check``: asked
        before each mini-batch after the first (see :meth:`train_step`)."""
        self.scheduler.step(1)
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        self.skips.messages = []
        grad_norms = run_update(update, step, metrics, self.skips, before_minibatch, stop_check)
        self.step += 1
        return grad_norms

    @property
    def skipped(self) -> List[str]:
        """The last update's skipped optimizer steps, one message each (see :class:`SkippedSteps`)."""
        return self.skips.messages

    def gradient_vector(
        self, step: RolloutStep, indices, normalizer: float, loss_fn, *, use_reference: bool = False
    ) -> torch.Tensor:
        """This rank's flat fp32 gradient of ``loss_fn`` over ``indices`` (a probe: no optimizer step);
        see :func:`megatron_zcpo.training.update.gradient_vector`."""
        return gradient_vector(self.policy_update(), step, indices, normalizer, loss_fn, use_reference=use_reference)

    gradient_dot = staticmethod(gradient_dot)

    # ----------------------------------------------------------------------------- weights & state
    def global_state_dict(self, part: str = "all", merged: bool = False) -> Dict[str, torch.Tensor]:
        """The whole policy as a global state dict (gathered over TP and PP; every rank): its base
        (LoRA: ``merged`` with the adapters), or ``part`` "adapters" the LoRA adapters alone."""
        from megatron_zcpo.megatron.weights import gather_full_state_dict

        return gather_full_state_dict(self.policy, part=part, merged=merged)

    def save(self, root, extra_state: Optional[Dict[str, Any]] = None, keep_last: int = 2):
        """Checkpoint policy, optimizer, scheduler and ``extra_state`` (the loop's) under ``root``.

        Atomic and collective (see :mod:`megatron_zcpo.checkpoint.io`); returns its path.
        """
        from megatron_zcpo.checkpoint.io import save_checkpoint

        state = {
            "trainer_step": self.step,
            "scheduler": self.scheduler.state_dict(),
            "expert_parallel": self.parallel.expert,
            **(extra_state or {}),
        }
        if self.lora is not None:
            from megatron_zcpo.checkpoint.lora_base import lora_record

            state["lora"] = lora_record(self.lora, self.lora_base)
        return save_checkpoint(root, self.step, self.policy, self.optimizer, state, keep_last=keep_last)

    def load(self, path) -> Dict[str, Any]:
        """Resume from a checkpoint written by :meth:`save` (any TP/PP/DP layout); returns its state.

        A checkpoint of another model architecture is refused with the differing fields named, one
        whose optimizer megatron-core cannot reshard to this expert parallelism (see
        :func:`~megatron_zcpo.training.config.check_resume_expert_parallel`) naming ``parallel.expert``,
        and one of other LoRA adapters, another base or the other kind of run (LoRA or not) naming
        the ``model.lora`` keys or the base (:func:`~megatron_zcpo.checkpoint.lora_base.check_lora_resume`).
        """
        from pathlib import Path

        from megatron_zcpo.checkpoint.io import TRAINER_STATE, load_checkpoint, read_plain_state
        from megatron_zcpo.checkpoint.lora_base import check_lora_resume, read_lora_record

        check_lora_resume(read_lora_record(Path(path) / "weights"), self.lora, self.lora_base, path)
        if (Path(path) / TRAINER_STATE).is_file():
            check_resume_expert_parallel(
                read_plain_state(Path(path) / TRAINER_STATE).get("expert_parallel", 1), self.parallel.expert, path
            )
        state = load_checkpoint(path, self.policy, self.optimizer)
        self.step = int(state["trainer_step"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state
