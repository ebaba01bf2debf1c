"""The recipe's rollout side: engine construction, sampling with dynamic sampling, scoring, and the broadcast.

Global rank 0 drives the rollout engine, the reward workers and the prompt stream
(:class:`Rollout`); :func:`broadcast_samples` hands the kept groups to every trainer rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from megatron_zcpo.recipe.config import RunConfig
from megatron_zcpo.rollout.engine import STOP_POLL_S, RolloutInterrupted
from megatron_zcpo.training.batch import RolloutSample
from megatron_zcpo.utils.devices import compute_device

# What a multi-turn trajectory's Completion.info says about it, kept in the trainer sample's info.
TRAJECTORY_KEYS = ("turns", "tool_calls", "tool_errors", "stop_reason")


def samples_from_groups(result, group_offset: int) -> List[RolloutSample]:
    """Flatten dynamic sampling's kept groups into trainer samples (group ids unique per step)."""
    samples = []
    rewards = result.rewards
    for group, (record, completions) in enumerate(zip(result.records, result.completions)):
        for member, completion in enumerate(completions):
            samples.append(
                RolloutSample(
                    prompt_ids=list(completion.prompt_ids),
                    response_ids=list(completion.output_ids),
                    group_id=group_offset + group,
                    reward=float(rewards.reward[group, member]),
                    trainable=bool(rewards.loss_mask[group, member]),
                    rollout_logprobs=list(completion.output_logprobs),
                    info={
                        "score": float(rewards.score[group, member]),
                        "truncated": bool(rewards.truncated[group, member]),
                        "uid": record.uid,
                        "weight_version": completion.weight_version,
                        **{key: completion.info[key] for key in TRAJECTORY_KEYS if key in completion.info},
                    },
                    routed_experts=completion.routed_experts,
                    response_mask=None if completion.output_mask is None else list(completion.output_mask),
                )
            )
    return samples


def rollout_metrics(samples: Sequence[RolloutSample]) -> Dict[str, float]:
    """Reward, accuracy and length statistics of the trained rollout (lengths count the policy's
    tokens), and with multi-turn rollouts the turns and tool calls per trajectory."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
    lengths = torch.tensor([s.policy_length for s in samples], dtype=torch.float64)
    tools = {}
    if all("tool_calls" in s.info for s in samples):
        calls = torch.tensor([s.info["tool_calls"] for s in samples], dtype=torch.float64)
        tools = {
            "rollout/tool_call_fraction": float((calls > 0).double().mean()),
            "rollout/tool_calls_mean": float(calls.mean()),
            "rollout/tool_errors_mean": sum(s.info["tool_errors"] for s in samples) / len(samples),
            "rollout/turns_mean": sum(s.info["turns"] for s in samples) / len(samples),
            "rollout/tool_tokens_mean": sum(len(s.response_ids) - s.policy_length for s in samples) / len(samples),
        }
    return {
        "rollout/reward_mean": float(rewards.mean()),
        "rollout/reward_std": float(rewards.std()) if len(samples) > 1 else 0.0,
        "rollout/accuracy": sum(s.info.get("score", 0.0) > 0 for s in samples) / len(samples),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/clip_ratio": sum(bool(s.info.get("truncated")) for s in samples) / len(samples),
        "rollout/samples": float(len(samples)),
        "rollout/groups": float(len({s.group_id for s in samples})),
        **tools,
    }


def broadcast_samples(samples: Optional[List[RolloutSample]], src: int = 0) -> List[RolloutSample]:
    """Send rank ``src``'s rollout to every rank, keeping token ids and log-probs in tensors.

    Per-token data travel as two flat tensors: int32 token ids [sum of prompt + response lengths]
    and float32 rollout log-probs [sum of the response lengths of samples that have them]; only
    the small per-sample fields go through the object broadcast. Every rank (the sender too)
    returns samples whose ``prompt_ids``, ``response_ids`` and ``rollout_logprobs`` are 1-D views
    of those two CPU tensors: no Python object per token (at 8,192 x 22.5k tokens about 0.7 GB of
    int32 per rank instead of ~6 GB of Python ints), identical float32 values on every rank.
    Mixture-of-experts routing (``routed_experts``, when the engine returned it) travels as a third
    flat tensor, uint8 when every expert id fits (up to 256 experts, Qwen3-MoE's 128) else int32,
    each sample's a [sequence, layers * top-k] view of it; multi-turn response masks as a fourth (uint8).
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    device = compute_device()
    header = [None]
    if rank == src:
        routed = [s.routed_experts for s in samples if s.routed_experts is not None]
        narrow = all(int(r.max()) < 256 for r in routed if r.numel())
        header[0] = (
            [
                (
                    len(s.prompt_ids),
                    len(s.response_ids),
                    s.group_id,
                    s.reward,
                    s.trainable,
                    s.rollout_logprobs is not None,
                    s.info,
                    None if s.routed_experts is None else tuple(s.routed_experts.shape),
                    s.response_mask is not None,
                )
                for s in samples
            ],
            torch.uint8 if narrow else torch.int32,
        )
    dist.broadcast_object_list(header, src=src)
    header, routing_dtype = header[0]
    if rank == src:
        tokens = _flat([ids for s in samples for ids in (s.prompt_ids, s.response_ids)], torch.int32).to(device)
        logprobs = _flat([s.rollout_logprobs for s in samples if s.rollout_logprobs is not None], torch.float32).to(
            device
        )
        routing = _flat([r.reshape(-1) for r in routed], routing_dtype).to(device)
        masks = _flat([s.response_mask for s in samples if s.response_mask is not None], torch.uint8).to(device)
    else:
        tokens = torch.empty(sum(p + r for p, r, *_ in header), dtype=torch.int32, device=device)
        logprobs = torch.empty(sum(r for _, r, _, _, _, has, *_ in header if has), dtype=torch.float32, device=device)
        routing = torch.empty(
            sum(shape[0] * shape[1] for *_, shape, _ in header if shape), dtype=routing_dtype, device=device
        )
        masks = torch.empty(sum(r for _, r, *_, masked in header if masked), dtype=torch.uint8, device=device)
    dist.broadcast(tokens, src=src)
    dist.broadcast(logprobs, src=src)
    if routing.numel():
        dist.broadcast(routing, src=src)
    if masks.numel():
        dist.broadcast(masks, src=src)
    tokens, logprobs, routing, masks = tokens.cpu(), logprobs.cpu(), routing.cpu(), masks.cpu()
    token_offset, logprob_offset, routing_offset, mask_offset, out = 0, 0, 0, 0, []
    for prompt_len, response_len, group_id, reward, trainable, has_logprobs, info, routing_shape, masked in header:
        prompt = tokens[token_offset : token_offset + prompt_len]
        response = tokens[token_offset + prompt_len : token_offset + prompt_len + response_len]
        token_offset += prompt_len + response_len
        rollout_logprobs = routed_experts = None
        if has_logprobs:
            rollout_logprobs = logprobs[logprob_offset : logprob_offset + response_len]
            logprob_offset += response_len
        if routing_shape:
            size = routing_shape[0] * routing_shape[1]
            routed_experts = routing[routing_offset : routing_offset + size].view(routing_shape)
            routing_offset += size
        response_mask = None
        if masked:
            response_mask = masks[mask_offset : mask_offset + response_len]
            mask_offset += response_len
        out.append(
            RolloutSample(
                prompt, response, group_id, reward, trainable, rollout_logprobs, info, routed_experts, response_mask
            )
        )
    return out


def _flat(pieces, dtype: torch.dtype) -> torch.Tensor:
    """One 1-D tensor of ``dtype`` from lists or tensors (empty when there are none)."""
    return (
        torch.cat([torch.as_tensor(piece, dtype=dtype) for piece in pieces]) if pieces else torch.empty(0, dtype=dtype)
    )


def stop_token_ids(config: RunConfig, tokenizer) -> tuple:
    """The configured stop tokens plus the tokenizer's end-of-sequence token."""
    stop = list(config.rollout.stop_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in stop:
        stop.append(tokenizer.eos_token_id)
    return tuple(stop)


def make_engine(config: RunConfig, model_config, tokenizer):
    """The configured rollout engine, driven turn by turn with the run's tools when ``tools.enabled``
    (:class:`~megatron_zcpo.rollout.multi_turn.MultiTurnEngine`)."""
    engine = make_single_turn_engine(config, model_config, tokenizer)
    if not config.tools.enabled:
        return engine
    from megatron_zcpo.agent_tools.registry import ToolRegistry
    from megatron_zcpo.rollout.multi_turn import MultiTurnEngine, ToolTurnTemplate

    try:
        context = model_config.max_position_embeddings
        if config.rollout.engine == "embedded" and config.tools.max_total_tokens > context:
            raise ValueError(
                f"tools.max_total_tokens={config.tools.max_total_tokens} exceeds the model's context ({context})"
            )
        data = config.data  # tool turns in the prompts' format (eval.data must agree: RunConfig.validate)
        template = ToolTurnTemplate.from_chat_template(
            tokenizer, config.tools.result_role, data.chat_template, data.enable_thinking
        )
        return MultiTurnEngine(engine, ToolRegistry.from_config(config.tools), tokenizer, config.tools, template)
    except BaseException:
        engine.shutdown()
        raise


def make_single_turn_engine(config: RunConfig, model_config, tokenizer):
    """The configured rollout engine: embedded (this process) or SGLang (launched or attached).

    SGLang servers are checked once healthy (:func:`megatron_zcpo.recipe.timeouts.check_sglang_servers`:
    API key, context length, seeds, load format, timeouts); launched ones get the settings that
    must agree with the client from :func:`~megatron_zcpo.rollout.sglang.server.server_config_for_run`.
    """
    rollout = config.rollout
    if rollout.engine == "embedded":
        from megatron_zcpo.rollout.embedded import EmbeddedEngine

        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        return EmbeddedEngine(
            model_config,
            seed=rollout.seed,
            quantization=rollout.quantization,
            pad_token_id=pad,
            record_routed_experts=config.train.routing_replay != "none",
            memory_saver=rollout.placement == "colocated",
        )
    from megatron_zcpo.recipe.timeouts import check_sglang_servers, longest_new_tokens
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    if not (rollout.sglang.server_urls or rollout.sglang.launch):
        raise ValueError(
            "rollout.engine=sglang needs rollout.sglang.server_urls (attach to running servers) "
            "or rollout.sglang.launch (start them)"
        )
    # Token ids are checked against the trainer's vocabulary (rollout/output_checks.py).
    client = dict(rollout.sglang.client, quantization=rollout.quantization, vocab_size=model_config.vocab_size)
    launch = rollout.sglang.launch
    if rollout.placement == "colocated":
        client = colocated_client(client, config)
        launch = None if launch is None else {**launch, "enable_memory_saver": True}
    if launch is not None:
        from megatron_zcpo.rollout.sglang.server import (
            SGLangLauncher,
            launch_sglang,
            server_config_for_run,
            weight_update_groups,
        )

        client_config = SGLangEngineConfig(server_urls=["unset"], **client)
        servers = server_config_for_run(
            launch,
            client_config,
            config.data.max_prompt_length,
            longest_new_tokens(config),
            weight_update_groups(config.parallel.pipeline, config.parallel.expert, client_config),
            lora=config.model.lora,
        )
        engine = launch_sglang(SGLangLauncher(servers), **client)
    else:
        engine = SGLangEngine(
            SGLangEngineConfig(
                server_urls=list(rollout.sglang.server_urls), router_url=rollout.sglang.router_url, **client
            )
        )
        engine.wait_until_healthy()  # rollout.sglang.client.startup_timeout_s
    try:
        check_sglang_servers(config, model_config, engine)
    except BaseException:
        engine.shutdown()
        raise
    return engine


def colocated_client(client: Dict, config: RunConfig) -> Dict:
    """The SGLang client settings of a colocated run (``config``): the weights go in place through CUDA
    IPC ("tensor", every GPU feeding the server ranks beside it) on a one-node GPU job without
    pipeline or expert parallelism (every rank then walks the whole model), else through the disk,
    into ``<run_dir>/colocated_weights`` unless ``weight_dir`` is set. Every rank computes the same."""
    import os

    from megatron_zcpo.utils.devices import has_cuda

    client = dict(client)
    one_node = int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) == 1
    whole_model_per_rank = config.parallel.pipeline == 1 and config.parallel.expert == 1
    client.setdefault("weight_sync", "tensor" if has_cuda() and one_node and whole_model_per_rank else "disk")
    if client["weight_sync"] == "disk":
        client.setdefault("weight_dir", os.path.join(config.logging.run_dir, "colocated_weights"))
    return client


@contextlib.contextmanager
def interrupted_on_stop(engine, stop_requested: Optional[Callable[[], int]]) -> Iterator[None]:
    """While the body runs, a thread asks ``stop_requested()`` (a stop request: nonzero; e.g.
    :meth:`~megatron_zcpo.training.preemption.PreemptionGuard.requested`) every ``STOP_POLL_S`` and at the
    first request interrupts the engine's generation (:meth:`~megatron_zcpo.rollout.engine.RolloutEngine.interrupt_generation`:
    the ``generate`` call in progress and every later one in the body raise ``RolloutInterrupted``).
    On exit the engine generates normally again. ``stop_requested`` None: nothing is watched."""
    if stop_requested is None:
        yield
        return
    finished = threading.Event()

    def watch() -> None:
        while not finished.is_set():
            if stop_requested():
                engine.interrupt_generation()
                return
            finished.wait(STOP_POLL_S)

    watcher = threading.Thread(target=watch, name="zcpo-stop-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        finished.set()
        watcher.join()
        engine.clear_interrupt()


class Rollout:
    """Rank 0's rollout side: engine, prompt stream, reward workers and sampling parameters.

    ``stop_requested`` (set by the recipe once its preemption guard is installed; None: not watched):
    a stop request seen while :meth:`collect` runs abandons that rollout (:func:`interrupted_on_stop`).
    """

    def __init__(self, config: RunConfig, model_config, tokenizer):
        from megatron_zcpo.data.dataset import build_prompt_dataset
        from megatron_zcpo.rewards.scorer import RewardScorer
        from megatron_zcpo.rollout.engine import SamplingParams

        self.config = config
        self.tokenizer = tokenizer
        self.stop = stop_token_ids(config, tokenizer)
        self.params = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            top_k=config.rollout.top_k,
            max_new_tokens=config.rollout.max_new_tokens,
            stop_token_ids=self.stop,
        )
        self.dataset = build_prompt_dataset(config.data, tokenizer)
        self.scorer = RewardScorer(config.reward)
        self.engine = make_engine(config, model_config, tokenizer)
        self.stop_requested: Optional[Callable[[], int]] = None

    def score(self, records, completions):
        """The reward batch of ``completions`` (groups of Completion) for ``records``."""
        return self.scorer.score_completions(records, completions, self.tokenizer)

    def collect(self, step: int):
        """One training batch of groups (dynamic sampling), as trainer samples and metrics.

        Round r of step ``step`` samples with seed ``round_seed(rollout.seed, step, r)``: a resumed
        run draws the same samples as an uninterrupted one. Raises
        :class:`~megatron_zcpo.rewards.scorer.RewardFailureRateError` when more of the rollout's
        reward calls failed than ``reward.max_failed_fraction`` (before any sampling cap error), and
        ``RolloutInterrupted`` when a stop request (``stop_requested``) came before its last round was
        generated: the prompt stream is then back where it was, so a rerun draws this rollout again.
        """
        position = self.dataset.state_dict()
        try:
            with interrupted_on_stop(self.engine, self.stop_requested):
                return self._collect(step)
        except RolloutInterrupted:
            self.dataset.load_state_dict(position)
            raise

    def _collect(self, step: int):
        from megatron_zcpo.rewards.scorer import RewardFailureRateError
        from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingError, round_seed, sample_groups

        rollout = self.config.rollout
        rounds = itertools.count()
        rejected_before = getattr(self.engine, "rejected_samples", 0)

        def generate(records):
            params = dataclasses.replace(self.params, seed=round_seed(rollout.seed, step, next(rounds)))
            return self.engine.generate([r.prompt_ids for r in records], params, n=rollout.samples_per_prompt)

        self.scorer.start_tally()
        what = f"step {step}'s rollout"
        try:
            result = sample_groups(
                next_prompts=self.dataset.next_batch,
                generate=generate,
                score=self.score,
                num_groups=rollout.prompts_per_step,
                config=rollout.dynamic_sampling,
            )
        except DynamicSamplingError:  # groups tied by made-up failure scores: then the reward is the cause
            try:
                self.scorer.check_failure_rate(what)
            except RewardFailureRateError as broken_reward:
                raise broken_reward from None
            raise
        failure_metrics = self.scorer.check_failure_rate(what)
        samples = samples_from_groups(result, group_offset=step * 10**6)
        metrics = dict(result.metrics)
        metrics["rollout/rejected_samples"] = float(getattr(self.engine, "rejected_samples", 0) - rejected_before)
        if rollout.mode == "sync":  # (overlapped rollouts report their staleness themselves)
            # The engine serves version `step` (pushed after the previous step): anything else is stale.
            metrics["rollout/stale_samples"] = float(
                sum(c.weight_version not in (None, step) for group in result.completions for c in group)
            )
        metrics.update(result.rewards.metrics())
        metrics.update(failure_metrics)
        if samples:
            metrics.update(rollout_metrics(samples))
        return samples, metrics

    def close(self) -> None:
        """Stop the reward workers and the engine."""
        self.scorer.close()
        self.engine.shutdown()
