"""Decode tokens/s per GPU of an SGLang rollout server, on paper: a roofline calibrated on SGLang's
published throughput of Llama-3.1-70B on 4x H100.

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig` (no GPU). A server of
``t`` GPUs (tensor parallel) holds the bf16 weights, ``W = 2 x parameters`` bytes, and gives the
rest of its static memory to the KV cache: ``KV = t x GPU memory x mem_fraction - W`` (SGLang's
``--mem-fraction-static`` covers weights and KV pool). A token's KV costs ``k = 2 (K and V) x
layers x kv_heads x head_dim x 2`` bytes. Each running sequence holds its full length (prompt
``p`` + response ``r``), so ``B = KV / (k (p + r))`` sequences decode together, at a mean context
``c = p + r / 2``. One decode step of the batch takes the longer of reading the weights and every
sequence's KV cache, and running the batch's matmuls::

    step = max((W + B k c) / (t x HBM bytes/s), B x F(c) / (t x peak FLOP/s))

(``F(c)``: forward FLOPs of one token attending to ``c`` tokens,
:func:`~megatron_zcpo.planning.flops.forward_flops_per_token`). Per step ``B / r`` sequences
finish and as many new prompts are prefilled, ``p x F(p / 2)`` FLOPs each, on the same GPUs::

    prefill = (B / r) x p x F(p / 2) / (t x peak FLOP/s)
    tokens/s per GPU = efficiency x B / (t x (step + prefill))

The one free parameter, ``efficiency`` (the fraction of the roofline reached), is calibrated so
that the model reproduces :data:`SGLANG_V030_LLAMA31_70B_SHAREGPT`: SGLang v0.3.0, Llama 3.1 70B
Instruct on 4x H100 80GB (``--tp 4 --mem-frac 0.88 --disable-radix-cache``), offline
``sglang.bench_serving --dataset-name sharegpt --num-prompts 5000``: 19.84 requests/s, 3,856.01
output tokens/s (sgl-project/sglang, benchmark/benchmark_vllm_060/README.md,
https://github.com/sgl-project/sglang/blob/main/benchmark/benchmark_vllm_060/README.md). Mean
response = 3,856.01 / 19.84 = 194.4 tokens; mean prompt 224 tokens, from another published
``sglang.bench_serving --dataset-name sharegpt`` run with the same (Llama 3.1) tokenizer: 369,103
input and 326,408 output tokens over 1,648 requests (sgl-project/sglang issue 2805,
https://github.com/sgl-project/sglang/issues/2805; its 198 output tokens per request agree).

Limits: ShareGPT responses are short (about 200 tokens) and prefill-heavy, where the roofline is
compute-bound; 10k-token RL responses are bound by HBM bandwidth, so the calibrated efficiency is
transferred from one regime to the other. SGLang's published online figures on the same servers
(median TPOT 25.03 and 33.07 ms at 4 and 8 requests/s, about 12 and 33 requests in flight by
Little's law on the median latency) imply a bandwidth efficiency of 0.42 and 0.33 against the
calibrated 0.29: the modelled rate is on the low side. SGLang v0.3.0 is older than the servers
we run. The scheduler admits more requests than full-length reservations allow and retracts them
when the pool fills (not modelled). FP8 weights (``quantization``) are not modelled either.

A step's generation (:func:`generation_time`) adds what throughput at mean lengths hides: the
batch a server holds is bounded by the requests in flight on it (:func:`in_flight_batch`), and the
step waits for its longest response, which decodes within the batch for the bulk's steps and then
at a small batch, at the 0.42 efficiency of the 4 requests/s TPOT above
(:func:`small_batch_efficiency`). A server spanning nodes pays two cross-node collectives per layer
and step (:func:`internode_allreduce_s`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.flops import H100_BF16_DENSE_FLOPS, forward_flops_per_token
from megatron_zcpo.planning.memory_model import H100_80GB_GIB

H100_HBM3_BYTES_S = 3.35e12  # NVIDIA H100 SXM datasheet, HBM3 bandwidth
H100_80GB_BYTES = H100_80GB_GIB * 2**30
BF16_BYTES = 2


@dataclass(frozen=True)
class DecodeMeasurement:
    """A published server throughput and the setup it was measured on.

    ``output_tokens_per_s``: generated tokens/s of the whole server (``tensor_parallel`` GPUs);
    ``prompt_tokens`` / ``response_tokens``: mean lengths of the requests.
    """

    source: str
    model: ModelConfig
    tensor_parallel: int
    mem_fraction: float
    prompt_tokens: float
    response_tokens: float
    output_tokens_per_s: float
    gpu_memory_bytes: float = H100_80GB_BYTES


# Llama 3.1 70B: what the roofline reads of it equals the Llama-3.3-70B preset's (same
# architecture; tests/planning/test_decode_rate.py checks it); RoPE settings do not enter.
LLAMA31_70B = ModelConfig(
    family="llama",
    vocab_size=128256,
    hidden_size=8192,
    intermediate_size=28672,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)

SGLANG_V030_LLAMA31_70B_SHAREGPT = DecodeMeasurement(
    source="SGLang v0.3.0, Llama 3.1 70B Instruct, 4x H100 80GB, offline ShareGPT, 5,000 prompts "
    "(github.com/sgl-project/sglang benchmark/benchmark_vllm_060/README.md)",
    model=LLAMA31_70B,
    tensor_parallel=4,
    mem_fraction=0.88,
    prompt_tokens=369103 / 1648,
    response_tokens=3856.01 / 19.84,
    output_tokens_per_s=3856.01,
)


@dataclass(frozen=True)
class DecodeRoofline:
    """One server at efficiency 1: ``batch`` sequences, seconds of a decode ``step`` and of the
    ``prefill`` it carries, and the resulting tokens/s per GPU."""

    batch: float
    step_s: float
    prefill_s: float
    tokens_per_s_per_gpu: float


def kv_bytes_per_token(model: ModelConfig, tensor_parallel: int = 1, dp_attention: int = 1) -> float:
    """bf16 bytes one token's keys and values take in a TP-``tensor_parallel`` server, over all layers
    and GPUs. A GPU of an attention-TP group (``tensor_parallel / dp_attention`` GPUs: SGLang's DP
    attention splits a server into ``dp_attention`` groups, each with its own requests) holds its
    share of the key/value heads, and a whole copy where there are fewer heads than GPUs: GQA's
    ``num_key_value_heads`` below the group, and multi-latent attention's one latent per layer
    (:func:`~megatron_zcpo.megatron.deepseek.latent_cache_elements`), held by every GPU of the group."""
    group = max(1, tensor_parallel // dp_attention)
    if model.is_mla:
        from megatron_zcpo.megatron.deepseek import latent_cache_elements

        return model.num_layers * latent_cache_elements(model) * BF16_BYTES * group
    per_copy = 2 * model.num_layers * model.num_key_value_heads * model.kv_channels * BF16_BYTES
    return per_copy * max(1.0, group / model.num_key_value_heads)


def served_weight_bytes(
    model: ModelConfig, tensor_parallel: int, dp_attention: int = 1, weight_bytes: float = BF16_BYTES
) -> float:
    """Bytes of one TP-``tensor_parallel`` server's weights (``weight_bytes`` per parameter: bf16, or 1
    for FP8 serving); under DP attention in ``dp_attention`` groups each group holds the attention
    whole (split over its own GPUs)."""
    replicated = (dp_attention - 1) * model.num_layers * model.attention_parameters()
    return weight_bytes * (model.num_parameters + replicated)


# The weights of a planned server take at most this share of its static memory (the rest: KV cache).
SERVED_WEIGHTS_MAX_SHARE = 0.9


def smallest_server_tp(
    model: ModelConfig, mem_fraction: float, gpu_memory_bytes: float = H100_80GB_BYTES, at_least: int = 1
) -> int:
    """The fewest GPUs (a power of two, at least ``at_least``) of a server whose bf16 weights
    (:func:`served_weight_bytes`) take at most :data:`SERVED_WEIGHTS_MAX_SHARE` of its static memory
    (``mem_fraction`` of each GPU): 8 for a 235B model on H100s, 32 (4 nodes) for DeepSeek-V3."""
    tensor_parallel = at_least
    while (
        served_weight_bytes(model, tensor_parallel)
        > SERVED_WEIGHTS_MAX_SHARE * tensor_parallel * gpu_memory_bytes * mem_fraction
    ):
        tensor_parallel *= 2
    return tensor_parallel


def experts_read_fraction(model: ModelConfig, batch: float) -> float:
    """The expected share of an MoE layer's experts a decode step of ``batch`` sequences reads: each
    token picks top-k of E, so an expert is left idle with probability (1 - k/E)^batch (1 for a dense
    model). A sequence alone reads its k experts; a few hundred read them all."""
    if not model.is_moe:
        return 1.0
    return 1.0 - (1.0 - model.num_experts_per_tok / model.num_experts) ** max(batch, 1.0)


def weight_bytes_read(
    model: ModelConfig, batch: float, tensor_parallel: int, dp_attention: int = 1, weight_bytes: float = BF16_BYTES
) -> float:
    """Bytes of weights one decode step of ``batch`` sequences reads on a server: all of them but
    the routed experts no token of the step chose (:func:`experts_read_fraction`)."""
    experts = weight_bytes * sum(model.moe_layer_pattern) * model.num_experts * model.expert_parameters()
    unread = experts * (1.0 - experts_read_fraction(model, batch))
    return served_weight_bytes(model, tensor_parallel, dp_attention, weight_bytes) - unread


def decode_step_terms(
    model: ModelConfig,
    batch: float,
    context_tokens: float,
    tensor_parallel: int,
    *,
    dp_attention: int = 1,
    weight_bytes: float = BF16_BYTES,
    hbm_bytes_per_s: float = H100_HBM3_BYTES_S,
    peak_flops: float = H100_BF16_DENSE_FLOPS,
) -> tuple:
    """(memory seconds, compute seconds) of one decode step at efficiency 1: ``batch`` sequences,
    each attending to ``context_tokens``, on ``tensor_parallel`` GPUs (``dp_attention`` groups): the
    bytes read (the weights the step uses, :func:`weight_bytes_read`, and the KV caches) over HBM
    bandwidth, and the FLOPs over peak."""
    kv = batch * kv_bytes_per_token(model, tensor_parallel, dp_attention) * context_tokens
    memory_s = (weight_bytes_read(model, batch, tensor_parallel, dp_attention, weight_bytes) + kv) / (
        tensor_parallel * hbm_bytes_per_s
    )
    # forward_flops_per_token(model, s) averages attention over a causal sequence of s tokens
    # (s / 2 each): a token attending to `context_tokens` is the mean of a sequence twice as long.
    compute_s = batch * forward_flops_per_token(model, 2 * context_tokens) / (tensor_parallel * peak_flops)
    return memory_s, compute_s


def decode_step_s(model: ModelConfig, batch: float, context_tokens: float, tensor_parallel: int, **shape) -> float:
    """Seconds of one decode step at efficiency 1: the longer of :func:`decode_step_terms`' two."""
    return max(decode_step_terms(model, batch, context_tokens, tensor_parallel, **shape))


def decode_roofline(
    model: ModelConfig,
    prompt_tokens: float,
    response_tokens: float,
    tensor_parallel: int,
    *,
    mem_fraction: float,
    gpu_memory_bytes: float = H100_80GB_BYTES,
    hbm_bytes_per_s: float = H100_HBM3_BYTES_S,
    peak_flops: float = H100_BF16_DENSE_FLOPS,
    max_batch: Optional[float] = None,
    dp_attention: int = 1,
) -> DecodeRoofline:
    """The roofline of the module docstring at efficiency 1. ``max_batch``: the requests in flight on
    the server, which bound the batch below what its KV cache holds (a tiny model's cache holds
    millions of sequences, but a server decodes only those it was sent). Raises ``ValueError`` when
    the weights leave no KV memory (too few GPUs per server) or a length is not positive."""
    if not (prompt_tokens > 0 and response_tokens > 0):
        raise ValueError(f"prompt and response tokens must be positive, got {prompt_tokens}, {response_tokens}")
    if not 0 < mem_fraction < 1:
        raise ValueError(f"mem_fraction must be in (0, 1), got {mem_fraction}")
    weights = served_weight_bytes(model, tensor_parallel, dp_attention)
    kv_memory = tensor_parallel * gpu_memory_bytes * mem_fraction - weights
    if kv_memory <= 0:
        raise ValueError(
            f"{weights / 1e9:.1f} GB of bf16 weights fill {tensor_parallel} GPUs x "
            f"{gpu_memory_bytes / 2**30:.1f} GiB x mem_fraction {mem_fraction}: no KV cache left; "
            f"use more GPUs per server (tensor parallel)"
        )
    batch = kv_memory / (kv_bytes_per_token(model, tensor_parallel, dp_attention) * (prompt_tokens + response_tokens))
    if max_batch is not None:
        batch = min(batch, max_batch)
    step = decode_step_s(
        model,
        batch,
        prompt_tokens + response_tokens / 2,
        tensor_parallel,
        dp_attention=dp_attention,
        hbm_bytes_per_s=hbm_bytes_per_s,
        peak_flops=peak_flops,
    )
    prefill = (
        (batch / response_tokens)
        * prompt_tokens
        * forward_flops_per_token(model, prompt_tokens)
        / (tensor_parallel * peak_flops)
    )
    return DecodeRoofline(
        batch=batch, step_s=step, prefill_s=prefill, tokens_per_s_per_gpu=batch / (tensor_parallel * (step + prefill))
    )


def calibrated_efficiency(measurement: DecodeMeasurement = SGLANG_V030_LLAMA31_70B_SHAREGPT) -> float:
    """The efficiency at which :func:`decode_roofline` reproduces ``measurement``'s throughput."""
    roofline = decode_roofline(
        measurement.model,
        measurement.prompt_tokens,
        measurement.response_tokens,
        measurement.tensor_parallel,
        mem_fraction=measurement.mem_fraction,
        gpu_memory_bytes=measurement.gpu_memory_bytes,
    )
    return measurement.output_tokens_per_s / measurement.tensor_parallel / roofline.tokens_per_s_per_gpu


def decode_tokens_per_s_per_gpu(
    model: ModelConfig,
    prompt_tokens: float,
    response_tokens: float,
    tensor_parallel: int,
    *,
    mem_fraction: float = 0.85,
    gpu_memory_bytes: float = H100_80GB_BYTES,
    max_batch: Optional[float] = None,
    dp_attention: int = 1,
    gpus_per_node: int = 8,
) -> float:
    """Generated tokens/s per GPU of TP-``tensor_parallel`` servers (``dp_attention`` groups)
    decoding requests of these mean lengths, at most ``max_batch`` at a time: the batch their KV
    cache holds (:func:`decode_roofline`), each step as served (:func:`served_step_s`) with its
    share of prefill (:func:`prefill_per_step_s`)."""
    batch = decode_roofline(
        model,
        prompt_tokens,
        response_tokens,
        tensor_parallel,
        mem_fraction=mem_fraction,
        gpu_memory_bytes=gpu_memory_bytes,
        max_batch=max_batch,
        dp_attention=dp_attention,
    ).batch
    context = prompt_tokens + response_tokens / 2
    step = served_step_s(model, batch, context, tensor_parallel, dp_attention=dp_attention, gpus_per_node=gpus_per_node)
    prefill = prefill_per_step_s(model, batch, prompt_tokens, response_tokens, tensor_parallel)
    return batch / (tensor_parallel * (step + prefill))


# SGLang's online figures on the same servers (benchmark/benchmark_vllm_060/README.md, Llama 3.1 70B
# Instruct, 4x H100, ShareGPT at 4 requests/s): median TPOT 25.03 ms with about 12 requests in
# flight (Little's law on the median latency). A small batch reads the weights at this efficiency,
# higher than the offline throughput's: it is what the longest responses of a step decode at.
SGLANG_V030_LLAMA31_70B_TPOT_S = 25.03e-3
SGLANG_V030_LLAMA31_70B_TPOT_IN_FLIGHT = 12


def small_batch_efficiency() -> float:
    """The fraction of the roofline a few sequences decode at: the roofline's step for the TPOT
    measurement's batch and mean context over its median TPOT (about 0.42)."""
    m = SGLANG_V030_LLAMA31_70B_SHAREGPT
    context = m.prompt_tokens + m.response_tokens / 2
    roofline = decode_step_s(m.model, SGLANG_V030_LLAMA31_70B_TPOT_IN_FLIGHT, context, m.tensor_parallel)
    return roofline / SGLANG_V030_LLAMA31_70B_TPOT_S


# A server spanning nodes all-reduces the batch's hidden state twice per layer per decode step
# over InfiniBand instead of NVLink (under DP attention with expert parallelism, the dispatch and
# combine of the experts cross the nodes as often). The decode batch's hidden states are well under
# a megabyte, so such a collective costs its latency: NCCL runs small ones on its tree, whose depth
# across the nodes is log2(nodes) (:func:`internode_allreduce_s`). ``INTERNODE_ALLREDUCE_S`` is one
# level, two nodes: fitted on NeMo-RL's Qwen3-235B-A22B step (TP16, two nodes per server;
# planning/calibration.py) and checked on its DeepSeek-V3 steps (TP32, four nodes, two levels) and
# SGLang's DeepSeek-V3 decode (72 GPUs on nine nodes).
INTERNODE_ALLREDUCE_S = 1.25e-4


def internode_allreduce_s(tensor_parallel: int, gpus_per_node: int) -> float:
    """Seconds of one decode-step collective of a server of ``tensor_parallel`` GPUs: 0 within a
    node, else :data:`INTERNODE_ALLREDUCE_S` per level of a tree over the nodes it spans."""
    nodes = -(-tensor_parallel // gpus_per_node)
    return INTERNODE_ALLREDUCE_S * math.log2(nodes) if nodes > 1 else 0.0


def served_step_s(
    model: ModelConfig,
    batch: float,
    context_tokens: float,
    tensor_parallel: int,
    *,
    dp_attention: int = 1,
    gpus_per_node: int = 8,
    weight_bytes: float = BF16_BYTES,
    two_batch_overlap: bool = False,
) -> float:
    """Seconds of one decode step as a server runs it: the roofline's memory term at the bandwidth
    efficiency of SGLang's online TPOT (:func:`small_batch_efficiency`) or its compute term at the
    efficiency of its offline throughput (:func:`calibrated_efficiency`), whichever is longer, and a
    server spanning nodes (``tensor_parallel`` above ``gpus_per_node``) adds two collectives per
    layer over InfiniBand (:func:`internode_allreduce_s`); with SGLang's two-batch overlap
    (``--enable-two-batch-overlap``: one half of the batch computes while the other's collectives
    run) the step is the longer of the two instead of their sum."""
    memory_s, compute_s = decode_step_terms(
        model, batch, context_tokens, tensor_parallel, dp_attention=dp_attention, weight_bytes=weight_bytes
    )
    step = max(memory_s / small_batch_efficiency(), compute_s / calibrated_efficiency())
    collectives = 2 * model.num_layers * internode_allreduce_s(tensor_parallel, gpus_per_node)
    return max(step, collectives) if two_batch_overlap else step + collectives


def prefill_per_step_s(
    model: ModelConfig, batch: float, prompt_tokens: float, response_tokens: float, tensor_parallel: int
) -> float:
    """Seconds each decode step spends prefilling the prompts that replace the ``batch / response``
    sequences it finishes, at the throughput efficiency (compute-bound)."""
    flops = (batch / response_tokens) * prompt_tokens * forward_flops_per_token(model, prompt_tokens)
    return flops / (tensor_parallel * H100_BF16_DENSE_FLOPS * calibrated_efficiency())


@dataclass(frozen=True)
class GenerationTime:
    """One step's generation on ``servers`` servers: ``batch`` sequences each decodes together
    (bounded by its KV pool and by the requests in flight on it), the ``bulk_s`` of all tokens at
    that batch's throughput, the ``tail_s`` of the longest response decoded alone, and the step's
    wait, ``seconds``: the bulk and what is left of the longest response once the bulk's steps are
    done (:func:`generation_time`); ``tokens_per_s_per_gpu``: generated tokens over it."""

    batch: float
    bulk_s: float
    tail_s: float
    seconds: float
    tokens_per_s_per_gpu: float


def in_flight_batch(kv_batch: float, sequences: float, servers: int, max_in_flight: Optional[float] = None) -> float:
    """Sequences a server decodes together: its KV pool's ``kv_batch``, bounded by the requests it
    holds: its share of the step's ``sequences``, or of the client's ``max_in_flight``
    (``rollout.sglang.client.max_concurrency``) when that is lower."""
    in_flight = sequences if max_in_flight is None else min(sequences, max_in_flight)
    return max(1.0, min(kv_batch, in_flight / servers))


def generation_time(
    model: ModelConfig,
    sequences: float,
    prompt_tokens: float,
    response_tokens: float,
    max_response_tokens: float,
    gpus: int,
    tensor_parallel: int,
    *,
    mem_fraction: float = 0.85,
    gpu_memory_bytes: float = H100_80GB_BYTES,
    decode_tokens_per_s_per_gpu: Optional[float] = None,
    max_in_flight: Optional[float] = None,
    dp_attention: int = 1,
    gpus_per_node: int = 8,
) -> GenerationTime:
    """Seconds one step waits for ``sequences`` responses of mean ``response_tokens`` (longest
    ``max_response_tokens``) on ``gpus`` GPUs in TP-``tensor_parallel`` servers.

    ``batch``: the sequences a server decodes together (:func:`in_flight_batch`, ``max_in_flight``:
    the client's cap on requests in flight over all servers). ``bulk_s``: all tokens at that batch's
    throughput (the roofline of the module docstring at the calibrated efficiencies, or the given
    ``decode_tokens_per_s_per_gpu``); ``tail_s``: the longest response, ``max_response_tokens``
    steps one after another, each the roofline of one sequence at its mean context over
    :func:`small_batch_efficiency`. ``seconds``, what the step waits for: the bulk, within whose
    steps (its tokens per server over the batch: the mean response when every request fits) the
    longest response decodes as one of the batch, and the rest of the longest response, decoded
    alone once the bulk is done."""
    servers = max(1, gpus // tensor_parallel)
    roofline = decode_roofline(
        model,
        prompt_tokens,
        response_tokens,
        tensor_parallel,
        mem_fraction=mem_fraction,
        gpu_memory_bytes=gpu_memory_bytes,
        dp_attention=dp_attention,
    )
    batch = in_flight_batch(roofline.batch, sequences, servers, max_in_flight)
    shape: dict = dict(dp_attention=dp_attention, gpus_per_node=gpus_per_node)
    if decode_tokens_per_s_per_gpu is None:
        step = served_step_s(model, batch, prompt_tokens + response_tokens / 2, tensor_parallel, **shape)
        prefill = prefill_per_step_s(model, batch, prompt_tokens, response_tokens, tensor_parallel)
        decode_tokens_per_s_per_gpu = batch / (tensor_parallel * (step + prefill))
    bulk = sequences * response_tokens / (decode_tokens_per_s_per_gpu * servers * tensor_parallel)
    tail = max_response_tokens * served_step_s(
        model, 1, prompt_tokens + max_response_tokens / 2, tensor_parallel, **shape
    )
    # The longest response decodes within the bulk's batch for the bulk's steps, then alone.
    bulk_steps = sequences * response_tokens / (servers * batch)
    seconds = bulk + max(0.0, max_response_tokens - bulk_steps) * tail / max_response_tokens
    return GenerationTime(
        batch=batch,
        bulk_s=bulk,
        tail_s=tail,
        seconds=seconds,
        tokens_per_s_per_gpu=sequences * response_tokens / (seconds * servers * tensor_parallel),
    )
