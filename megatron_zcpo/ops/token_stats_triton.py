"""The Triton backend of the token statistics: launches (shapes fixed by the shard width), the fused Function.

Forward: :func:`token_stats_forward_kernel` reduces each row's shard in one HBM pass to the shard
statistics of the torch path; the float64 merge over tensor-parallel ranks (one all-gather per
call) and the per-token results are the torch path's (``token_stats_kernels.merge_shards``).
Backward: one elementwise kernel writes the logit gradient.

The fused variant computes the logits per chunk of ``chunk_size`` tokens into a float32
[chunk, V_local] buffer (bf16 operands with float32 output on CUDA) and reduces each chunk. When a
gradient is wanted it also writes the kernels' float16 probability and log-ratio caches ([N,
V_local] each, together the size of float32 logits, half of it without a reference), so backward
recomputes no GEMM: it writes the whole logit gradient [N, V_local] in the operands' dtype and runs
the two gradient GEMMs on it, three output-layer GEMMs per update as for a plain output layer.

Kernel shapes are fixed by the shard width (:func:`_choose`: the same on every rank and run); under
Triton's interpreter (CPU tensors) small shapes are used. The buffers allocated here have row strides
padded to a multiple of 16 elements (vector loads for every shard width).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
import triton

from megatron_zcpo.ops import token_stats_check
from megatron_zcpo.ops.output_projection import OutputProjection
from megatron_zcpo.ops.token_stats_kernels import (
    TileResults,
    Tiling,
    empty_shard_stats,
    merge_shards,
    save_results,
    stat_rows,
)
from megatron_zcpo.ops.token_stats_triton_kernels import token_stats_backward_kernel, token_stats_forward_kernel


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: rows per program, columns per load, loads per super-block (forward), warps."""

    block_m: int
    block_v: int
    sub: int = 1
    num_warps: int = 4

    @property
    def width(self) -> int:
        """Columns per super-block (forward)."""
        return self.block_v * self.sub


# Forward: 8 elements per thread per load, 8-16 K columns per super-block (the exact merge costs
# ~1000 instructions per row and super-block, ~8-16 per element; passes 2 and 3 re-read a super-block
# of a few tens of KiB per program from L1/L2). Backward: a plain elementwise pass. The shape is a
# function of the shard width alone (no timing-based autotune): every tensor-parallel rank and every
# run launches the same kernels, so the results are bitwise reproducible.
FORWARD_CANDIDATES = (KernelConfig(1, 2048, 8, 8), KernelConfig(1, 1024, 8, 4))
BACKWARD_CANDIDATES = (KernelConfig(1, 2048, 1, 4), KernelConfig(1, 1024, 1, 4))
# Row strides of the buffers this module allocates are multiples of this many elements, so that
# Triton specialises them as divisible by 16 and emits vector loads whatever the shard width.
ROW_ALIGNMENT = 16
_FORCED: Dict[str, KernelConfig] = {}
_CHOSEN: Dict[tuple, KernelConfig] = {}


@contextlib.contextmanager
def forced_configs(forward: Optional[KernelConfig] = None, backward: Optional[KernelConfig] = None):
    """Launch every kernel with these shapes for the duration (tests and benchmarks)."""
    previous = dict(_FORCED)
    _FORCED.update({k: v for k, v in (("forward", forward), ("backward", backward)) if v is not None})
    try:
        yield
    finally:
        _FORCED.clear()
        _FORCED.update(previous)


def chosen_configs() -> Dict[tuple, KernelConfig]:
    """The shapes launched so far, by (kernel, shard width) (for the benchmark's report)."""
    return dict(_CHOSEN)


def _interpreter_config(kind: str, n_rows: int, n_cols: int) -> KernelConfig:
    """Shapes for Triton's interpreter, where every operation costs ~0.1 ms whatever its size: few
    programs (all rows of a test in one), yet a few super-blocks on test-sized vocabularies."""
    block_m = min(64, triton.next_power_of_2(max(1, n_rows)))
    block_v = min(4096, max(16, triton.next_power_of_2(max(1, n_cols // 6))))
    return KernelConfig(block_m, block_v, 2) if kind == "forward" else KernelConfig(block_m, block_v)


def _choose(kind: str, n_rows: int, n_cols: int, device) -> KernelConfig:
    """The forced shape, else one fixed by the shard width: 16 K-column super-blocks from 16 K columns
    on, 8 K below (a TP=8+ shard keeps a few super-blocks per row); the backward's block divides both."""
    if kind in _FORCED:
        config = _FORCED[kind]
    elif device.type != "cuda":
        config = _interpreter_config(kind, n_rows, n_cols)
    else:
        candidates = FORWARD_CANDIDATES if kind == "forward" else BACKWARD_CANDIDATES
        config = candidates[0] if n_cols >= 16384 else candidates[1]
    _CHOSEN[(kind, n_cols)] = config
    return config


def aligned_rows(rows: int, columns: int, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised [rows, columns] view whose row stride is a multiple of :data:`ROW_ALIGNMENT`."""
    stride = triton.cdiv(max(columns, 1), ROW_ALIGNMENT) * ROW_ALIGNMENT
    return torch.empty(rows, stride, dtype=dtype, device=device)[:, :columns]


def launch_kernel(kernel, grid, *args, **kwargs) -> None:
    """Every launch of this module goes through here (tools/check_triton_kernels.py compiles them instead)."""
    kernel[grid](*args, **kwargs)


# ------------------------------------------------------------------------------------------------
# forward


@dataclass
class _Cache:
    """What the fused forward keeps for backward instead of the logits (see the module docstring)."""

    e: torch.Tensor  # [N, n_cols] float16: e^{(z - m) / T_cache}, m the super-block's policy maximum
    y: Optional[torch.Tensor]  # [N, n_cols] float16: log p - log q less a per-super-block constant
    blocks: torch.Tensor  # [3, N, n_super] float32: policy maximum, reference maximum, c' per super-block
    at_kl: bool  # T_cache = T_kl (else the sampling temperature): the larger of the two
    width: int  # columns per super-block (the forward's)

    @classmethod
    def allocate(cls, rows: int, n_cols: int, tiling: Tiling, width: int, device) -> _Cache:
        y = aligned_rows(rows, n_cols, torch.float16, device) if tiling.with_ref else None
        return cls(
            aligned_rows(rows, n_cols, torch.float16, device),
            y,
            torch.empty(3, rows, triton.cdiv(n_cols, width), dtype=torch.float32, device=device),
            tiling.with_ref and tiling.inv_kl_temperature < tiling.inv_temperature,
            width,
        )

    def rows(self, index: torch.Tensor) -> _Cache:
        """A copy of the cache's rows ``index`` [r] (the first-use check's slice of a real call)."""
        y = None if self.y is None else self.y[index]
        return _Cache(self.e[index], y, self.blocks[:, index], self.at_kl, self.width)


def _forward_launcher(z, zr, local_targets, stats, tiling: Tiling, cache: Optional[_Cache], first_row: int):
    """``launch(config)`` for rows [first_row, first_row + len(z)) of the call (stats / cache row offsets)."""
    rows = z.shape[0]
    ref = zr if zr is not None else z
    out = stats[:, first_row : first_row + rows]
    if cache is not None:
        e, blocks = cache.e[first_row : first_row + rows], cache.blocks[:, first_row : first_row + rows]
        y = cache.y[first_row : first_row + rows] if cache.y is not None else e
        cache_args = (e, y, e.stride(0), blocks, blocks.stride(1), blocks.stride(0))
    else:
        cache_args = (z, z, 0, out, 0, 0)

    def launch(config: KernelConfig):
        launch_kernel(
            token_stats_forward_kernel,
            (triton.cdiv(rows, config.block_m),),
            z,
            ref,
            z.stride(0),
            ref.stride(0),
            local_targets,
            out,
            out.stride(0),
            *cache_args,
            rows,
            tiling.valid_columns,
            tiling.inv_temperature,
            tiling.inv_kl_temperature,
            WITH_REF=tiling.with_ref,
            SEPARATE_KL=tiling.with_ref and tiling.separate_kl_temperature,
            CACHE=cache is not None,
            CACHE_AT_KL=cache is not None and cache.at_kl,
            BLOCK_M=config.block_m,
            BLOCK_V=config.block_v,
            SUB=config.sub,
            num_warps=config.num_warps,
        )

    return launch


def _contiguous_rows(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return x if x is None or x.stride(-1) == 1 else x.contiguous()


def logits_forward(logits, ref_logits, targets, tiling: Tiling) -> TileResults:
    """Per-token results from this shard's logits [N, V_local] (and the reference's) with one kernel."""
    logits, ref_logits = _contiguous_rows(logits), _contiguous_rows(ref_logits)
    n_rows = targets.shape[0]
    if not (n_rows and tiling.valid_columns):
        return merge_shards(empty_shard_stats(tiling, n_rows, logits.device), tiling)
    stats = torch.empty(stat_rows(tiling), n_rows, dtype=torch.float32, device=logits.device)
    launch = _forward_launcher(logits, ref_logits, targets - tiling.vocab_start, stats, tiling, None, 0)
    launch(_choose("forward", n_rows, tiling.valid_columns, logits.device))
    return merge_shards(stats.double(), tiling)


def fused_forward(
    hidden, weight, ref_hidden, ref_weight, targets, tiling: Tiling, keep_cache: bool
) -> Tuple[TileResults, Optional[_Cache]]:
    """Per-token results from hidden states and output-layer shards, chunk by chunk of tokens."""
    n_rows, n_cols, device = targets.shape[0], tiling.valid_columns, hidden.device
    if not (n_rows and n_cols):
        return merge_shards(empty_shard_stats(tiling, n_rows, device), tiling), None
    policy = OutputProjection(hidden, weight, n_cols, torch.float32)
    reference = None if ref_hidden is None else OutputProjection(ref_hidden, ref_weight, n_cols, torch.float32)
    chunk = min(tiling.chunk_rows, n_rows)
    z = aligned_rows(chunk, n_cols, torch.float32, device)
    zr = None if reference is None else aligned_rows(chunk, n_cols, torch.float32, device)
    stats = torch.empty(stat_rows(tiling), n_rows, dtype=torch.float32, device=device)
    # One shape for the whole call: the cache's super-blocks must not change between chunks.
    config = _choose("forward", chunk, n_cols, device)
    cache = _Cache.allocate(n_rows, n_cols, tiling, config.width, device) if keep_cache else None
    local_targets = targets - tiling.vocab_start
    for start in range(0, n_rows, chunk):
        stop = min(start + chunk, n_rows)
        z_rows, zr_rows = z[: stop - start], None if zr is None else zr[: stop - start]
        policy.logits_into(start, stop, 0, n_cols, z_rows)
        if reference is not None:
            assert zr_rows is not None  # allocated with the reference
            reference.logits_into(start, stop, 0, n_cols, zr_rows)
        _forward_launcher(z_rows, zr_rows, local_targets[start:stop], stats, tiling, cache, start)(config)
    return merge_shards(stats.double(), tiling), cache


# ------------------------------------------------------------------------------------------------
# backward


def _backward(
    out, targets, saved, grads, tiling: Tiling, *, logits=None, ref_logits=None, cache: Optional[_Cache] = None
) -> None:
    """Write d(loss)/d(policy logits) [N, out.shape[1]] into ``out`` (0 past the valid columns)."""
    n_rows = targets.shape[0]
    if not n_rows:
        return
    grad_lp, grad_ent, grad_kl = (None if g is None else g.reshape(-1).contiguous() for g in grads)
    present = [g for g in (grad_lp, grad_ent, grad_kl) if g is not None]
    dummy = present[0]
    local_targets = targets - tiling.vocab_start
    separate = tiling.with_ref and tiling.separate_kl_temperature
    if cache is not None:
        inv_cache = tiling.inv_kl_temperature if cache.at_kl else tiling.inv_temperature
        z = zr = out
        cache_args = (
            cache.e,
            cache.y if cache.y is not None else cache.e,
            cache.e.stride(0),
            cache.blocks,
            cache.blocks.stride(1),
            cache.blocks.stride(0),
        )
    else:
        inv_cache = tiling.inv_temperature
        z = _contiguous_rows(logits)
        zr = z if ref_logits is None else _contiguous_rows(ref_logits)
        cache_args = (out, out, 0, out, 0, 0)

    def launch(config: KernelConfig):
        grid = (triton.cdiv(n_rows, config.block_m), triton.cdiv(out.shape[1], config.block_v))
        launch_kernel(
            token_stats_backward_kernel,
            grid,
            z,
            zr,
            z.stride(0),
            zr.stride(0),
            *cache_args,
            local_targets,
            saved,
            saved.stride(0),
            dummy if grad_lp is None else grad_lp,
            dummy if grad_ent is None else grad_ent,
            dummy if grad_kl is None else grad_kl,
            out,
            out.stride(0),
            n_rows,
            tiling.valid_columns,
            out.shape[1],
            tiling.inv_temperature,
            tiling.inv_kl_temperature,
            tiling.inv_temperature / inv_cache,
            tiling.inv_kl_temperature / inv_cache,
            HAS_LP=grad_lp is not None,
            HAS_ENT=grad_ent is not None,
            HAS_KL=grad_kl is not None,
            SEPARATE_KL=separate,
            FROM_CACHE=cache is not None,
            CACHE_AT_KL=cache is not None and cache.at_kl,
            SUPER_WIDTH=cache.width if cache is not None else 1,
            BLOCK_M=config.block_m,
            BLOCK_V=config.block_v,
            num_warps=config.num_warps,
        )

    config = _choose("backward", n_rows, out.shape[1], out.device)
    if cache is not None and cache.width % config.block_v:
        raise ValueError(f"backward block_v {config.block_v} must divide the forward's super-block width {cache.width}")
    launch(config)


def logits_backward(logits, ref_logits, targets, saved, grads, tiling: Tiling) -> torch.Tensor:
    """d(loss)/d(logits) [N, V_local] from the upstream (logprob, entropy, kl) gradients: one kernel."""
    grad_logits = torch.empty_like(logits)
    _backward(
        grad_logits,
        targets,
        saved,
        grads,
        tiling,
        logits=logits,
        ref_logits=ref_logits if grads[2] is not None else None,
    )
    return grad_logits


def cached_logit_gradient(gradient_dtype, targets, cache: _Cache, saved, grads, tiling: Tiling) -> torch.Tensor:
    """d(loss)/d(logits) [N, valid_columns] in ``gradient_dtype`` (the gradient GEMMs' operand) from the
    forward's caches, for the upstream ``grads`` (logprob, entropy, kl) [N] each (None: not wanted)."""
    grad_logits = aligned_rows(targets.shape[0], tiling.valid_columns, gradient_dtype, targets.device)
    _backward(grad_logits, targets, saved, grads, tiling, cache=cache)
    return grad_logits


class TritonFusedTokenStats(torch.autograd.Function):
    """Autograd of :func:`fused_forward` (its results and caches computed before): backward from the caches,
    then the two gradient GEMMs; ``fallback`` (the torch backward's shard gradients, same arguments as
    ``token_stats._fused_shard_gradients``) when that raises."""

    @staticmethod
    def forward(ctx, hidden, weight, ref_hidden, ref_weight, targets, tiling, results, cache, fallback):
        ctx.cache_layout = None if cache is None else (cache.at_kl, cache.width)
        ctx.fallback = fallback
        kept = () if cache is None else (cache.e, cache.y, cache.blocks)
        return save_results(ctx, (hidden, weight, ref_hidden, ref_weight, targets) + kept, results, tiling)

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, _grad_ref_logprob, grad_kl):
        hidden, weight, ref_hidden, ref_weight, targets, *kept, saved = ctx.saved_tensors
        tiling = ctx.tiling
        grads = (grad_logprob, grad_entropy, grad_kl)
        nothing = (None,) * 9
        if ctx.cache_layout is None or all(g is None for g in grads):
            return nothing
        try:
            cache = _Cache(kept[0], kept[1], kept[2], *ctx.cache_layout)
            policy = OutputProjection(hidden, weight, tiling.valid_columns, torch.float32)
            grad_logits = cached_logit_gradient(policy.gradient_dtype, targets, cache, saved, grads, tiling)
            grad_weight = torch.empty_like(weight)
            grad_weight[tiling.valid_columns :].zero_()
            grad_hidden = policy.shard_gradients(grad_logits, grad_weight[: tiling.valid_columns])
        except Exception as error:  # before the all-reduce below: the ranks still meet there
            token_stats_check.raised(error, "fused backward")
            grad_hidden, grad_weight = ctx.fallback(
                hidden, weight, ref_hidden, ref_weight, targets, saved, grads, tiling
            )
        if tiling.world > 1:
            # hidden is replicated across the tensor-parallel ranks, each of which saw its vocabulary
            # shard: sum the partial gradients (Megatron's copy_to_tensor_model_parallel_region backward).
            dist.all_reduce(grad_hidden, group=tiling.group)
        return (grad_hidden.to(hidden.dtype), grad_weight.to(weight.dtype)) + nothing[2:]
