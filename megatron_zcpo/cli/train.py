"""``zcpo train``: the RL recipe, rollout -> rewards -> experience -> calibration -> updates -> weight push.

A readable loop with no hidden trainer magic. Global rank 0 drives the rollout engine, the reward
workers and the prompt stream; every rank runs the Megatron trainer (PolicyTrainer) on the
broadcast rollout, and the policy's weights go back to the engine after every step.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from megatron_zcpo.cli.config import RunConfig, dump_run_config, load_run_config
from megatron_zcpo.megatron.batch import RolloutSample

# --------------------------------------------------------------------------------- processes


def world_size_needed(config: RunConfig, nproc: Optional[int]) -> int:
    """Processes to start on this machine: ``--nproc``, else one model-parallel replica."""
    return nproc or config.parallel.tensor * config.parallel.pipeline * config.parallel.context


def relaunch_with_torchrun(argv: Sequence[str], nproc: int) -> int:
    """Re-run this command under torchrun with ``nproc`` local processes (the CPU default path)."""
    from torch.distributed.run import main as torchrun

    from megatron_zcpo.megatron.initialize import free_port

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = ["--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "megatron_zcpo.cli.main", *argv]
    try:
        torchrun(args)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except Exception as error:  # torchrun's ChildFailedError: the failing rank's traceback was printed
        print(f"zcpo: a training process failed: {error}", file=sys.stderr)
        return 1
    return 0


# --------------------------------------------------------------------------------- model & data


def load_tokenizer(config: RunConfig):
    from transformers import AutoTokenizer

    path = config.model.tokenizer
    if path is None:
        path = config.model.path
        if (Path(path) / "hf").is_dir():  # a converted checkpoint carries the HF files here
            path = str(Path(path) / "hf")
    return AutoTokenizer.from_pretrained(path)


def resolve_model(path: str):
    """(ModelConfig, initial weights) from a Megatron model checkpoint (its directory: each rank
    loads its own shard) or an HF directory (a global state dict, converted in memory)."""
    from megatron_zcpo.convert.checkpoint import megatron_checkpoint_dir, model_config_at
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint
    from megatron_zcpo.convert.mapping import hf_to_megatron_tensors

    model_config, checkpoint = model_config_at(path), megatron_checkpoint_dir(path)
    if checkpoint is not None:
        return model_config, str(checkpoint)
    return model_config, dict(hf_to_megatron_tensors(SafetensorsCheckpoint(path).tensor, model_config))


def eval_records(config: RunConfig, tokenizer):
    """Held-out prompts: ``eval.data``, else the training task drawn with ``eval.seed``."""
    import dataclasses

    from megatron_zcpo.data.dataset import load_records, tokenize_records

    data = config.eval.data
    if data is None:
        if not config.data.task:
            return []  # file-based training data needs an explicit eval.data
        data = dataclasses.replace(config.data, seed=config.eval.seed, task_size=config.eval.num_prompts)
    records = load_records(data.validate())[: config.eval.num_prompts]
    return tokenize_records(records, tokenizer, data.max_prompt_length, data.chat_template)


# --------------------------------------------------------------------------------- rollout


def samples_from_groups(result, group_offset: int) -> List[RolloutSample]:
    """Flatten dynamic sampling's kept groups into trainer samples (group ids unique per step)."""
    samples = []
    rewards = result.rewards
    for group, (record, completions) in enumerate(zip(result.records, result.completions)):
        for member, completion in enumerate(completions):
            samples.append(RolloutSample(
                prompt_ids=list(completion.prompt_ids),
                response_ids=list(completion.output_ids),
                group_id=group_offset + group,
                reward=float(rewards.reward[group, member]),
                trainable=bool(rewards.loss_mask[group, member]),
                rollout_logprobs=list(completion.output_logprobs),
                info={"score": float(rewards.score[group, member]),
                      "truncated": bool(rewards.truncated[group, member]),
                      "uid": record.uid},
            ))
    return samples


def rollout_metrics(samples: Sequence[RolloutSample]) -> Dict[str, float]:
    """Reward, accuracy and length statistics of the trained rollout."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "rollout/accuracy": sum(s.info.get("score", 0.0) > 0 for s in samples) / len(samples),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/clip_ratio": sum(bool(s.info.get("truncated")) for s in samples) / len(samples),
        "rollout/samples": float(len(samples)),
        "rollout/groups": float(len({s.group_id for s in samples})),
    }


def broadcast_samples(samples: Optional[List[RolloutSample]], src: int = 0) -> List[RolloutSample]:
    """Send rank ``src``'s rollout to every rank.

    Per-token data travel as two flat tensors (int32 token ids, float32 rollout log-probs);
    only the small per-sample fields go through the object broadcast. Returns the rollout as
    every rank (the sender included) now holds it.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    header = [None]
    if rank == src:
        header[0] = [(len(s.prompt_ids), len(s.response_ids), s.group_id, s.reward, s.trainable,
                      s.rollout_logprobs is not None, s.info) for s in samples]
    dist.broadcast_object_list(header, src=src)
    tokens = torch.empty(sum(p + r for p, r, *_ in header[0]), dtype=torch.int32, device=device)
    logprobs = torch.empty(sum(r for _, r, _, _, _, has, _ in header[0] if has), dtype=torch.float32, device=device)
    if rank == src:
        tokens.copy_(torch.tensor([t for s in samples for t in (*s.prompt_ids, *s.response_ids)], dtype=torch.int32))
        logprobs.copy_(torch.tensor([x for s in samples for x in (s.rollout_logprobs or ())], dtype=torch.float32))
    dist.broadcast(tokens, src=src)
    dist.broadcast(logprobs, src=src)
    # Every rank, the sender too, rebuilds from the tensors: identical (float32) values everywhere.
    flat_tokens, flat_logprobs = tokens.cpu().tolist(), logprobs.cpu().tolist()
    token_offset, logprob_offset, out = 0, 0, []
    for prompt_len, response_len, group_id, reward, trainable, has_logprobs, info in header[0]:
        prompt = flat_tokens[token_offset:token_offset + prompt_len]
        response = flat_tokens[token_offset + prompt_len:token_offset + prompt_len + response_len]
        token_offset += prompt_len + response_len
        rollout_logprobs = None
        if has_logprobs:
            rollout_logprobs = flat_logprobs[logprob_offset:logprob_offset + response_len]
            logprob_offset += response_len
        out.append(RolloutSample(prompt, response, group_id, reward, trainable, rollout_logprobs, info))
    return out


def stop_token_ids(config: RunConfig, tokenizer) -> tuple:
    """The configured stop tokens plus the tokenizer's end-of-sequence token."""
    stop = list(config.rollout.stop_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop:
        stop.append(tokenizer.eos_token_id)
    return tuple(stop)


def make_engine(config: RunConfig, model_config, tokenizer):
    """The configured rollout engine: embedded (this process) or SGLang (launched or attached)."""
    rollout = config.rollout
    if rollout.engine == "embedded":
        from megatron_zcpo.rollout.embedded import EmbeddedEngine

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return EmbeddedEngine(model_config, seed=rollout.seed, quantization=rollout.quantization, pad_token_id=pad)
    from megatron_zcpo.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

    if not (rollout.sglang.server_urls or rollout.sglang.launch):
        raise ValueError("rollout.engine=sglang needs rollout.sglang.server_urls (attach to running servers) "
                         "or rollout.sglang.launch (start them)")
    client = dict(rollout.sglang.client, quantization=rollout.quantization)
    if rollout.sglang.launch is not None:
        from megatron_zcpo.rollout.sglang_server import SGLangLauncher, SGLangServerConfig, launch_sglang

        return launch_sglang(SGLangLauncher(SGLangServerConfig(**rollout.sglang.launch)), **client)
    engine = SGLangEngine(SGLangEngineConfig(server_urls=list(rollout.sglang.server_urls),
                                             router_url=rollout.sglang.router_url, **client))
    engine.wait_until_healthy(client.get("connect_timeout_s", 600.0))
    return engine


def run_evaluation(config: RunConfig, engine, records, score, stop: tuple, output_path) -> Dict[str, float]:
    """avg@k / pass@k of ``engine`` on ``records`` with the ``eval:`` sampling; flat ``eval/...`` metrics."""
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.rollout.evaluation import evaluate

    ev = config.eval
    params = SamplingParams(temperature=ev.temperature, top_p=ev.top_p,
                            max_new_tokens=ev.max_new_tokens or config.rollout.max_new_tokens,
                            stop_token_ids=stop, seed=ev.seed)
    result = evaluate(engine, records, score, params, k=ev.k, output_path=str(output_path))
    return {f"eval/{key}": float(value) for key, value in result.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


class Rollout:
    """Rank 0's rollout side: engine, prompt stream, reward workers and sampling parameters."""

    def __init__(self, config: RunConfig, model_config, tokenizer):
        from megatron_zcpo.data.dataset import build_prompt_dataset
        from megatron_zcpo.rewards.scorer import RewardScorer
        from megatron_zcpo.rollout.engine import SamplingParams

        self.config = config
        self.tokenizer = tokenizer
        self.stop = stop_token_ids(config, tokenizer)
        self.params = SamplingParams(temperature=config.rollout.temperature, top_p=config.rollout.top_p,
                                     top_k=config.rollout.top_k, max_new_tokens=config.rollout.max_new_tokens,
                                     stop_token_ids=self.stop)
        self.dataset = build_prompt_dataset(config.data, tokenizer)
        self.scorer = RewardScorer(config.reward)
        self.engine = make_engine(config, model_config, tokenizer)

    def score(self, records, completions):
        return self.scorer.score_completions(records, completions, self.tokenizer)

    def collect(self, step: int):
        """One training batch of groups (dynamic sampling), as trainer samples and metrics."""
        from megatron_zcpo.rollout.dynamic_sampling import sample_groups

        rollout = self.config.rollout
        result = sample_groups(
            next_prompts=self.dataset.next_batch,
            generate=lambda records: self.engine.generate([r.prompt_ids for r in records], self.params,
                                                          n=rollout.samples_per_prompt),
            score=self.score,
            num_groups=rollout.prompts_per_step,
            config=rollout.dynamic_sampling,
        )
        samples = samples_from_groups(result, group_offset=step * 10 ** 6)
        metrics = dict(result.metrics)
        metrics.update(result.rewards.metrics())
        if samples:
            metrics.update(rollout_metrics(samples))
        return samples, metrics

    def evaluate(self, records, step: int, run_dir: Path) -> Dict[str, float]:
        return run_evaluation(self.config, self.engine, records, self.score, self.stop,
                              run_dir / "eval" / f"step_{step:06d}.json")

    def close(self) -> None:
        self.scorer.close()
        self.engine.shutdown()


def push_weights(trainer, rollout: Optional[Rollout], version: int) -> None:
    """Send the policy's weights to the rollout engine as ``version`` (collective over all ranks).

    Every stage streams its tensors, TP-gathered one at a time, to rank 0, which converts each to
    Hugging Face names on the fly (the checkpoint converter's mapping) and feeds the engine: no
    rank holds more than one full tensor (plus the engine's bucket).
    """
    import torch.distributed as dist

    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_model_tensors_to_rank0

    stream = iter_model_tensors_to_rank0(trainer.policy)
    if dist.get_rank() == 0:
        rollout.engine.update_weights(megatron_to_hf_stream(stream, trainer.model_config), version)
    else:
        for _ in stream:  # collective: every rank walks its part
            pass
    dist.barrier()


# --------------------------------------------------------------------------------- the run


def run_training(config: RunConfig) -> Dict[str, Any]:
    """Run ``config`` in this (already launched) process group; returns a summary on rank 0."""
    import torch.distributed as dist

    from megatron_zcpo.cli.metrics_log import MetricsLogger
    from megatron_zcpo.diagnostics import build_diagnostics
    from megatron_zcpo.megatron.checkpoint import find_latest
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.trainer import PolicyTrainer

    setup_megatron(tensor_parallel=config.parallel.tensor, pipeline_parallel=config.parallel.pipeline,
                   context_parallel=config.parallel.context, seed=config.train.seed)
    rank = dist.get_rank()
    run_dir = Path(config.logging.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_run_config(config))
    tokenizer = load_tokenizer(config)
    if config.model.path is not None:
        model_config, initial = resolve_model(config.model.path)
        reference = resolve_model(config.model.reference)[1] if config.model.reference else None
    else:
        model_config, initial, reference = config.model.architecture, None, None
    if len(tokenizer) > model_config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model_config.vocab_size}")
    trainer = PolicyTrainer(model_config, config.algorithm, config.train, config.parallel,
                            initial_weights=initial, reference_weights=reference,
                            temperature=config.rollout.temperature,
                            diagnostics=build_diagnostics(config.diagnostics, config.algorithm))
    rollout = Rollout(config, model_config, tokenizer) if rank == 0 else None
    start_step, loop_state = 0, {}
    resume = config.checkpoint.resume
    checkpoint = None if resume == "never" else (find_latest(config.checkpoint_dir) if resume == "auto" else Path(resume))
    if checkpoint is not None:
        loop_state = trainer.load(checkpoint).get("loop", {})
        start_step = trainer.step
        if rank == 0 and "data" in loop_state:
            rollout.dataset.load_state_dict(loop_state["data"])
    logger = MetricsLogger(run_dir, console=config.logging.console, tensorboard=config.logging.tensorboard,
                           wandb_project=config.logging.wandb_project, total_steps=config.train.steps,
                           start_step=start_step) if rank == 0 else None
    if logger and checkpoint is not None:
        logger.print(f"resumed from {checkpoint} at step {start_step}")
    held_out = eval_records(config, tokenizer) if rank == 0 else []
    push_weights(trainer, rollout, start_step)

    def evaluate(step: int) -> Dict[str, float]:
        if rank != 0 or not held_out:
            return {}
        metrics = rollout.evaluate(held_out, step, run_dir)
        logger.log(step, metrics, advance=False)
        logger.print(f"eval @ step {step}: avg@{config.eval.k} = {metrics.get(f'eval/avg@{config.eval.k}', math.nan):.3f}"
                     f" on {int(metrics.get('eval/num_problems', 0))} problems x {config.eval.k} samples")
        return metrics

    def save(step: int) -> None:
        state = {"loop": {"data": rollout.dataset.state_dict()} if rank == 0 else {}}
        # Every rank passes its state; rank 0's is the one written (it owns the prompt stream).
        trainer.save(config.checkpoint_dir, state, keep_last=config.checkpoint.keep_last)

    first_eval = evaluate(start_step) if config.eval.at_start and start_step == 0 else {}
    last_eval: Dict[str, float] = {}
    try:
        for step in range(start_step, config.train.steps):
            started = time.perf_counter()
            samples, rollout_stats = (rollout.collect(step) if rank == 0 else (None, {}))
            time_rollout = time.perf_counter() - started
            count = [len(samples) if rank == 0 else 0]
            dist.broadcast_object_list(count, src=0)
            if count[0] == 0:
                raise RuntimeError(f"step {step}: dynamic sampling kept no group (see rollout.dynamic_sampling)")
            samples = broadcast_samples(samples)
            metrics = trainer.train_step(samples)
            started_push = time.perf_counter()
            push_weights(trainer, rollout, trainer.step)
            if rank == 0:
                metrics.update(rollout_stats)
                metrics.update({"time/rollout": time_rollout, "time/weight_sync": time.perf_counter() - started_push,
                                "time/step": time.perf_counter() - started})
                logger.log(trainer.step, metrics)
                gap = metrics.get("rollout/logprob_diff_max", 0.0)
                if step == 0 and config.rollout.engine == "embedded" and not config.rollout.quantization and gap > 1e-3:
                    logger.print(f"[yellow]warning: the embedded engine's log-probs differ from the trainer's by up "
                                 f"to {gap:.2e} at step 0 (same weights: expected < 1e-3)")
            if config.eval.every and trainer.step % config.eval.every == 0 and trainer.step < config.train.steps:
                last_eval = evaluate(trainer.step) or last_eval
            if config.checkpoint.every and trainer.step % config.checkpoint.every == 0:
                save(trainer.step)
        if config.eval.at_end:
            last_eval = evaluate(trainer.step) or last_eval
        if not config.checkpoint.every or trainer.step % config.checkpoint.every:
            save(trainer.step)
    finally:
        if rollout is not None:
            rollout.close()
        if logger is not None:
            logger.close()
    return {"run_dir": str(run_dir), "first_eval": first_eval, "last_eval": last_eval, "steps": trainer.step}


# --------------------------------------------------------------------------------- command line


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("train", help="train a policy with the configured RL algorithm",
                                   description="Run the RL recipe of CONFIG (YAML); key=value overrides "
                                               "any field, e.g. algorithm.beta=4 train.steps=100.")
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="processes to start on this machine when not launched by torchrun/srun "
                             "(default: TP*PP*CP)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate the config, print it with every default filled in, and exit")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.megatron.initialize import distributed_env_from_slurm

    config = load_run_config(args.config, args.overrides)  # validate before starting anything
    if args.dry_run:
        print(dump_run_config(config), end="")
        return 0
    distributed_env_from_slurm()
    if "RANK" not in os.environ:
        nproc = world_size_needed(config, args.nproc)
        if nproc > 1:
            return relaunch_with_torchrun(["train", args.config, *args.overrides], nproc)
    summary = run_training(config)
    return 0 if summary is not None else 1
