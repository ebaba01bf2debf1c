"""Timeouts that agree: every timeout on the chain from a training rank to one SGLang request,
checked against the run's predicted durations, with the key to raise; and the SGLang start-up check.

The chain, innermost first, with what each must outlast (durations from the step-time model,
:mod:`megatron_zcpo.planning.step_time` and :mod:`megatron_zcpo.planning.decode_rate`, at mean
lengths of half the caps):

* ``rollout.sglang.client.request_timeout_s``: one /generate request, i.e. one response of the
  longest ``max_new_tokens`` at one sequence's decode speed (a server decodes ``batch``
  sequences together), times the waves in which a server works through the requests the client
  keeps in flight on it (``max_concurrency`` over the servers). Requests are one sample each: no
  single request needs hours, and a request that fails after its retries costs its prompt's
  group, not the round.
* ``rollout.sglang.client.router_timeout_s``: the router's ``--request-timeout-secs``; above the
  request timeout, so the client (which aborts and retries) gives up first.
* ``rollout.sglang.client.rollout_timeout_s``: one generate call, i.e. dynamic sampling's first
  round (``ceil(prompts_per_step x oversample_factor) x G`` samples) or one evaluation batch (64
  prompts x ``eval.k``) at the servers' throughput; and a request's retries
  (``request_timeout_s x (1 + max_retries)``), so a lost request is given up before the call.
* ``rollout.sglang.client.update_timeout_s`` / ``group_timeout_s``: one weight-update request (one
  bucket at the link's bandwidth; the whole model with the disk transport).
* ``parallel.collective_timeout_s``: the longest wait inside a training group, the weight push
  (the whole model through one link). Rank 0's phases alone (start-up, rollouts, evaluation) are
  waited for in the :class:`~megatron_zcpo.recipe.rank0_wait.Rank0Wait` group, whose timeout is
  :func:`rank0_wait_timeout_s`.

``zcpo plan`` prints the table (:func:`timeout_checks`); at start-up rank 0 checks the servers it
attached to (:func:`check_sglang_servers`: API key, context length, seeds, load format) and the
chain on their real layout, and refuses a config that fails, naming each key.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Dict, List, Optional

from megatron_zcpo.planning.decode_rate import H100_80GB_BYTES, decode_roofline, decode_tokens_per_s_per_gpu
from megatron_zcpo.planning.transitions import PUSH_BYTES_S, nccl_push_s
from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig

logger = logging.getLogger(__name__)

CLIENT = "rollout.sglang.client"
EVAL_BATCH_PROMPTS = 64  # prompts per evaluation generate call (megatron_zcpo/rollout/evaluation.py)
MEAN_FRACTION = 0.5  # mean prompt and response length as a fraction of the caps (zcpo plan's default)


# Below this size a decode step is bound by what the roofline leaves out (SGLang's per-step
# scheduling, kernel launches, HTTP): a tiny model's predicted durations are not sure.
MIN_MODELLED_PARAMETERS = 1e9


@dataclass(frozen=True)
class RolloutServers:
    """The SGLang servers the predictions assume: how many, GPUs each (``tp_size``), their
    ``mem_fraction_static``, the decode rate per GPU (None: modelled by
    :mod:`megatron_zcpo.planning.decode_rate`), GPU memory and the trainer-to-server link.
    ``known_hardware``: the servers are the GPUs these figures describe (``zcpo plan``'s
    hardware); False where nobody said (SGLang does not report its GPU type at start-up, and a
    server may run on CPUs): a duration predicted on unknown hardware only warns."""

    count: int
    tp_size: int
    mem_fraction: float = 0.85
    decode_tokens_per_s_per_gpu: Optional[float] = None
    gpu_memory_bytes: float = H100_80GB_BYTES
    known_hardware: bool = True
    dp_attention: int = 1  # SGLang's DP-attention groups per server (1: plain tensor parallelism)


@dataclass(frozen=True)
class TimeoutCheck:
    """One timeout (``key``, ``timeout_s``) against the predicted duration it bounds. ``sure``:
    the prediction may refuse a run (config arithmetic, or the modelled hardware and a model the
    roofline describes); an unsure one that fails only warns."""

    key: str
    bounds: str
    timeout_s: float
    predicted_s: float
    sure: bool = True

    @property
    def ok(self) -> bool:
        return self.timeout_s > self.predicted_s

    @property
    def refused(self) -> bool:
        """Failed, and sure enough to refuse the run."""
        return not self.ok and self.sure

    def problem(self) -> str:
        """What is wrong and what to raise (for a failed check)."""
        unsure = "" if self.sure else " (an estimate on unknown hardware or for a tiny model: a warning only)"
        return (
            f"{self.key} = {self.timeout_s:,.0f} s does not outlast {self.bounds} (predicted "
            f"{self.predicted_s:,.0f} s): raise {self.key} above {self.predicted_s:,.0f}{unsure}"
        )


def client_config(config) -> SGLangEngineConfig:
    """The run's ``rollout.sglang.client`` settings with their defaults (``config``: a RunConfig)."""
    return SGLangEngineConfig(
        server_urls=list(config.rollout.sglang.server_urls) or ["http://unset"],
        router_url=config.rollout.sglang.router_url,
        **config.rollout.sglang.client,
    )


def longest_new_tokens(config) -> int:
    """The most tokens a request of the run asks for (training or evaluation); with multi-turn
    tools, what a trajectory's budget leaves after the longest prompt (a late turn's request holds
    the earlier turns in its prompt, up to ``tools.max_total_tokens`` in all)."""
    longest = max(config.rollout.max_new_tokens, config.eval.max_new_tokens or 0)
    if config.tools.enabled:
        return max(longest, config.tools.max_total_tokens - config.data.max_prompt_length)
    return longest


def call_samples(config) -> Dict[str, int]:
    """Samples of one generate call: dynamic sampling's first round (``round``) and one evaluation
    batch (``eval_call``)."""
    rollout, sampling = config.rollout, config.rollout.dynamic_sampling
    oversample = sampling.oversample_factor if sampling.drop_tied_groups else 1.0
    return {
        "round": math.ceil(rollout.prompts_per_step * oversample) * rollout.samples_per_prompt,
        "eval_call": min(EVAL_BATCH_PROMPTS, config.eval.num_prompts) * config.eval.k,
    }


def in_flight_per_server(config, server_count: int) -> int:
    """The most requests one server holds at a time: the client's ``max_concurrency``, or a
    generate call's samples when fewer, spread over ``server_count`` servers."""
    largest_call = max(call_samples(config).values())
    return math.ceil(min(client_config(config).max_concurrency, largest_call) / server_count)


def predicted_durations(config, model, servers: RolloutServers) -> Dict[str, float]:
    """Seconds of: one request (``request``), dynamic sampling's first round (``round``), one
    evaluation batch (``eval_call``), one weight bucket (``bucket``) and the whole push (``push``)
    of ``config`` (a RunConfig) with ``model`` (ModelConfig) on ``servers``. A server decodes at
    most the requests in flight on it (:func:`in_flight_per_server`), however many its KV cache
    would hold."""
    client, rollout = client_config(config), config.rollout
    prompt, response = MEAN_FRACTION * config.data.max_prompt_length, MEAN_FRACTION * rollout.max_new_tokens
    in_flight = in_flight_per_server(config, servers.count)
    shape = dict(
        mem_fraction=servers.mem_fraction, gpu_memory_bytes=servers.gpu_memory_bytes, dp_attention=servers.dp_attention
    )
    roofline = decode_roofline(model, prompt, response, servers.tp_size, max_batch=in_flight, **shape)
    rate = servers.decode_tokens_per_s_per_gpu or decode_tokens_per_s_per_gpu(
        model, prompt, response, servers.tp_size, max_batch=in_flight, **shape
    )
    one_sequence = rate * servers.tp_size / roofline.batch  # tokens/s of one of the batch's sequences
    request = math.ceil(in_flight / max(1.0, math.floor(roofline.batch))) * longest_new_tokens(config) / one_sequence

    def call(samples: float, mean_response: float) -> float:
        return max(samples * mean_response / (rate * servers.count * servers.tp_size), request)

    samples = call_samples(config)
    model_bytes = 2 * model.num_parameters  # bf16
    return {
        "request": request,
        "round": call(samples["round"], response),
        "eval_call": call(samples["eval_call"], MEAN_FRACTION * (config.eval.max_new_tokens or rollout.max_new_tokens)),
        # the push as measured (planning/transitions.py: verl's 32B/72B NCCL broadcasts), not one link's speed
        "bucket": min(client.bucket_bytes, model_bytes) / PUSH_BYTES_S,
        "push": nccl_push_s(model_bytes),
    }


def predictions_sure(model, servers: RolloutServers) -> bool:
    """Whether predicted durations may refuse a run: on the hardware they model, for a model of at
    least :data:`MIN_MODELLED_PARAMETERS` parameters."""
    return servers.known_hardware and model.num_parameters >= MIN_MODELLED_PARAMETERS


def timeout_checks(config, model, servers: RolloutServers) -> List[TimeoutCheck]:
    """Every timeout of the chain (module docstring) against its predicted duration."""
    client = client_config(config)
    times = predicted_durations(config, model, servers)
    evaluated = config.eval.at_start or config.eval.at_end or config.eval.every
    retries = client.request_timeout_s * (1 + client.max_retries)
    update = times["push"] if client.weight_sync == "disk" else times["bucket"]
    sure = predictions_sure(model, servers)
    checks = [
        TimeoutCheck(
            f"{CLIENT}.request_timeout_s",
            "one request (a full-length response, queued behind the requests in flight on its server)",
            client.request_timeout_s,
            times["request"],
            sure,
        ),
        TimeoutCheck(
            f"{CLIENT}.rollout_timeout_s",
            "dynamic sampling's first round",
            client.rollout_timeout_s,
            times["round"],
            sure,
        ),
        TimeoutCheck(
            f"{CLIENT}.rollout_timeout_s",
            f"a request's {1 + client.max_retries} attempts (a lost request must cost its prompt, not the round)",
            client.rollout_timeout_s,
            retries,
        ),
        TimeoutCheck(f"{CLIENT}.update_timeout_s", "one weight update request", client.update_timeout_s, update, sure),
        TimeoutCheck(
            f"{CLIENT}.group_timeout_s", "one bucket's broadcast", client.group_timeout_s, times["bucket"], sure
        ),
        TimeoutCheck(
            "parallel.collective_timeout_s",
            "the weight push (ranks wait for it in a training group)",
            config.parallel.collective_timeout_s,
            times["push"],
            sure,
        ),
    ]
    if evaluated:
        checks.insert(
            2,
            TimeoutCheck(
                f"{CLIENT}.rollout_timeout_s",
                "one evaluation batch",
                client.rollout_timeout_s,
                times["eval_call"],
                sure,
            ),
        )
    if client.router_url:
        checks.insert(
            1,
            TimeoutCheck(
                f"{CLIENT}.router_timeout_s",
                "the client's request timeout",
                client.router_timeout_s,
                client.request_timeout_s,
            ),
        )
    return checks


def check_timeouts(config, model, servers: RolloutServers) -> List[TimeoutCheck]:
    """:func:`timeout_checks`; raises ``ValueError`` naming every timeout to raise where the check is
    sure, and logs a warning naming the key for each unsure one that fails. Returns the checks."""
    checks = timeout_checks(config, model, servers)
    for check in checks:
        if not check.ok and not check.sure:
            logger.warning("timeout may be short: %s", check.problem())
    failed = [check.problem() for check in checks if check.refused]
    if failed:
        raise ValueError("timeouts shorter than the predicted durations they bound:\n  " + "\n  ".join(failed))
    return checks


def render_timeout_checks(checks: List[TimeoutCheck]) -> str:
    """The checks as text lines: key, timeout, predicted duration, verdict."""
    from megatron_zcpo.planning.step_time import format_seconds

    lines = ["timeouts (predicted durations from megatron_zcpo/planning/step_time.py):"]
    for check in checks:
        verdict = "ok" if check.ok else f"RAISE above {format_seconds(check.predicted_s)}"
        verdict += "" if check.ok or check.sure else " (an estimate: warning only)"
        lines.append(
            f"  {check.key:<40} {check.timeout_s:>10,.0f} s  vs {format_seconds(check.predicted_s):>10}  "
            f"{check.bounds}: {verdict}"
        )
    return "\n".join(lines)


def rank0_wait_timeout_s(config) -> float:
    """How long the other ranks may wait for rank 0 alone (the Rank0Wait group's timeout): the
    budget of its longest stretch, start-up then evaluation and two steps' rollouts (overlapped:
    the one in flight and the next), each generate call bounded by ``rollout_timeout_s``, plus
    two weight-update commits and the collective timeout."""
    client = client_config(config)
    launch = config.rollout.sglang.launch or {}
    startup = client.startup_timeout_s + float(launch.get("startup_timeout_s", 0) or 0)
    sampling = config.rollout.dynamic_sampling
    rounds = sampling.max_rounds if sampling.drop_tied_groups else 1
    evaluation = math.ceil(config.eval.num_prompts / EVAL_BATCH_PROMPTS)
    return (
        startup
        + (2 * rounds + evaluation) * client.rollout_timeout_s
        + 2 * client.update_timeout_s
        + config.parallel.collective_timeout_s
    )


def check_sglang_servers(config, model, engine) -> List[TimeoutCheck]:
    """Rank 0's start-up check of the SGLang servers of ``engine`` for ``config``: the API key,
    every server's context length against ``data.max_prompt_length + max_new_tokens``, seeds and
    load format (:meth:`SGLangEngine.check_servers`), then the timeout chain on the servers'
    real layout. Raises ``RolloutError`` / ``ValueError`` naming what to change."""
    facts = engine.check_servers(config.data.max_prompt_length, longest_new_tokens(config), config.model.lora)
    fractions = [fact.mem_fraction_static for fact in facts if fact.mem_fraction_static]
    servers = RolloutServers(
        count=len(facts),
        tp_size=max(fact.tp_size for fact in facts),
        mem_fraction=min(fractions) if fractions else RolloutServers.mem_fraction,
        known_hardware=False,  # SGLang does not report its GPU type: predictions only warn
    )
    return check_timeouts(config, model, servers)
