"""The policy trainer on megatron-core: one rollout step, identical on a laptop CPU and a 1,000-GPU cluster.

1. assign (:meth:`PolicyTrainer.assign_minibatches`): the rollout's samples are split into
   mini-batches that keep groups whole, and each mini-batch is dealt to data-parallel ranks
   (groups may be split across ranks). Every rank holds the whole rollout's metadata, so global
   normalisers need no communication.
2. experience (:mod:`megatron_zcpo.megatron.experience`, no grad, the sampling snapshot
   pi_old = pi_theta): per-token old log-prob, reference log-prob, entropy and exact conditional KL.
3. calibrate (same module): per-response sums are all-gathered over data-parallel ranks (never
   tokens) and the registered algorithm turns them into per-response coefficients, frozen for
   the rollout. The five values travel on as one :class:`RolloutStep`.
4. update (:mod:`megatron_zcpo.megatron.update`): per mini-batch, megatron-core's
   forward_backward_func with the algorithm's loss, gradient clipping and one optimizer step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from megatron_zcpo.megatron import experience as experience_pass
from megatron_zcpo.megatron import update as update_pass
from megatron_zcpo.megatron.batch import (
    MicroBatch,
    RolloutSample,
    assign_data_parallel,
    collate,
    collate_packed,
    pack_micro_batches,
    packed_length,
    split_minibatches,
    units_of,
)
from megatron_zcpo.megatron.expert_batches import pad_to_expert_parallel_count
from megatron_zcpo.megatron.metrics import MetricAccumulator
from megatron_zcpo.megatron.model import ModelConfig, build_gpt_model, transformer_config
from megatron_zcpo.megatron.offload import HostOffload
from megatron_zcpo.megatron.pipeline import install_hidden_state_head
from megatron_zcpo.utils.devices import compute_device, has_cuda
from megatron_zcpo.megatron.rollout_step import MinibatchAssignment, ResponseTokenStats, RolloutStep
from megatron_zcpo.megatron.train_config import (
    ParallelConfig,
    TrainConfig,
    check_context_parallel,
    check_experts,
    check_resume_expert_parallel,
)

logger = logging.getLogger(__name__)

Weights = Union[Dict[str, torch.Tensor], str, os.PathLike, None]


class PolicyTrainer:
    """Policy + frozen reference on megatron-core, trained by a registered RL algorithm.

    Call :func:`megatron_zcpo.setup_megatron` first. ``initial_weights`` (a global state dict, see
    :mod:`megatron_zcpo.megatron.weights`, or a model checkpoint directory, see
    :mod:`megatron_zcpo.megatron.checkpoint`) initialises the policy, and the reference unless
    ``reference_weights`` is given; without either, both start from the same seeded random
    initialisation. ``temperature`` is the rollout's sampling temperature: log-probs are those of
    the distribution the engine sampled from. ``diagnostics`` (see megatron_zcpo.diagnostics) has
    ``due(step) -> bool``, ``run(trainer, rollout_step) -> dict`` and
    ``before_minibatch(trainer, rollout_step, index) -> dict``; when due, ``run`` runs between
    calibration and the update, on every rank.
    """

    def __init__(self, model_config: ModelConfig, algorithm_config, train: TrainConfig, parallel: ParallelConfig, *,
                 initial_weights: Weights = None, reference_weights: Weights = None, temperature: float = 1.0,
                 diagnostics=None):
        from megatron.core import parallel_state as ps

        from megatron_zcpo.algorithms import build_algorithm

        self.algorithm = build_algorithm(algorithm_config)
        check_context_parallel(parallel, train, self.algorithm, diagnostics is not None)
        self.model_config = model_config
        self.train_config = train
        self.parallel = parallel
        self.temperature = float(temperature)
        self.step = 0
        self.skipped_in_a_row = 0  # consecutive optimizer steps skipped for non-finite values
        self.skipped: List[str] = []  # this rollout step's skipped optimizer steps, one message each
        self.last_coefficients: Optional[torch.Tensor] = None
        # During train_step: (its samples, {indices: micro-batches}), see micro_batches.
        self._step_micro_batches: Optional[tuple] = None
        self.diagnostics = diagnostics
        self.reference_is_initial_policy = reference_weights is None
        check_experts(model_config, parallel, diagnostics is not None)
        self.config = transformer_config(
            model_config, tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline,
            context_parallel=parallel.context, sequence_parallel=parallel.sequence_parallel,
            params_dtype=torch.bfloat16 if train.bf16 else torch.float32, recompute=train.recompute,
            expert_parallel=parallel.expert, expert_tensor_parallel=parallel.expert_tensor, moe=train.moe,
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
        """``self.policy`` (DDP-wrapped) and the frozen ``self.reference``, loaded and headless."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        from megatron_zcpo.megatron.checkpoint import load_model_checkpoint
        from megatron_zcpo.megatron.weights import gather_global_state_dict, load_global_state_dict

        policy = build_gpt_model(self.model_config, self.config)
        reference = build_gpt_model(self.model_config, self.config)
        if initial_weights is None:
            # Same starting point for both: the reference is the initial policy.
            initial_weights = gather_global_state_dict(policy)
        for model, source in ((policy, initial_weights),
                              (reference, initial_weights if reference_weights is None else reference_weights)):
            if isinstance(source, dict):
                load_global_state_dict(model, source)
            else:  # a model checkpoint directory: each rank reads only its own shard
                load_model_checkpoint(model, source)
        for model in (policy, reference):
            install_hidden_state_head(model)
        if self.train_config.bf16:
            # megatron's mixed precision: the whole module in bf16 (norms included), inputs cast on
            # the first stage; the last stage keeps its bf16 hidden states (fp32_output=False): the
            # fused op computes exact fp32 logits from bf16 operands, as the output layer would see.
            from megatron.core.transformer.module import Float16Module

            policy, reference = Float16Module(self.config, policy), Float16Module(self.config, reference)
        self.forward_kwargs = {"fp32_output": False} if self.train_config.bf16 else {}
        reference.eval()
        for param in reference.parameters():
            param.requires_grad_(False)
        self.reference = reference
        # Offloaded between uses through reused pinned host buffers (asynchronous copies).
        self.reference_offloader = HostOffload(reference, pin=has_cuda())
        self.policy = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                          use_distributed_optimizer=self.parallel.distributed_optimizer),
            policy,
        )

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
                optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad, bf16=train.bf16, params_dtype=self.config.params_dtype,
                use_distributed_optimizer=self.parallel.distributed_optimizer,
            ),
            [self.policy],
        )
        decay_steps = max(train.steps, opt.warmup_steps) + 1  # see OptimizerSettings
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if opt.warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=opt.schedule, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        self.scheduler.step(0)
        self.last_lr: Optional[float] = None  # the LR the last update applied

    # ----------------------------------------------------------------------------- one step
    def train_step(self, samples: Sequence[RolloutSample]) -> Dict[str, float]:
        """Experience -> calibration -> updates on one rollout; returns global metrics (every rank).

        The rollout's frozen coefficients stay available as ``last_coefficients`` ([N] on the last
        pipeline stage, None elsewhere).
        """
        if not samples:
            raise ValueError("train_step needs at least one sample")
        self._step_micro_batches = (samples, {})
        try:
            return self._train_step(samples)
        finally:
            self._step_micro_batches = None

    def _train_step(self, samples: Sequence[RolloutSample]) -> Dict[str, float]:
        """:meth:`train_step`'s body."""
        metrics, timings = MetricAccumulator(), {}
        started = time.perf_counter()
        assignment = self.assign_minibatches(samples)
        experience = self.experience(samples, assignment)
        timings["time/experience"] = time.perf_counter() - started
        selfcheck = {}
        if self.step == 0 and self.reference_is_initial_policy:
            selfcheck = experience_pass.selfcheck(experience, self.train_config.selfcheck_tolerance)

        started = time.perf_counter()
        coefficients, stats = self.calibrate(samples, experience)
        step = RolloutStep(samples, assignment, experience, coefficients, stats)
        self.last_coefficients = coefficients
        self._add_experience_metrics(step, metrics)
        timings["time/calibrate"] = time.perf_counter() - started

        diagnostics, before_minibatch = {}, None
        if self.diagnostics is not None and self.diagnostics.due(self.step):
            started = time.perf_counter()
            diagnostics = self.diagnostics.run(self, step)
            timings["time/diagnostics"] = time.perf_counter() - started
            before_minibatch = self._diagnostics_hook(step, diagnostics)

        started = time.perf_counter()
        self.skipped = []
        self.update(step, metrics, before_minibatch=before_minibatch)
        timings["time/update"] = time.perf_counter() - started
        out = metrics.reduce(contribute=self.reports_metrics)
        out["update/skipped_steps"] = float(len(self.skipped))
        import torch.distributed as dist

        for message in self.skipped if dist.get_rank() == 0 else []:
            logger.warning("%s", message)
        out.update(selfcheck)
        out.update(diagnostics)
        out.update(timings)
        out["train/lr"] = self.last_lr
        out["train/step"] = self.step
        trained_tokens = sum(len(s.response_ids) + len(s.prompt_ids) for s in samples)
        out["train/tokens_per_s"] = trained_tokens / max(timings["time/experience"] + timings["time/update"], 1e-9)
        return out

    def _diagnostics_hook(self, step: RolloutStep, out: Dict[str, float]):
        """A per-mini-batch callback running the diagnostics that need moved ratios (F1) into ``out``."""
        def before_minibatch(index: int) -> None:
            out.update(self.diagnostics.before_minibatch(self, step, index))
        return before_minibatch

    def _add_experience_metrics(self, step: RolloutStep, metrics: MetricAccumulator) -> None:
        """The experience pass's token metrics (one replica) and the coefficients' (counted once)."""
        if not self.is_last_stage:
            return
        if self.reports_metrics:
            experience_pass.experience_metrics(step.samples, step.experience, metrics)
        if self.counts_once:  # coefficients are identical on every DP and CP rank: count once
            for name, value in self.algorithm.coefficient_metrics(step.stats, step.coefficients).items():
                metrics.add(f"coef/{name}", value, 1.0)

    # ----------------------------------------------------------------------------- the step's parts
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
        mine = [assign_data_parallel(units_of(mb, group_ids, whole), lengths, self.dp_size)[self.dp_rank]
                for mb in minibatches]
        return MinibatchAssignment(minibatches=minibatches, mine=mine)

    def micro_batches(self, samples: Sequence[RolloutSample], indices) -> List[MicroBatch]:
        """This rank's micro-batches of ``indices`` under the token budget, on the model's device.

        Deterministic in (samples, indices): the experience pass and every update see the same
        micro-batches, so per-token statistics line up (on a CP rank: its chunks of each response).
        Within :meth:`train_step` each list is collated once and handed out again for the same
        samples and indices (the experience pass and the update with one mini-batch, repeated
        diagnostics probes): nothing writes into a micro-batch, and the step ends the reuse.
        """
        cache = self._step_micro_batches
        cache = cache[1] if cache is not None and cache[0] is samples else None
        key = tuple(indices)
        if cache is not None and key in cache:
            return cache[key]
        collated = self._collate(samples, indices)
        if cache is not None:
            cache[key] = collated
        return collated

    def _collate(self, samples: Sequence[RolloutSample], indices) -> List[MicroBatch]:
        """:meth:`micro_batches`, collated afresh."""
        units = units_of(indices, [s.group_id for s in samples], self.algorithm.needs_whole_groups)
        budget = self.train_config.micro_batch_tokens
        device = compute_device()
        # Sequence parallelism scatters the sequence dimension over the TP ranks: pad to a multiple.
        sp_size = self.parallel.tensor if self.parallel.sequence_parallel else 1
        if self.train_config.packing == "padded":
            lengths = [s.sequence_length for s in samples]
            collated = [collate(samples, chunk, sp_size=sp_size).to(device)
                        for chunk in pack_micro_batches(units, lengths, budget)]
        else:
            lengths = [packed_length(s.sequence_length, self.cp_size, sp_size) for s in samples]
            collated = [collate_packed(samples, chunk, self.cp_rank, self.cp_size, sp_size=sp_size).to(device)
                        for chunk in pack_micro_batches(units, lengths, budget, padded=False)]
        return pad_to_expert_parallel_count(collated, self.train_config.packing, self.cp_rank, self.cp_size, sp_size)

    def place_reference(self, on_device: bool) -> None:
        """Move the reference to the GPU (``on_device``) or back to host memory, when it is offloaded."""
        if self.train_config.reference_offload and has_cuda():
            if on_device:
                self.reference_offloader.to_device(compute_device())
            else:
                self.reference_offloader.to_host()

    def experience(self, samples: Sequence[RolloutSample], assignment: MinibatchAssignment
                   ) -> Dict[int, ResponseTokenStats]:
        """{sample index: ResponseTokenStats} of this rank's samples (last stage; {} elsewhere); see
        :func:`megatron_zcpo.megatron.experience.run_experience`."""
        return experience_pass.run_experience(self, samples, assignment)

    def calibrate(self, samples: Sequence[RolloutSample], experience: Dict[int, ResponseTokenStats]):
        """(coefficients [N], ResponseStats) on the last stage, (None, None) elsewhere; see
        :func:`megatron_zcpo.megatron.experience.calibrate`."""
        return experience_pass.calibrate(self, samples, experience)

    def normalizer(self, samples: Sequence[RolloutSample], indices) -> float:
        """Global denominator of the loss aggregation over one mini-batch (all DP ranks)."""
        counted = [len(samples[i].response_ids) for i in indices if samples[i].trainable]
        if self.algorithm.normalizer_unit == "tokens":
            return float(sum(counted))
        return float(sum(1 for c in counted if c > 0))  # seq-mean modes: sequences with a token

    def algorithm_loss(self, inputs: update_pass.LossInputs):
        """The registered algorithm's loss on one micro-batch's inputs (AlgorithmLoss)."""
        return self.algorithm.loss(
            inputs.logprob, inputs.old_logprob, inputs.mask, inputs.coefficients,
            normalizer=inputs.normalizer, ref_logprob=inputs.ref_logprob, current_kl=inputs.current_kl,
            token_weight=inputs.token_weight,
            group_ids=inputs.group_ids if self.algorithm.needs_whole_groups else None,
        )

    def update(self, step: RolloutStep, metrics: MetricAccumulator, before_minibatch=None) -> List[float]:
        """The LR schedule's step, then one optimizer step per mini-batch; returns the gradient norms.

        Rollout k trains at the schedule's step k+1 (``last_lr``). See
        :func:`megatron_zcpo.megatron.update.run_update`.
        """
        self.scheduler.step(1)
        self.last_lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norms = update_pass.run_update(self, step, metrics, before_minibatch)
        self.step += 1
        return grad_norms

    def gradient_vector(self, step: RolloutStep, indices, normalizer: float, loss_fn, *,
                        use_reference: bool = False) -> torch.Tensor:
        """This rank's flat fp32 gradient of ``loss_fn`` over ``indices`` (a probe: no optimizer step);
        see :func:`megatron_zcpo.megatron.update.gradient_vector`."""
        return update_pass.gradient_vector(self, step, indices, normalizer, loss_fn, use_reference=use_reference)

    gradient_dot = staticmethod(update_pass.gradient_dot)

    # ----------------------------------------------------------------------------- weights & state
    def global_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole policy as a global state dict (gathered over TP and PP; every rank)."""
        from megatron_zcpo.megatron.weights import gather_full_state_dict

        return gather_full_state_dict(self.policy)

    def save(self, root, extra_state: Optional[Dict[str, Any]] = None, keep_last: int = 2):
        """Checkpoint policy, optimizer, scheduler and ``extra_state`` (the loop's) under ``root``.

        Atomic and collective (see :mod:`megatron_zcpo.megatron.checkpoint`); returns its path.
        """
        from megatron_zcpo.megatron.checkpoint import save_checkpoint

        state = {"trainer_step": self.step, "scheduler": self.scheduler.state_dict(),
                 "expert_parallel": self.parallel.expert, **(extra_state or {})}
        return save_checkpoint(root, self.step, self.policy, self.optimizer, state, keep_last=keep_last)

    def load(self, path) -> Dict[str, Any]:
        """Resume from a checkpoint written by :meth:`save` (any TP/PP/DP layout); returns its state.

        A checkpoint of another model architecture is refused with the differing fields named, one
        whose optimizer megatron-core cannot reshard to this expert parallelism (see
        :func:`~megatron_zcpo.megatron.train_config.check_resume_expert_parallel`) naming ``parallel.expert``.
        """
        from pathlib import Path

        from megatron_zcpo.megatron.checkpoint import TRAINER_STATE, load_checkpoint, read_plain_state

        if (Path(path) / TRAINER_STATE).is_file():
            check_resume_expert_parallel(read_plain_state(Path(path) / TRAINER_STATE).get("expert_parallel", 1),
                                         self.parallel.expert, path)
        state = load_checkpoint(path, self.policy, self.optimizer)
        self.step = int(state["trainer_step"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state
