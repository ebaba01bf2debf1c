"""Vocab-parallel per-token log-prob, entropy and exact conditional KL: chunked, fp32, with autograd.

Each tensor-parallel rank holds a vocabulary shard: global ids [r * V_local, (r + 1) * V_local).
Columns at or past ``vocab_size`` (Megatron's padding) are ignored; logits at or below
``MASKED_LOGIT`` (including -inf) mean probability exactly 0. :func:`vocab_parallel_token_stats`
takes the logits, :func:`fused_token_stats` the final hidden states and the output layer (the
float32 logits never exist whole). Two backends compute them: torch (the CPU path and the
reference; numerics, tiling and memory in :mod:`megatron_zcpo.ops.token_stats_kernels`) and Triton
kernels on CUDA (:mod:`megatron_zcpo.ops.token_stats_triton`), chosen by ``backend``; the Triton
backend's first use per kind of call is checked against the torch one
(:mod:`megatron_zcpo.ops.token_stats_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron_zcpo.ops import token_stats_check as first_use
from megatron_zcpo.ops.output_projection import OutputProjection
from megatron_zcpo.ops.token_stats_kernels import (
    MASKED_LOGIT,
    TileResults,
    Tiling,
    finish_statistics,
    resolve_tiling,
    save_results,
    shard_statistics,
    tiled_backward,
    tiled_forward,
)
from megatron_zcpo.utils.devices import kernel_backend

__all__ = ["MASKED_LOGIT", "TokenStats", "fused_token_stats", "vocab_parallel_token_stats"]


@dataclass
class TokenStats:
    """Per-token results, each shaped like ``targets``.

    ``logprob``: log pi(target); ``entropy``: H(pi); ``ref_logprob``: log pi_ref(target) and ``kl``:
    KL(pi || pi_ref) over the full vocabulary, both None without a reference. float32 (float64
    for float64 inputs). ``logprob``, ``entropy`` and ``kl`` carry gradients to the policy inputs.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor
    ref_logprob: Optional[torch.Tensor] = None
    kl: Optional[torch.Tensor] = None


def _compute_dtype(*tensors: Optional[torch.Tensor]) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _as_compute(grads, tiling: Tiling) -> Tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The upstream (logprob, entropy, kl) gradients in the tiles' compute dtype."""
    grad_logprob, grad_entropy, grad_kl = (None if g is None else g.to(tiling.dtype) for g in grads)
    return grad_logprob, grad_entropy, grad_kl


def _shaped(results, shape, dtype) -> TokenStats:
    """TokenStats of ``results`` (TileResults, or the four outputs of an autograd Function) in ``shape``."""
    if isinstance(results, TileResults):
        results = (results.logprob, results.entropy, results.ref_logprob, results.kl)

    def shaped(x):
        return None if x is None else x.to(dtype).view(shape)

    return TokenStats(*(shaped(x) for x in results))


def _backend(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """ "torch" or "triton" (utils.devices.kernel_backend); float64 stays on torch (the kernels are float32).
    The same on every rank: a fallback (token_stats_check.torch_instead) is applied by the caller."""
    backend = kernel_backend(device, requested)
    if backend == "triton" and dtype == torch.float64:
        if requested == "triton":
            raise ValueError("backend='triton' computes in float32: float64 inputs need backend='torch' or 'auto'")
        return "torch"
    return backend


def _triton_backend():
    from megatron_zcpo.ops import token_stats_triton

    return token_stats_triton


def _or_torch(triton_fn: Callable, torch_fn: Callable, where: str) -> Callable:
    """``triton_fn``, or ``torch_fn`` on the same arguments when it raises (token_stats_check.raised): the
    Triton paths raise before their collective, so the torch recomputation joins the other ranks'."""

    def run(*args):
        try:
            return triton_fn(*args)
        except Exception as error:  # a compile failure, an OOM: correct results first
            first_use.raised(error, where)
            return torch_fn(*args)

    return run


def _term_probes(rows: int, with_kl: bool, device) -> dict:
    """{term: upstream gradients (logprob, entropy, kl) [rows] with only that term's, different per row}."""
    ramp = torch.linspace(0.5, 1.5, rows, dtype=torch.float32, device=device)
    terms = first_use.TERMS if with_kl else first_use.TERMS[:2]
    return {term: tuple(ramp if t == term else None for t in first_use.TERMS) for term in terms}


def _check_rows(n_rows: int, kl: Optional[torch.Tensor], device) -> Tuple[torch.Tensor, bool]:
    """The rows [r] the first-use check compares, on ``device``, and whether their KL is large enough to
    compare the KL gradient (token_stats_check.KL_CHECK_MIN; True without a reference)."""
    rows = first_use.check_rows(n_rows, kl)
    index = torch.tensor(rows, dtype=torch.long, device=device)
    return index, kl is None or first_use.kl_seen(kl.reshape(-1)[index])


def _shard_fields(stats: torch.Tensor, tiling: Tiling) -> dict:
    """{field: [r]} of a shard's statistics [K, r] as if the shard were the vocabulary (no collective), and
    its log ratio c (the constant of the KL gradient)."""
    results = finish_statistics(stats, tiling)
    fields = ("logprob", "entropy", "ref_logprob", "kl")
    values = {f: getattr(results, f) for f in fields if getattr(results, f) is not None}
    if tiling.with_ref and results.saved is not None:
        values["log ratio"] = results.saved[5]
    return values


def _compare_rows(
    results: TileResults, rows, z, zr, targets, tiling: Tiling, with_kl: bool, gradient=None, cached=False
) -> list:
    """Problems of the Triton ``results`` of a call at ``rows`` against the torch backend over the same float32
    logits ``z``, ``zr`` [r, valid_columns]: this shard's values, and with ``gradient(saved, probe)`` (the
    Triton logit gradient of those rows, ``cached``: from the fused caches) each term's, both backward
    passes from the call's own saved numbers. Local: the ranks meet only in token_stats_check.conclude."""
    assert results.shard is not None and results.saved is not None  # set by merge_shards
    expected = shard_statistics(_logits_loader(z, zr), targets, tiling, z.device)
    problems = first_use.value_problems(_shard_fields(results.shard[:, rows], tiling), _shard_fields(expected, tiling))
    if gradient is not None:
        saved = results.saved[:, rows]
        for term, probe in _term_probes(len(rows), tiling.with_ref and with_kl, z.device).items():
            want = _logits_backward(z, zr, targets, saved, probe, tiling)
            problem = first_use.gradient_problem(term, gradient(saved, probe), want, cached)
            problems += [problem] if problem else []
    return problems


def _described(kind: str, key: tuple, tiling: Tiling, rows: int, with_kl: bool) -> str:
    dtypes = "/".join(str(d).replace("torch.", "") for d in key[1] if d is not None)
    return (
        f"{kind}, {dtypes}, {key[2]} columns per shard, {'with' if tiling.with_ref else 'without'} reference, "
        f"{'with' if key[3] else 'without'} gradient; {rows} rows of the call compared"
        + ("" if with_kl or not tiling.with_ref else ", their KL too small to compare its gradient yet")
    )


def _comparing(check: Callable) -> List[str]:
    """The problems ``check()`` finds, or the exception it raised as one (the check must reach its collective)."""
    if first_use.torch_instead():  # this rank's Triton call raised: nothing to compare, conclude() says so
        return []
    try:
        return check()
    except Exception as error:
        return [f"the check raised {type(error).__name__}: {str(error)[:300]}"]


# ----------------------------------------------------------------------------------------------
# From vocab-sharded logits


def _copy_clamped(source: torch.Tensor, out: torch.Tensor) -> None:
    """out = max(source, MASKED_LOGIT) in out's dtype (one pass when the dtypes agree)."""
    if source.dtype == out.dtype:
        torch.clamp(source, min=MASKED_LOGIT, out=out)
    else:
        out.copy_(source).clamp_(min=MASKED_LOGIT)


def _logits_loader(logits: torch.Tensor, ref_logits: Optional[torch.Tensor]) -> Callable:
    def load(start, stop, first, last, z, zr):
        _copy_clamped(logits[start:stop, first:last], z)
        if zr is not None:
            assert ref_logits is not None  # the tiles get a reference buffer only with reference logits
            _copy_clamped(ref_logits[start:stop, first:last], zr)

    return load


def _logits_forward(logits, ref_logits, targets, tiling) -> TileResults:
    return tiled_forward(_logits_loader(logits, ref_logits), targets, tiling, logits.device)


def _logits_backward(logits, ref_logits, targets, saved, grads, tiling) -> torch.Tensor:
    """d(loss)/d(logits) [N, V_local] from the upstream (logprob, entropy, kl) gradients, tile by tile."""
    grad_logits = torch.empty_like(logits)
    grad_logits[:, tiling.valid_columns :].zero_()

    def store(start, stop, first, last, grad):
        grad_logits[start:stop, first:last].copy_(grad)

    tiled_backward(
        _logits_loader(logits, ref_logits), store, targets, saved, *_as_compute(grads, tiling), tiling, logits.device
    )
    return grad_logits


class _TokenStatsFromLogits(torch.autograd.Function):
    """Autograd over a backend's forward results (TileResults, computed before) and its
    ``backward(logits, ref_logits, targets, saved, grads, tiling) -> grad_logits``."""

    @staticmethod
    def forward(ctx, logits, ref_logits, targets, tiling, results, backward):
        ctx.backend_backward = backward
        return save_results(ctx, (logits, ref_logits, targets), results, tiling)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_ref_logprob, grad_kl):
        logits, ref_logits, targets, saved = ctx.saved_tensors
        grads = (grad_logprob, grad_entropy, grad_kl)
        grad_logits = None
        if any(g is not None for g in grads):
            grad_logits = ctx.backend_backward(logits, ref_logits, targets, saved, grads, ctx.tiling)
        return grad_logits, None, None, None, None, None


def vocab_parallel_token_stats(
    logits: torch.Tensor,
    targets: torch.Tensor,
    ref_logits: Optional[torch.Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    kl_temperature: float = 1.0,
    backend: str = "auto",
) -> TokenStats:
    """Per-token log-prob, entropy and (with a reference) reference log-prob and exact KL(pi || pi_ref).

    logits, ref_logits: [..., V_local] this rank's vocabulary shard of the policy / reference
    (any float dtype; computed in float32, float64 for float64 input). targets: [...] global token
    ids in [0, vocab_size). group: the tensor-parallel process group; None means the whole
    vocabulary is local. Rank r of ``group`` holds ids [r * V_local, (r + 1) * V_local).
    vocab_size: the true vocabulary size (default: world * V_local); columns at or past it are
    ignored. chunk_size, vocab_chunk_size: tokens and vocabulary columns per tile of the torch
    backend (default 128 tokens x 2**19 elements on CPU, 1024 x 2**25 on GPU; the Triton kernels
    walk the vocabulary in their own blocks and never tile the logits). temperature: logprob, entropy and
    ref_logprob are those of softmax(logits / temperature) (the sampling distribution);
    kl_temperature: the KL is between softmax(logits / kl_temperature) and
    softmax(ref_logits / kl_temperature) (1 for ZCPO's coefficients). backend: "auto" (Triton
    kernels for CUDA tensors when triton imports, else torch), "torch" or "triton"
    (megatron_zcpo.utils.devices.kernel_backend); float64 inputs always use torch.

    Returns :class:`TokenStats` with fields shaped like ``targets``. ``logprob``, ``entropy`` and
    ``kl`` are differentiable w.r.t. ``logits`` (recomputed tile by tile in backward); the
    reference gets no gradient. One all-gather of a few float64 numbers per token per call. If the
    reference masks tokens the policy keeps, the KL is infinite; it is reported as about 1e30 x the
    policy's probability on those tokens.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}: logits must be targets.shape + [V_local]"
        )
    if ref_logits is not None and ref_logits.shape != logits.shape:
        raise ValueError(f"ref_logits {tuple(ref_logits.shape)} must have the shape of logits {tuple(logits.shape)}")
    dtype = _compute_dtype(logits, ref_logits)
    wanted = _backend(backend, logits.device, dtype)
    tiling = resolve_tiling(
        logits.shape[-1],
        targets,
        group=group,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        temperature=temperature,
        kl_temperature=kl_temperature,
        dtype=dtype,
        with_ref=ref_logits is not None,
        device=logits.device,
    )
    inputs = (
        logits.reshape(-1, logits.shape[-1]),
        None if ref_logits is None else ref_logits.reshape(-1, logits.shape[-1]),
        targets.reshape(-1).to(device=logits.device, dtype=torch.long),
        tiling,
    )
    needs_grad = _needs_grad(logits)
    chosen = "torch" if first_use.torch_instead() else wanted
    stats, results = _from_logits(inputs, chosen, needs_grad, targets.shape, dtype)
    key = (
        "logits",
        (logits.dtype, None if ref_logits is None else ref_logits.dtype),
        logits.shape[-1],
        needs_grad,
        tiling.separate_kl_temperature,
    )
    checked = wanted == "triton" and first_use.due(key, logits.device, stats.kl)
    if checked and not _logits_agree(key, inputs, stats, results, needs_grad):
        stats, _ = _from_logits(inputs, "torch", needs_grad, targets.shape, dtype)
    return stats


def _from_logits(inputs: tuple, backend: str, needs_grad: bool, shape, dtype) -> Tuple[TokenStats, TileResults]:
    """The call's TokenStats and the backend's TileResults (the first-use check reads its ``saved``)."""
    forward, backward = _logits_forward, _logits_backward
    if backend == "triton":
        triton = _triton_backend()
        forward = _or_torch(triton.logits_forward, _logits_forward, "logits forward")
        backward = _or_torch(triton.logits_backward, _logits_backward, "logits backward")
    with torch.no_grad():
        results = forward(*inputs)
    if needs_grad:
        return _shaped(_TokenStatsFromLogits.apply(*inputs, results, backward), shape, dtype), results
    return _shaped(results, shape, dtype), results


def _logits_agree(key: tuple, inputs: tuple, stats: TokenStats, results: TileResults, needs_grad: bool) -> bool:
    """First-use check of a Triton call from logits: rows of the call against the torch backend (token_stats_check)."""
    logits, ref_logits, targets, tiling = inputs
    rows, with_kl = _check_rows(targets.shape[0], stats.kl, logits.device)
    z, zr, rows_targets = logits[rows], None if ref_logits is None else ref_logits[rows], targets[rows]

    def exact(saved, probe):
        return _triton_backend().logits_backward(z, zr, rows_targets, saved, probe, tiling)

    with torch.no_grad():
        problems = _comparing(
            lambda: _compare_rows(results, rows, z, zr, rows_targets, tiling, with_kl, exact if needs_grad else None)
        )
    described = _described("from logits", key, tiling, len(rows), with_kl)
    return first_use.conclude(key, described, problems, with_kl, tiling.group, logits.device)


# ----------------------------------------------------------------------------------------------
# Fused with the output layer: from final hidden states and the output-weight shard


def _hidden_loader(policy: OutputProjection, reference: Optional[OutputProjection]) -> Callable:
    def load(start, stop, first, last, z, zr):
        policy.logits_into(start, stop, first, last, z)
        if zr is not None:
            assert reference is not None  # the tiles get a reference buffer only with a reference projection
            reference.logits_into(start, stop, first, last, zr)

    return load


class _FusedTokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, targets, tiling):
        results = _fused_forward(hidden, weight, ref_hidden, ref_weight, targets, tiling)
        return save_results(ctx, (hidden, weight, ref_hidden, ref_weight, targets), results, tiling)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_ref_logprob, grad_kl):
        hidden, weight, ref_hidden, ref_weight, targets, saved = ctx.saved_tensors
        grads = (grad_logprob, grad_entropy, grad_kl)
        grad_hidden, grad_weight = _fused_shard_gradients(
            hidden, weight, ref_hidden, ref_weight, targets, saved, grads, ctx.tiling
        )
        if ctx.tiling.world > 1:
            # hidden is replicated across the tensor-parallel ranks and each rank saw only its
            # vocabulary shard: sum the partial gradients, as Megatron's ColumnParallelLinear does
            # in the backward of copy_to_tensor_model_parallel_region.
            dist.all_reduce(grad_hidden, group=ctx.tiling.group)
        return grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype), None, None, None, None


def _fused_shard_gradients(hidden, weight, ref_hidden, ref_weight, targets, saved, grads, tiling: Tiling) -> tuple:
    """This shard's (hidden, weight) gradients in the compute dtype, tile by tile (no collective): the torch
    backward of the fused op, and the Triton one's fallback."""
    grad_logprob, grad_entropy, grad_kl = grads
    policy = OutputProjection(hidden, weight, tiling.valid_columns, tiling.dtype)
    reference = (
        None if grad_kl is None else OutputProjection(ref_hidden, ref_weight, tiling.valid_columns, tiling.dtype)
    )
    grad_hidden = torch.zeros(hidden.shape, dtype=tiling.dtype, device=hidden.device)
    grad_weight = torch.zeros(weight.shape, dtype=tiling.dtype, device=weight.device)

    def store(start, stop, first, last, grad):
        grad_hidden[start:stop] += policy.hidden_grad(grad, first, last)
        grad_weight[first:last] += policy.weight_grad(grad, start, stop)

    tiled_backward(
        _hidden_loader(policy, reference),
        store,
        targets,
        saved,
        *_as_compute((grad_logprob, grad_entropy, grad_kl), tiling),
        tiling,
        hidden.device,
    )
    return grad_hidden, grad_weight


def _fused_forward(hidden, weight, ref_hidden, ref_weight, targets, tiling) -> TileResults:
    policy = OutputProjection(hidden, weight, tiling.valid_columns, tiling.dtype)
    reference = (
        None if ref_hidden is None else OutputProjection(ref_hidden, ref_weight, tiling.valid_columns, tiling.dtype)
    )
    return tiled_forward(_hidden_loader(policy, reference), targets, tiling, hidden.device)


def fused_token_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ref_hidden: Optional[torch.Tensor] = None,
    ref_weight: Optional[torch.Tensor] = None,
    *,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    chunk_size: Optional[int] = None,
    vocab_chunk_size: Optional[int] = None,
    temperature: float = 1.0,
    kl_temperature: float = 1.0,
    backend: str = "auto",
) -> TokenStats:
    """:func:`vocab_parallel_token_stats` fused with the output layer: logits = hidden @ weight.T.

    hidden, ref_hidden: [..., H] final hidden states of the policy / reference, the full (not
    sequence-parallel) input of Megatron's ColumnParallelLinear output layer, identical on every
    rank of ``group``. weight, ref_weight: [V_local, H] this rank's output-layer shards (rows at or
    past ``vocab_size`` are padding). targets: [...] global token ids. Other arguments as in
    :func:`vocab_parallel_token_stats`. Torch backend: one [chunk_size, vocab_chunk_size] tile of
    logits exists at a time (six buffers of it), in forward and in backward. Triton backend: one
    float32 [chunk_size, V_local] buffer of logits (two with a reference); when a gradient is
    wanted the forward also keeps float16 [N, V_local] caches of the probabilities (and of the
    log-ratio with a reference) for backward, which then writes a [N, V_local] logit gradient in the
    operands' dtype instead of recomputing the logits (three output-layer GEMMs per update).

    Logits are computed in float32 with no bf16 rounding: on CUDA bf16 x bf16 GEMMs with float32
    output (exact products), on CPU upcast operands. Gradients of ``logprob``, ``entropy`` and ``kl``
    flow into ``hidden`` and ``weight`` (cast to their dtypes; the gradient GEMMs take bf16
    operands on CUDA); backward all-reduces the hidden gradient over ``group`` (the partial sums of
    the vocabulary shards), so ``hidden`` must not be sequence-parallel. The reference gets no
    gradient.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)}: hidden must be targets.shape + [H]"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [V_local, H={hidden.shape[-1]}]")
    if (ref_hidden is None) != (ref_weight is None):
        raise ValueError("ref_hidden and ref_weight must be given together")
    if ref_hidden is not None and ref_weight is not None:
        if ref_hidden.shape != hidden.shape:
            raise ValueError(
                f"ref_hidden {tuple(ref_hidden.shape)} must have the shape of hidden {tuple(hidden.shape)}"
            )
        if ref_weight.shape != weight.shape:
            raise ValueError(
                f"ref_weight {tuple(ref_weight.shape)} must have the shape of weight {tuple(weight.shape)}"
            )
    dtype = _compute_dtype(hidden, weight, ref_hidden, ref_weight)
    wanted = _backend(backend, hidden.device, dtype)
    tiling = resolve_tiling(
        weight.shape[0],
        targets,
        group=group,
        vocab_size=vocab_size,
        chunk_size=chunk_size,
        vocab_chunk_size=vocab_chunk_size,
        temperature=temperature,
        kl_temperature=kl_temperature,
        dtype=dtype,
        with_ref=ref_hidden is not None,
        device=hidden.device,
    )
    inputs = (
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        None if ref_hidden is None else ref_hidden.reshape(-1, hidden.shape[-1]),
        ref_weight,
        targets.reshape(-1).to(device=hidden.device, dtype=torch.long),
        tiling,
    )
    needs_grad = _needs_grad(hidden, weight)
    chosen = "torch" if first_use.torch_instead() else wanted
    stats, results, cache = _fused(inputs, chosen, needs_grad, targets.shape, dtype)
    key = (
        "fused",
        (
            hidden.dtype,
            weight.dtype,
            None if ref_hidden is None else ref_hidden.dtype,
            None if ref_weight is None else ref_weight.dtype,
        ),
        weight.shape[0],
        needs_grad,
        tiling.separate_kl_temperature,
    )
    checked = wanted == "triton" and first_use.due(key, hidden.device, stats.kl)
    if checked and not _fused_agrees(key, inputs, stats, results, cache):
        stats = _fused(inputs, "torch", needs_grad, targets.shape, dtype)[0]
    return stats


def _fused(inputs: tuple, backend: str, needs_grad: bool, shape, dtype) -> tuple:
    """(TokenStats, and for the Triton backend its TileResults and float16 caches (None without a gradient),
    which the first-use check reads; None, None for the torch backend)."""
    if backend == "triton":
        triton = _triton_backend()
        try:
            with torch.no_grad():
                results, cache = triton.fused_forward(*inputs, keep_cache=needs_grad)
        except Exception as error:  # raised before the forward's all-gather: the torch one joins the others'
            first_use.raised(error, "fused forward")
        else:
            if not needs_grad:
                return _shaped(results, shape, dtype), results, None
            outputs = triton.TritonFusedTokenStats.apply(*inputs, results, cache, _fused_shard_gradients)
            return _shaped(outputs, shape, dtype), results, cache
    if needs_grad:
        return _shaped(_FusedTokenStats.apply(*inputs), shape, dtype), None, None
    return _shaped(_fused_forward(*inputs), shape, dtype), None, None


def _fused_agrees(key: tuple, inputs: tuple, stats: TokenStats, results, cache) -> bool:
    """First-use check of a fused Triton call: rows of the call against the torch backend over their float32
    logits, recomputed by the GEMM of their chunk as the kernels read them (so the two backends see the
    same numbers); with a gradient, each term's logit gradient of those rows from the call's float16 caches."""
    hidden, weight, ref_hidden, ref_weight, targets, tiling = inputs
    rows, with_kl = _check_rows(targets.shape[0], stats.kl, hidden.device)

    def check() -> List[str]:
        z = _chunk_logits(hidden, weight, rows, tiling)
        zr = None if ref_hidden is None else _chunk_logits(ref_hidden, ref_weight, rows, tiling)
        if cache is None:  # no gradient, or a shard of padding only
            return _compare_rows(results, rows, z, zr, targets[rows], tiling, with_kl)
        sub_cache = cache.rows(rows)
        gradient_dtype = OutputProjection(hidden[:1], weight[:1], 1, tiling.dtype).gradient_dtype

        def from_cache(saved, probe):
            return _triton_backend().cached_logit_gradient(
                gradient_dtype, targets[rows], sub_cache, saved, probe, tiling
            )

        return _compare_rows(results, rows, z, zr, targets[rows], tiling, with_kl, from_cache, cached=True)

    with torch.no_grad():
        problems = _comparing(check)
    described = _described("fused", key, tiling, len(rows), with_kl)
    return first_use.conclude(key, described, problems, with_kl, tiling.group, hidden.device)


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """[r, valid_columns] float32 logits of ``rows`` as the Triton forward computed them: each by the GEMM
    of its whole chunk (the same GEMM shape, hence the same rounding)."""
    chunk = min(tiling.chunk_rows, hidden.shape[0])
    out = torch.empty(len(rows), tiling.valid_columns, dtype=tiling.dtype, device=hidden.device)
    starts = rows // chunk * chunk
    for start in sorted(set(starts.tolist())):
        picked = starts == start
        out[picked] = _output_logits(hidden[start : start + chunk], weight, tiling)[rows[picked] - start]
    return out


def _output_logits(hidden: torch.Tensor, weight: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """[n, valid_columns] float32 logits hidden @ weight.T as the Triton forward computes them (OutputProjection
    into a buffer of its row alignment)."""
    out = _triton_backend().aligned_rows(hidden.shape[0], tiling.valid_columns, tiling.dtype, hidden.device)
    OutputProjection(hidden, weight, tiling.valid_columns, tiling.dtype).logits_into(
        0, hidden.shape[0], 0, tiling.valid_columns, out
    )
    return out
