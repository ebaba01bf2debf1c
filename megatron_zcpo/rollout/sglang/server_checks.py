"""Start-up checks of the SGLang servers a run attaches to: the API key, context length, seeds and load format.

What each server was launched with decides whether the run works: a key it does not accept
(401), a context length that refuses the longest prompt (400 on the first long prompt), per-request
seeds it ignores (no deterministic inference), a weight load format it lacks (the push hangs).
:func:`check_servers` reads every server's ``/get_server_info`` (and the router's
``/workers``, both behind the key) once before anything long starts and names every problem
with the config key or launch flag that fixes it. Behaviour of the pinned release:
:mod:`megatron_zcpo.rollout.sglang.api`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.api import (
    FLATTENED_BUCKETS_SINCE,
    NEWEST_CHECKED_RELEASE,
    PINNED_RELEASE,
    ROUTED_EXPERTS_RELEASE,
    ROUTER_KEY_CHECK_PATH,
    SERVER_INFO_PATHS,
    release_at_least,
    required_context_length,
    served_tokens,
)
from megatron_zcpo.rollout.sglang.config import API_KEY_ENV
from megatron_zcpo.rollout.sglang.http import SGLangHTTPError

KEY = "rollout.sglang.client"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerFacts:
    """What one server reports: its URL, GPUs (``tp_size``), SGLang ``version``, the most prompt +
    new tokens it serves in full (``served_tokens``, None if unknown), whether it uses per-request
    seeds (``deterministic``), its ``mem_fraction_static`` (None if unknown), its LoRA serving
    (``lora_rank``: ``--max-lora-rank`` under ``--enable-lora``, None without; ``lora_target_modules``),
    and whether it releases memory on request (``memory_saver``) keeping a host copy of its weights
    (``weights_cpu_backup``)."""

    url: str
    tp_size: int
    version: str
    served_tokens: Optional[int]
    deterministic: bool
    mem_fraction_static: Optional[float]
    lora_rank: Optional[int] = None
    lora_target_modules: Tuple[str, ...] = ()
    memory_saver: bool = False
    weights_cpu_backup: bool = False

    @classmethod
    def from_server_info(cls, url: str, info: Dict[str, Any]) -> ServerFacts:
        """The facts of a ``/get_server_info`` answer."""
        fraction = info.get("mem_fraction_static")
        return cls(
            url=url,
            tp_size=int(info.get("tp_size", 1)),
            version=str(info.get("version", "")),
            served_tokens=served_tokens(info),
            deterministic=bool(info.get("enable_deterministic_inference")),
            mem_fraction_static=None if fraction is None else float(fraction),
            lora_rank=int(info.get("max_lora_rank") or 0) if info.get("enable_lora") else None,
            lora_target_modules=tuple(info.get("lora_target_modules") or ()),
            memory_saver=bool(info.get("enable_memory_saver")),
            weights_cpu_backup=bool(info.get("enable_weights_cpu_backup")),
        )


def unauthorized(url: str, error: SGLangHTTPError) -> str:
    """The message for a 401 from ``url``: which key to set."""
    return (
        f"{url} refused the API key (HTTP {error.status}): set {KEY}.api_key (or the environment variable "
        f"{API_KEY_ENV}) to the key the SGLang servers and router were launched with (--api-key)"
    )


def lora_problems(facts: ServerFacts, lora) -> List[str]:
    """What keeps the server of ``facts`` from taking the run's weights: ``lora`` (``model.lora``, or None)
    pushed as an adapter needs LoRA serving of its rank and modules; every other push (whole or merged
    weights) needs a server without it, which would pass over the adapted projections' weights."""
    from megatron_zcpo.convert.peft import hf_target_modules

    if lora is None or lora.push != "adapter":
        if facts.lora_rank is None:
            return []
        return [
            f"{facts.url} was launched with --enable-lora: SGLang renames the projections it adapts, and a weight "
            f"push (model.lora.push=merged, or no model.lora) would pass over them without an error; launch it "
            f"without --enable-lora, or push the adapter alone (model.lora.push=adapter)"
        ]
    modules = hf_target_modules(lora)
    flags = f"--enable-lora --max-lora-rank {lora.rank} --lora-target-modules {' '.join(modules)}"
    if facts.lora_rank is None:
        return [f"model.lora.push=adapter, but {facts.url} has no LoRA serving: launch it with {flags}"]
    missing = sorted(set(modules) - set(facts.lora_target_modules))
    if facts.lora_rank < lora.rank or missing:
        return [
            f"{facts.url} serves LoRA adapters up to rank {facts.lora_rank} on {list(facts.lora_target_modules)}, "
            f"model.lora needs rank {lora.rank} on {modules}: launch it with {flags}"
        ]
    return []


def server_problems(facts: ServerFacts, config, max_prompt_length: int, max_new_tokens: int, lora=None) -> List[str]:
    """What keeps the server of ``facts`` from serving the run (``config``: its SGLangEngineConfig;
    ``lora``: the run's ``model.lora``)."""
    problems = lora_problems(facts, lora)
    longest = max_prompt_length + max_new_tokens
    if facts.served_tokens is not None and facts.served_tokens < longest:
        problems.append(
            f"{facts.url} serves at most {facts.served_tokens} prompt + new tokens, but data.max_prompt_length + "
            f"rollout.max_new_tokens = {max_prompt_length} + {max_new_tokens} = {longest}: SGLang refuses a "
            f"request of prompt + max_new_tokens >= its context length with HTTP 400 and cuts max_new_tokens "
            f"to context length - 2 - prompt; launch the servers with --context-length "
            f">= {required_context_length(max_prompt_length, max_new_tokens)} (and a KV pool that holds it), or "
            f"lower data.max_prompt_length / rollout.max_new_tokens"
        )
    if config.sampling_seeds and not facts.deterministic:
        problems.append(
            f"{KEY}.sampling_seeds is true but {facts.url} was not launched with --enable-deterministic-inference: "
            f"SGLang {facts.version or '0.5.3.post3'} then ignores per-request seeds and the samples are not "
            f"reproducible; launch it with --enable-deterministic-inference --attention-backend fa3 (or set "
            f"{KEY}.sampling_seeds=false)"
        )
    if facts.deterministic and not config.sampling_seeds:
        problems.append(
            f"{facts.url} runs with --enable-deterministic-inference but {KEY}.sampling_seeds is false: such a "
            f"server samples every request without a seed with seed 42, so the G samples of a prompt would all "
            f"be the same; set {KEY}.sampling_seeds=true"
        )
    if (
        config.flattened_buckets
        and config.weight_sync == "distributed"
        and not release_at_least(facts.version, FLATTENED_BUCKETS_SINCE)
    ):
        problems.append(
            f"{KEY}.flattened_buckets is true but {facts.url} runs SGLang {facts.version!r}: the flattened_bucket "
            f"load format of /update_weights_from_distributed exists from {FLATTENED_BUCKETS_SINCE} on; an older "
            f"server ignores it and waits for tensors one by one, so the push hangs; set "
            f"{KEY}.flattened_buckets=false"
        )
    if config.quantization == "fp8" and facts.memory_saver and not facts.weights_cpu_backup:
        problems.append(
            f"rollout.quantization=fp8 with {facts.url} launched with --enable-memory-saver (colocated placement) "
            f"but without --enable-weights-cpu-backup: a release keeps only the model's buffers "
            f"(scheduler weight_updater.py: _export_static_state), so the FP8 activation scales (input_scale "
            f"parameters, which come from the server's checkpoint and no push carries) are lost at the first "
            f"release; launch the servers with --enable-weights-cpu-backup (rollout.sglang.launch and "
            f"examples/common/sglang_node.py --run-config add it)"
        )
    if config.return_routed_experts and not release_at_least(facts.version, ROUTED_EXPERTS_RELEASE):
        problems.append(
            f"{KEY}.return_routed_experts is true (train.routing_replay=rollout) but {facts.url} runs SGLang "
            f"{facts.version!r}, which returns routed experts from {ROUTED_EXPERTS_RELEASE} on (launched with "
            f"--enable-return-routed-experts); use a newer SGLang (docs/SGLANG.md) or another train.routing_replay"
        )
    return problems


def untested_version(facts: ServerFacts) -> Optional[str]:
    """A warning when the server's SGLang release is outside the tested range (docs/SGLANG.md), else None."""
    if release_at_least(facts.version, PINNED_RELEASE) and not release_at_least(
        facts.version, NEWEST_CHECKED_RELEASE + ".post9999"
    ):
        return None
    return (
        f"{facts.url} runs SGLang {facts.version!r}, outside the tested range {PINNED_RELEASE} .. "
        f"{NEWEST_CHECKED_RELEASE} (docs/SGLANG.md): its protocol is assumed to be the nearest tested release's"
    )


async def gather_facts(http, urls: List[str], router_url: Optional[str]) -> List[ServerFacts]:
    """Every server's facts (and the router's key check), on ``http``'s loop; raises ``RolloutError``
    naming every server that refused the key or could not answer."""
    import asyncio

    async def facts(url):
        return ServerFacts.from_server_info(url, await http.get_first_served(url, SERVER_INFO_PATHS))

    answers = await asyncio.gather(*(facts(url) for url in urls), return_exceptions=True)
    if router_url:

        async def router_key():  # sglang-router 0.2.0 and 0.3.2 guard GET /workers with their key
            await http.request("GET", router_url + ROUTER_KEY_CHECK_PATH, retry=False)

        answers.append((await asyncio.gather(router_key(), return_exceptions=True))[0])
        urls = [*urls, router_url]
    problems = []
    for url, answer in zip(urls, answers):
        if isinstance(answer, SGLangHTTPError) and answer.status in (401, 403):
            problems.append(unauthorized(url, answer))
        elif isinstance(answer, BaseException):
            problems.append(f"{url}: /get_server_info failed: {answer}")
    if problems:
        raise RolloutError("SGLang start-up check failed:\n  " + "\n  ".join(problems))
    return [answer for answer in answers if isinstance(answer, ServerFacts)]


def check_servers(http, config, max_prompt_length: int, max_new_tokens: int, lora=None) -> List[ServerFacts]:
    """Check the servers of ``config`` (an SGLangEngineConfig; ``http`` its SGLangHTTP) against the
    run: the key, then each server's context length, seeds, load format and LoRA serving (``lora``:
    the run's ``model.lora``). Returns their facts; raises ``RolloutError`` listing every problem,
    each naming the key or launch flag that fixes it."""
    facts = http.run(gather_facts(http, list(config.server_urls), config.router_url))
    for warning in filter(None, map(untested_version, facts)):
        logger.warning(warning)
    problems = [
        problem for fact in facts for problem in server_problems(fact, config, max_prompt_length, max_new_tokens, lora)
    ]
    if problems:
        raise RolloutError("SGLang start-up check failed:\n  " + "\n  ".join(problems))
    return facts
