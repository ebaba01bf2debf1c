"""The RL recipe, read top to bottom: setup, train (rollout -> rewards -> trainer step -> weight push), save, cleanup.

A readable loop with no hidden trainer magic. Global rank 0 drives the rollout engine, the reward
workers and the prompt stream (:class:`megatron_zcpo.recipe.rollout.Rollout`); every rank runs the
Megatron trainer (PolicyTrainer) on the broadcast rollout, and the policy's weights go back to the
engine after every step.
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any, Dict, Optional

from megatron_zcpo.recipe.config import RunConfig, dump_run_config
from megatron_zcpo.recipe.stopping import AbandonedStep


class RLRecipe:
    """One training run of a RunConfig in this (already launched) process group.

    :meth:`setup` builds everything (and resumes), :meth:`train` runs the steps, :meth:`save`
    checkpoints, :meth:`cleanup` stops the engine and the loggers. :func:`run_training` calls them.
    """

    def __init__(self, config: RunConfig):
        self.config = config
        self.rollout = None
        self.logger = None
        self.stages = None
        self.overlap = None
        self.asynchronous = None  # rollout.mode=async: the producer's side (recipe/async_mode.py)
        self.waits = None  # the Rank0Wait group: where the other ranks wait for rank 0 alone
        self.colocation = None  # rollout.placement=colocated: the phase machine (rollout/placement.py)
        self.push_bytes: Optional[int] = None  # bytes of the last weight push (rank 0)
        self.guard: Any = None  # the PreemptionGuard train() runs under
        self.update_stops: Any = None  # its UpdateStopCheck (recipe/stopping.py), set by train()
        self.last_save_s = 0.0  # how long the last checkpoint took (what a stop's estimate counts for a save)

    # ----------------------------------------------------------------------------- setup
    def setup(self) -> None:
        """Process groups, model, trainer, rollout side (rank 0), resume state, loggers, first weight push."""
        import torch.distributed as dist

        from megatron_zcpo.megatron.initialize import setup_megatron
        from megatron_zcpo.recipe.async_mode import asynchronous_rollouts
        from megatron_zcpo.recipe.inputs import eval_records, load_tokenizer
        from megatron_zcpo.recipe.overlap import overlapped_rollouts
        from megatron_zcpo.recipe.rank0_wait import Rank0Wait
        from megatron_zcpo.recipe.rollout import Rollout
        from megatron_zcpo.recipe.timeouts import rank0_wait_timeout_s
        from megatron_zcpo.recipe.weight_push import stage_weight_push

        config = self.config
        setup_megatron(
            tensor_parallel=config.parallel.tensor,
            pipeline_parallel=config.parallel.pipeline,
            context_parallel=config.parallel.context,
            seed=config.train.seed,
            collective_timeout_s=config.parallel.collective_timeout_s,
            expert_parallel=config.parallel.expert,
            expert_tensor_parallel=config.parallel.expert_tensor,
        )
        # The other ranks wait for rank 0's solo phases here, never in a training group (rank0_wait.py).
        self.waits = Rank0Wait(rank0_wait_timeout_s(config))
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.run_dir = Path(config.logging.run_dir)
        tokenizer = load_tokenizer(config)
        colocated = config.rollout.placement == "colocated"
        if colocated:  # the engine first, emptied before the trainer takes the same GPUs
            self._start_engine_for_colocation(tokenizer)
        model_config = self._build_trainer(tokenizer)
        if not colocated:
            self.rollout = Rollout(config, model_config, tokenizer) if self.rank == 0 else None
        self.waits.barrier()  # rank 0 started (and checked) the rollout side
        if colocated:
            self._start_colocation()
        checkpoint = self._resume()  # (creates the run directory, or refuses to mix with the run it holds)
        if self.rank == 0:
            (self.run_dir / "config.yaml").write_text(dump_run_config(config))
        self.logger = self._make_logger() if self.rank == 0 else None
        if self.logger and checkpoint is not None:
            from megatron_zcpo.checkpoint.manifest import read_manifest

            old = (
                ""
                if read_manifest(checkpoint)
                else (
                    " (written before checkpoints had manifests: checked against the checkpoint library's index only)"
                )
            )
            self.logger.print(f"resumed from {checkpoint} at step {self.start_step}{old}")
        self.held_out = eval_records(config, tokenizer) if self.rank == 0 else []
        self.stages = stage_weight_push(config, self.engine, self.waits, self.trainer.policy)
        self.push(self.start_step)
        self.overlap = overlapped_rollouts(
            config, self.rollout, self.trainer, self.engine, self.stages, self.loop_state, self.waits
        )
        self.asynchronous = asynchronous_rollouts(
            config, self.rollout, self.trainer, self.engine, self.stages, self.loop_state, self.waits
        )

    def _start_engine_for_colocation(self, tokenizer) -> None:
        """Colocated placement: rank 0 starts (or attaches to) the engine and has it release its memory,
        before any rank builds its model on the same GPUs; every rank waits for it."""
        from megatron_zcpo.convert.checkpoint import model_config_at
        from megatron_zcpo.recipe.rollout import Rollout
        from megatron_zcpo.rollout.placement import release_for_training

        self.rollout = None
        if self.rank == 0:
            model = self.config.model
            model_config = model_config_at(model.path) if model.path is not None else model.architecture
            self.rollout = Rollout(self.config, model_config, tokenizer)
            release_for_training(self.rollout.engine)
        self.waits.barrier()

    def _start_colocation(self) -> None:
        """The phase machine, in its train phase (the trainer's state is on the device, the engine empty)."""
        from megatron_zcpo.megatron.offload import TrainingStateOffload
        from megatron_zcpo.rollout.placement import ColocatedPhases, device_memory_hooks
        from megatron_zcpo.utils.devices import has_cuda

        self.trainer.models.place_reference(on_device=False)  # off the GPU until the first experience pass
        free_bytes, after_offload = device_memory_hooks()
        timeout = float(self.config.rollout.sglang.client.get("update_timeout_s", 300.0))
        self.colocation = ColocatedPhases(
            TrainingStateOffload(self.trainer.policy, self.trainer.optimizer, pin=has_cuda()),
            self.engine,
            barrier=self.waits.barrier,
            free_bytes=free_bytes,
            after_offload=after_offload,
            release_timeout_s=timeout,
        )

    def push(self, version: int) -> None:
        """The weight push of ``version`` (collective); colocated, between the update and generate phases."""
        from megatron_zcpo.recipe.weight_push import push_weights

        if self.colocation is not None:
            self.colocation.to_update()
        self.push_bytes = push_weights(self.trainer, self.engine, version, self.stages, self.waits)
        if self.colocation is not None:
            self.colocation.to_generate()

    def _build_trainer(self, tokenizer):
        """``self.trainer`` on the configured model (random, HF or Megatron weights), checked against
        transformers when ``train.verify_against_hf`` says so; returns its ModelConfig."""
        from megatron_zcpo.convert.verify import check_policy_against_hf, startup_check_due
        from megatron_zcpo.diagnostics import build_diagnostics
        from megatron_zcpo.recipe.inputs import resolve_model
        from megatron_zcpo.training.trainer import PolicyTrainer

        config = self.config
        if config.model.path is not None:
            model_config, initial = resolve_model(config.model.path)
            reference = resolve_model(config.model.reference)[1] if config.model.reference else None
        else:
            model_config, initial, reference = config.model.architecture, None, None
        if len(tokenizer) > model_config.vocab_size:
            raise ValueError(
                f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model_config.vocab_size}"
            )
        lora_base = None
        if config.model.lora is not None and config.model.path is not None:  # read once, by rank 0
            from megatron_zcpo.checkpoint.lora_base import base_fingerprint

            path = config.model.path
            lora_base = self.waits.broadcast(
                {"path": str(Path(path).resolve()), "fingerprint": base_fingerprint(path)} if self.rank == 0 else None
            )
        self.trainer = PolicyTrainer(
            model_config,
            config.algorithm,
            config.train,
            config.parallel,
            initial_weights=initial,
            reference_weights=reference,
            temperature=config.rollout.temperature,
            diagnostics=build_diagnostics(config.diagnostics, config.algorithm),
            lora=config.model.lora,
            lora_base=lora_base,
        )
        if startup_check_due(config.train.verify_against_hf, config.model.path, model_config):
            check_policy_against_hf(self.trainer, config.model.path, config.train.verify_tolerance)
        return model_config

    def _resume(self) -> Optional[Path]:
        """Load the checkpoint ``checkpoint.resume`` names (auto: the newest intact one), if any; sets
        ``start_step`` and ``run_id``. Rank 0 chooses (:func:`megatron_zcpo.recipe.run_dir.open_run`)
        and every rank follows, or raises its refusal."""
        import sys

        from megatron_zcpo.recipe.run_dir import open_run

        self.start_step, self.loop_state = 0, {}
        self.checkpointed_step: Optional[int] = None  # the step of the newest checkpoint (resumed or written)
        decision = None
        if self.rank == 0:
            try:
                decision = open_run(self.config, lambda message: print(f"warning: {message}", file=sys.stderr))
            except Exception as refusal:
                decision = refusal
        decision = self.waits.broadcast(decision)  # rank 0 verifies the checkpoint alone (rank0_wait.py)
        if isinstance(decision, Exception):
            raise decision
        checkpoint, self.run_id = decision
        if checkpoint is not None:
            self.loop_state = self.trainer.load(checkpoint).get("loop", {})
            self.start_step = self.checkpointed_step = self.trainer.step
            # The data position: the loop's, or an asynchronous run's (whose producer restores it itself
            # when the resumed run is asynchronous too).
            data = self.loop_state.get("data")
            if data is None and self.config.rollout.mode != "async":
                data = self.loop_state.get("async", {}).get("data")
            if self.rank == 0 and data is not None:
                self.rollout.dataset.load_state_dict(data)
        return checkpoint

    def _make_logger(self):
        from megatron_zcpo.recipe.metrics_log import MetricsLogger

        logging = self.config.logging
        return MetricsLogger(
            self.run_dir,
            console=logging.console,
            tensorboard=logging.tensorboard,
            wandb_project=logging.wandb_project,
            total_steps=self.config.train.steps,
            start_step=self.start_step,
            run_id=self.run_id,
        )

    @property
    def engine(self):
        """Rank 0's rollout engine (None on the other ranks)."""
        return self.rollout.engine if self.rollout is not None else None

    # ----------------------------------------------------------------------------- train
    def train(self, guard=None) -> Dict[str, Any]:
        """Every remaining step, with the configured evaluations and checkpoints; returns the run's summary.

        SIGTERM or SIGUSR1 (a preemption, Slurm's time-limit warning) on any rank ends the run, on
        every rank, with a checkpoint: :class:`Preempted` is raised (``zcpo train`` exits with
        ``PREEMPTED_EXIT_CODE``; ``checkpoint.resume=auto`` continues). A stop request rank 0 sees
        during a step's rollout abandons that step (:meth:`_abandon`); one any rank sees during the
        update is taken at the update's next safe point as :mod:`megatron_zcpo.recipe.stopping` says
        (abandon, finish within ``checkpoint.stop_grace_s``, or exit unsaved); else after the step,
        skipping an evaluation due then.
        """
        from megatron_zcpo.checkpoint.io import rng_state
        from megatron_zcpo.recipe.stopping import UpdateStopCheck
        from megatron_zcpo.training.preemption import Preempted, PreemptionGuard

        config, trainer = self.config, self.trainer
        with contextlib.ExitStack() as stack:
            guard = guard or stack.enter_context(PreemptionGuard())  # ``guard``: installed by the caller
            self.guard = guard
            if self.rollout is not None:  # rank 0 watches for a stop request while a rollout runs
                self.rollout.stop_requested = guard.requested
            self.update_stops = UpdateStopCheck(
                guard,
                config.checkpoint.stop_grace_s,
                synchronous=self.overlap is None and self.asynchronous is None,
                unsaved=lambda: trainer.step - (self.checkpointed_step or 0),
                last_save_s=lambda: self.last_save_s,
                say=self.logger.print if self.logger is not None else lambda message: None,
            )
            stop = guard.should_stop()
            if stop:  # came during set-up: nothing trained since the checkpoint resumed from (or the start)
                raise Preempted(stop, self.start_step, saved=False)
            first_eval = self.evaluate(self.start_step) if config.eval.at_start and self.start_step == 0 else {}
            last_eval: Dict[str, float] = {}
            for step in range(self.start_step, config.train.steps):
                generators = rng_state()  # as the last completed step left them: what an abandoned step saves
                # (rank 0, sync: where an update abandoned before its first mini-batch puts the prompt stream back)
                data = (
                    self.rollout.dataset.state_dict()
                    if self.rollout is not None and self.update_stops.synchronous
                    else None
                )
                abandoned = self.train_step(step)
                if abandoned is not None:
                    self._abandon(abandoned, generators, data)
                stop = guard.should_stop() if trainer.step < config.train.steps else None
                if config.eval.every and trainer.step % config.eval.every == 0 and trainer.step < config.train.steps:
                    if not stop:  # (a stop leaves no time for it: the grace time is the save's)
                        last_eval = self.evaluate(trainer.step) or last_eval
                    elif self.logger is not None:
                        self.logger.print(f"{stop}: evaluation at step {trainer.step} skipped")
                saved = bool(config.checkpoint.every) and trainer.step % config.checkpoint.every == 0
                if saved:
                    self.save(trainer.step)
                if stop:
                    if not saved:
                        self.save(trainer.step)
                    if self.logger is not None:
                        self.logger.print(
                            f"{stop}: stopping after step {trainer.step} (checkpoint written{self._dropped()})"
                        )
                    raise Preempted(stop, trainer.step)
        if config.eval.at_end:
            last_eval = self.evaluate(trainer.step) or last_eval
        if not config.checkpoint.every or trainer.step % config.checkpoint.every:
            self.save(trainer.step)
        return {"run_dir": str(self.run_dir), "first_eval": first_eval, "last_eval": last_eval, "steps": trainer.step}

    def train_step(self, step: int) -> Optional[AbandonedStep]:
        """Rollout (rank 0) -> broadcast -> trainer step -> weight push; logs the step's metrics.

        With ``rollout.mode=overlap`` the step takes the rollout generated during the previous step,
        pushes the current weights and starts the next rollout before training; with ``async`` it
        takes the producer's oldest complete groups and pushes after training without draining.
        Returns how a stop request ended the step (every rank: during the rollout rank 0 decides and
        tells the others where they wait for it; during the update they decide together), None when
        the step was trained.
        """
        import signal

        from megatron_zcpo.convert.verify import logprob_tolerance
        from megatron_zcpo.recipe.rollout import broadcast_samples
        from megatron_zcpo.rollout.engine import RolloutInterrupted
        from megatron_zcpo.training.preemption import UpdateInterrupted

        started = time.perf_counter()
        overlap, asynchronous = self.overlap, self.asynchronous
        samples, rollout_stats, abandoned_by = None, {}, None
        try:
            if asynchronous is not None:  # the oldest complete groups the producer holds
                samples, rollout_stats = asynchronous.collect(step)
            elif overlap is None:
                samples, rollout_stats = self.rollout.collect(step) if self.rank == 0 else (None, {})
            else:  # take step k's rollout (then push and generate step k+1's while step k trains)
                samples, rollout_stats = overlap.collect(step)
        except RolloutInterrupted:  # rank 0: a stop request during this step's rollout (it is sticky)
            abandoned_by = signal.Signals(self.guard.requested()).name
        # the others waited here (rank0_wait.py), and learn whether the step goes on
        count, abandoned_by = self.waits.broadcast((len(samples), None) if samples is not None else (0, abandoned_by))
        if abandoned_by:
            return AbandonedStep(abandoned_by)
        if overlap is not None:
            overlap.push_current_weights()
            rollout_stats.update(overlap.launch(step + 1))
        time_rollout = time.perf_counter() - started
        if count == 0:
            raise RuntimeError(f"step {step}: dynamic sampling kept no group (see rollout.dynamic_sampling)")
        samples = broadcast_samples(samples)
        if self.colocation is not None:
            self.colocation.to_train()
        try:
            metrics = self.trainer.train_step(samples, stop_check=self.update_stops)
        except UpdateInterrupted as stopped:
            return AbandonedStep(stopped.signal_name, "update", stopped.progress)
        started_push = time.perf_counter()
        if asynchronous is not None:
            asynchronous.push(self.trainer.step)
        elif overlap is None:
            self.push(self.trainer.step)
        if self.rank != 0:
            return None
        metrics.update(rollout_stats)
        push_s = time.perf_counter() - started_push if overlap is None else overlap.push_s
        if self.push_bytes is not None:  # the last push's tensors (a LoRA adapter's alone: MBs, not GBs)
            metrics["rollout/push_bytes"] = float(self.push_bytes)
        if self.colocation is not None:  # time to hand the GPUs over, per phase entered
            metrics.update({f"time/colocate_{phase}": s for phase, s in self.colocation.seconds.items()})
        # time/world_size: the devices this step held, so `zcpo report --align-by gpu-hours` can sum GPU time
        metrics.update(
            {
                "time/rollout": time_rollout,
                "time/weight_sync": push_s,
                "time/step": time.perf_counter() - started,
                "time/world_size": self.world_size,
            }
        )
        self.logger.log(self.trainer.step, metrics)
        gap = metrics.get("rollout/logprob_diff_max", 0.0)
        rollout, train = self.config.rollout, self.config.train
        # The engine runs the HF model in fp32: in bf16 the trainer alone differs by rounding.
        tolerance = logprob_tolerance(train.verify_tolerance, train.bf16)
        if step == 0 and rollout.engine == "embedded" and not rollout.quantization and gap > tolerance:
            self.logger.print(
                f"[yellow]warning: the embedded engine's log-probs differ from the trainer's by up "
                f"to {gap:.2e} at step 0 (same weights: expected < {tolerance:g}, "
                f"train.verify_tolerance)"
            )
        return None

    def _abandon(self, abandoned: AbandonedStep, generators: Dict[str, Any], data: Optional[Dict[str, Any]]) -> None:
        """Every rank, the step ended by a stop request as ``abandoned`` says; raises :class:`Preempted`.

        Its weights untouched (the rollout, or the update before its first mini-batch): checkpoint the
        state the last completed step left (the prompt stream where this step began, rank 0's ``data``;
        the random generators as ``generators`` holds them), unless a checkpoint of that step exists; a
        resumed run does this step again, exactly (sync mode). Trained in part: nothing is saved (the
        newest checkpoint holds the run; :mod:`megatron_zcpo.recipe.stopping` chose this)."""
        from megatron_zcpo.checkpoint.io import set_rng_state
        from megatron_zcpo.training.preemption import Preempted

        step, stop = self.trainer.step, abandoned.signal_name
        if self.update_stops.unsaved() and abandoned.weights_changed:
            where = self.update_stops.exit_unsaved_message(abandoned, step, self.checkpointed_step)
            if self.logger is not None:
                self.logger.print(f"{stop}: {where}{self._dropped()}")
            checkpointed = self.checkpointed_step
            raise Preempted(stop, checkpointed or 0, saved=checkpointed is not None, where=where)
        set_rng_state(generators)
        if data is not None and abandoned.phase == "update":  # (the rollout put it back itself)
            self.rollout.dataset.load_state_dict(data)
        trained = step > 0 or self.checkpointed_step is not None  # else a rerun starts afresh, as this run did
        if trained and self.checkpointed_step != step:
            self.save(step)
        if self.logger is not None:
            kept = f"checkpoint of step {step}" if trained else "nothing trained yet"
            what = (
                "generation stopped, nothing of it trained"
                if abandoned.phase == "rollout"
                else "before its first mini-batch"
                if not abandoned.weights_changed
                else f"after {abandoned.progress.done} of {abandoned.progress.total} mini-batches, none kept"
            )
            self.logger.print(
                f"{stop}: abandoned step {step + 1} during its {abandoned.phase} ({what}; {kept}{self._dropped()}):"
                f" the resumed run {'generates' if abandoned.phase == 'rollout' else 'trains'} it again"
            )
        raise Preempted(stop, step, saved=trained, abandoned=True, phase=abandoned.phase)

    def _dropped(self) -> str:
        """What the stop message says of a rollout in flight it dropped (rollout.mode=overlap, rank 0)."""
        dropped = None if self.overlap is None else self.overlap.dropped_step
        return "" if dropped is None else f"; step {dropped + 1}'s rollout in flight dropped"

    def evaluate(self, step: int) -> Dict[str, float]:
        """Held-out metrics at trainer step ``step`` (rank 0, when there are held-out prompts; {} otherwise).
        Collective with ``rollout.mode=overlap`` (the engine first gets the current weights); with
        ``async`` the engine has them and keeps generating the producer's groups meanwhile."""
        if self.overlap is not None:
            self.overlap.settle()
        from megatron_zcpo.recipe.evaluation import run_evaluation

        if self.rank != 0 or not self.held_out:
            return {}
        k = self.config.eval.k
        rollout = self.rollout  # held-out avg@k / pass@k; per-sample results under run_dir/eval
        metrics = run_evaluation(
            self.config,
            rollout.engine,
            self.held_out,
            rollout.score,
            rollout.stop,
            self.run_dir / "eval" / f"step_{step:06d}.json",
        )
        self.logger.log(step, metrics, advance=False)
        self.logger.print(
            f"eval @ step {step}: avg@{k} = {metrics.get(f'eval/avg@{k}', math.nan):.3f}"
            f" on {int(metrics.get('eval/num_problems', 0))} problems x {k} samples"
        )
        return metrics

    # ----------------------------------------------------------------------------- save & cleanup
    def save(self, step: int) -> None:
        """Checkpoint the trainer and the prompt stream at ``step`` (collective). Colocated, the trainer's
        state comes back for it (the engine releases its memory) and the weights are pushed again after."""
        self.waits.barrier()  # rank 0 may still be evaluating
        started = time.monotonic()
        if self.colocation is not None:
            self.colocation.to_train()
        loop = {}
        if self.rank == 0:
            if self.overlap is not None:  # first: the rollout in flight advances the prompt stream
                loop["in_flight"] = self.overlap.state()
            if self.asynchronous is not None:  # the producer's groups and its data position, taken together
                loop["async"] = self.asynchronous.state()
            else:
                loop["data"] = self.rollout.dataset.state_dict()
        # Every rank passes its state; rank 0's is the one written (it owns the prompt stream).
        self.trainer.save(
            self.config.checkpoint_dir,
            {"loop": loop, "run_id": self.run_id},
            keep_last=self.config.checkpoint.keep_last,
        )
        self.checkpointed_step, self.last_save_s = step, time.monotonic() - started
        if self.colocation is not None:  # the released weights are gone: the engine gets them again
            self.push(self.trainer.step)

    def cleanup(self) -> None:
        """Stop the rollout side (engines, reward workers) and close the loggers."""
        if self.overlap is not None:
            self.overlap.close()
        if self.asynchronous is not None:
            self.asynchronous.close()
        share_engine = getattr(self.stages, "engine", None)  # a share's lead's own client (StageWeightPush)
        if share_engine is not None:
            share_engine.shutdown()
        if self.rollout is not None:
            self.rollout.close()
        if self.logger is not None:
            self.logger.close()


def run_training(config: RunConfig, guard=None) -> Dict[str, Any]:
    """Run ``config`` in this (already launched) process group; returns a summary on rank 0.

    ``guard``: an installed :class:`~megatron_zcpo.training.preemption.PreemptionGuard` (so a
    signal during set-up counts), else :meth:`RLRecipe.train` installs its own."""
    recipe = RLRecipe(config)
    try:
        recipe.setup()
        return recipe.train(guard)
    finally:
        recipe.cleanup()
