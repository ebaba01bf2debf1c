"""The tiled kernels behind :mod:`megatron_zcpo.ops.token_stats`: per-tile statistics, their exact merge, backward.

Each tensor-parallel rank holds a vocabulary shard: global ids [r * V_local, (r + 1) * V_local).
Columns at or past ``vocab_size`` (Megatron's padding) are ignored; logits at or below
``MASKED_LOGIT`` (including -inf) mean probability exactly 0.

Numerics. For a set of vocabulary columns, with u = z - max z, u_r = z_r - max z_r,
d = (z - z_r) - (max z - max z_r) (the close numbers subtracted first), S = sum e^u, S_r = sum e^{u_r},
c = log S - log S_r and g(y) = y + expm1(-y) >= 0, the identity ``sum p g(d - c') = KL + g(c - c')``
holds for every constant c'. The textbook form takes c' = 0 and subtracts g(c); we take c' = c as rounded from
the sums, so G = sum e^u g(d - c') is a sum of non-negative second-order terms (g is a series for
|y| < 1/2 and the overflow-free ``e^u y + e^{u_r + c'} - e^u`` beyond). The rounding delta = c - c'
comes back from the same pass: sum p e^{-(d - c')} = e^{-delta}, i.e. (G - A) / S = expm1(-delta) with
A = sum e^u (d - c'); then KL = G / S - g(delta), g(delta) ~ 1e-14 being far below the result's
rounding. This needs no B = sum e^{u_r} expm1(d) pass (whose terms overflow for d > 88) and does not
cancel when the logit difference has a common part the maxima miss (there the c' = 0 form G / S - g(c) loses
~3e-5 relative, this ~3e-7).

The same identity combines disjoint column sets exactly, so the vocabulary is walked in tiles and
the tiles of all ranks are merged alike: with w_s, w'_s the policy / reference mass of set s and
beta_s = log(w_s / w'_s) (from the sets' maxima and c, without O(|logit|) terms),
``KL = sum_s w_s (KL_s + g(beta_s))``, a sum of non-negative terms; the entropy combines by the
chain rule ``H = sum_s w_s (H_s - log w_s)``. No global maximum is needed while computing: each rank
reduces its shard tile by tile with no communication, then one all-gather of a few per-token numbers
(float64) per call is merged locally. Identical logits give exactly KL = 0.

Memory: a [chunk_size tokens, vocab_chunk_size columns] tile is processed at a time in a workspace
of six such buffers reused by every tile (tiles keep the output-layer GEMMs of the fused variant
efficient and the elementwise passes in cache); backward recomputes tile by tile (custom
autograd.Function) from the inputs and a few saved per-token numbers. Without gradients
(torch.no_grad, or no input needing grad) nothing is saved.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist

MASKED_LOGIT = -1e30
"""Logits at or below this value (including -inf) are masked tokens: probability exactly 0."""

# |y| below this uses the series of g(y); beyond, the direct form loses at most ~20 ulp to cancellation.
_SERIES_RADIUS = 0.5

# Default tile: tokens per chunk and elements per [tokens, columns] buffer. CPU: six buffers fit a
# shared L3 cache (measured best on a 2-core EPYC, benchmarks/RESULTS.md) and 128 tokens make the
# fused GEMMs compute-bound; GPU: every elementwise kernel runs at bandwidth.
_CPU_TILE = (128, 2**19)
_GPU_TILE = (1024, 2**25)

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class Tiling:
    """Where this rank's shard sits in the vocabulary and how to walk it."""

    group: Optional[dist.ProcessGroup]
    world: int
    vocab_start: int
    valid_columns: int
    chunk_rows: int
    tile_columns: int
    inv_temperature: float
    inv_kl_temperature: float
    dtype: torch.dtype
    with_ref: bool

    @property
    def separate_kl_temperature(self) -> bool:
        return self.inv_kl_temperature != self.inv_temperature

    def tiles(self):
        """Column ranges [start, stop) of this shard's valid columns, one per tile."""
        return [
            (start, min(start + self.tile_columns, self.valid_columns))
            for start in range(0, self.valid_columns, self.tile_columns)
        ]


# Rows of the per-token statistics of a column set (tile, shard, or the whole vocabulary), float64.
# Policy at the sampling temperature T: max logit, log sum e^{(z - max) / T}, entropy, target logit.
_SHIFT, _LOG_S, _ENTROPY, _TARGET_LOGIT = 0, 1, 2, 3
# Reference: the same at T; c = log(Z / Z_r) - (max - ref max) / T_kl and the set's KL at T_kl;
# log sums at T_kl when T_kl != T.
_REF_SHIFT, _REF_LOG_S, _REF_TARGET_LOGIT, _LOG_RATIO, _SET_KL = 4, 5, 6, 7, 8
_KL_LOG_S, _KL_REF_LOG_S = 9, 10


def stat_rows(tiling: Tiling) -> int:
    if not tiling.with_ref:
        return 4
    return 11 if tiling.separate_kl_temperature else 9


def empty_shard_stats(tiling: Tiling, rows: int, device) -> torch.Tensor:
    """Statistics [K, rows] of a set without columns (a shard that is all padding)."""
    stats = torch.zeros(stat_rows(tiling), rows, dtype=torch.float64, device=device)
    for row in (_LOG_S, _REF_LOG_S, _KL_LOG_S, _KL_REF_LOG_S):
        if row < stats.shape[0]:
            stats[row] = -math.inf
    return stats


def _series_coefficients(dtype: torch.dtype) -> Tuple[float, ...]:
    """Coefficients of h(y) = g(y) / y^2 = sum_k (-y)^k / (k + 2)!, highest power first.

    Truncated where the next term is below a quarter ulp of h on |y| < _SERIES_RADIUS.
    """
    smallest_h = 0.4  # h(1/2) = 0.426 is the least value of h on |y| <= 1/2
    eps = torch.finfo(dtype).eps
    coefficients = [0.5]
    while _SERIES_RADIUS ** len(coefficients) / math.factorial(len(coefficients) + 2) >= 0.25 * eps * smallest_h:
        k = len(coefficients)
        coefficients.append((-1.0) ** k / math.factorial(k + 2))
    return tuple(reversed(coefficients))


class _Workspace:
    """Six [chunk_rows, tile_columns] buffers reused by every tile of one call (forward or backward)."""

    def __init__(self, rows: int, columns: int, dtype: torch.dtype, device: torch.device):
        self.buffers = torch.empty(6, rows, columns, dtype=dtype, device=device)
        self.series = [torch.tensor(a, dtype=dtype, device=device) for a in _series_coefficients(dtype)]

    def take(self, rows: int, columns: int):
        return [buffer[:rows, :columns] for buffer in self.buffers]


def _owned_target_logits(logits: torch.Tensor, local_target: torch.Tensor) -> torch.Tensor:
    """[n] logit of each row's target where it falls in this tile (local index in range), 0 elsewhere."""
    owned = (local_target >= 0) & (local_target < logits.shape[1])
    index = local_target.clamp(0, logits.shape[1] - 1).unsqueeze(1)
    return torch.where(
        owned, logits.gather(1, index).squeeze(1), torch.zeros((), dtype=logits.dtype, device=logits.device)
    )


def _shift_of(logits: torch.Tensor) -> torch.Tensor:
    """[n] row maximum of this tile, or 0 for a row with no unmasked column (its mass is then 0)."""
    shift = logits.amax(dim=1)
    return shift.masked_fill(shift <= MASKED_LOGIT, 0.0)


def _exp_shifted(out, logits, shift, scale) -> torch.Tensor:
    """out = exp((logits - shift) * scale); returns the row sums [n]."""
    torch.sub(logits, shift.unsqueeze(1), out=out)
    if scale != 1.0:
        out.mul_(scale)
    out.exp_()
    return out.sum(dim=1)


def _g_float64(y: torch.Tensor) -> torch.Tensor:
    """g(y) = y + expm1(-y) >= 0 in float64 for small per-token tensors (set merging)."""
    return y + torch.expm1(-y)


def _tile_statistics(z, zr, local_target, tiling: Tiling, work: _Workspace, out: torch.Tensor) -> None:
    """Reduce one tile to per-token statistics of its column set, written into ``out`` [K, n] (float64).

    z, zr: [n, columns] compute-dtype policy / reference logits (masked entries clamped to
    MASKED_LOGIT); both are overwritten (they are workspace buffers). local_target: [n] target ids
    relative to the tile's first column.
    """
    t1, t2, t3, t4 = work.take(*z.shape)[2:]
    inv_t, inv_kl = tiling.inv_temperature, tiling.inv_kl_temperature

    out[_TARGET_LOGIT] = _owned_target_logits(z, local_target)
    shift = _shift_of(z)
    torch.sub(z, shift.unsqueeze(1), out=t1)
    if inv_t != 1.0:
        t1.mul_(inv_t)
    torch.exp(t1, out=t2)
    total = t2.sum(dim=1)
    weighted_u = t1.mul_(t2).sum(dim=1)  # sum e^u u; e^u = 0 where u = -1e30, so no 0 * inf
    out[_SHIFT] = shift
    out[_LOG_S] = torch.log(total)
    out[_ENTROPY] = torch.where(total > 0, torch.log(total) - weighted_u / total, torch.zeros_like(total))
    if not tiling.with_ref:
        return

    out[_REF_TARGET_LOGIT] = _owned_target_logits(zr, local_target)
    ref_shift = _shift_of(zr)
    ref_total = _exp_shifted(t3, zr, ref_shift, inv_t)
    out[_REF_SHIFT] = ref_shift
    out[_REF_LOG_S] = torch.log(ref_total)
    if tiling.separate_kl_temperature:
        total = _exp_shifted(t2, z, shift, inv_kl)
        ref_total = _exp_shifted(t3, zr, ref_shift, inv_kl)
        out[_KL_LOG_S] = torch.log(total)
        out[_KL_REF_LOG_S] = torch.log(ref_total)
    eu, eur = t2, t3

    # d: subtract the close logits first, then the (close) maxima.
    d = torch.sub(z, zr, out=t1).sub_((shift - ref_shift).unsqueeze(1))
    if inv_kl != 1.0:
        d.mul_(inv_kl)
    both = (total > 0) & (ref_total > 0)
    total, ref_total = (torch.where(both, x, torch.ones_like(x)).double() for x in (total, ref_total))
    # c' ~ c = log S - log S_r; any constant works (see the module docstring), this one leaves delta tiny.
    approx_ratio = torch.where(both, (total.log() - ref_total.log()).to(tiling.dtype), torch.zeros_like(shift))
    y = d.sub_(approx_ratio.unsqueeze(1))
    y_clamped = torch.clamp(y, -_SERIES_RADIUS, _SERIES_RADIUS, out=t4)
    series, beyond = z, zr  # the logits are no longer needed: reuse their buffers
    coefficients = work.series
    torch.mul(y_clamped, coefficients[0], out=series).add_(coefficients[1])
    for a in coefficients[2:]:
        torch.addcmul(a, series, y_clamped, out=series)
    series.mul_(y_clamped).mul_(y_clamped).mul_(eu)  # e^u g(y) on |y| <= 1/2
    torch.ne(y, y_clamped, out=beyond)  # 1.0 where |y| > 1/2
    direct = y.mul_(eu)
    first_order = direct.sum(dim=1).double()  # A = sum e^u y
    # e^u g(y) = e^u y + e^{u_r + c'} - e^u: every term bounded, no overflow for any y.
    direct.addcmul_(eur, torch.exp(approx_ratio).unsqueeze(1)).sub_(eu)
    second_order = direct.sub_(series).mul_(beyond).add_(series).sum(dim=1).double()  # G = sum e^u g(y)
    # sum p e^{-y} = e^{-delta} with delta = c - c', i.e. (G - A) / S = expm1(-delta); then
    # G / S = KL + g(delta), where g(delta) ~ delta^2 / 2 is far below rounding of KL.
    delta = -torch.log1p((second_order - first_order) / total)
    zero = torch.zeros_like(total)
    out[_LOG_RATIO] = torch.where(both, approx_ratio.double() + delta, zero)
    out[_SET_KL] = torch.where(both, (second_order / total - _g_float64(delta)).clamp_(min=0), zero)


def _combine(parts: torch.Tensor, tiling: Tiling) -> torch.Tensor:
    """Statistics [K, n] of the union of disjoint column sets from theirs [P, K, n] (float64)."""
    if parts.shape[0] == 1:
        return parts[0]
    inv_t, inv_kl = tiling.inv_temperature, tiling.inv_kl_temperature
    out = torch.empty_like(parts[0])
    zeros = torch.zeros_like(parts[:, 0])

    def merged_shift(shift, log_s):
        top = torch.where(log_s > -math.inf, shift, -math.inf).amax(0)
        return torch.where(top > -math.inf, top, 0.0)

    def log_masses(shift, log_s, inv):
        """Each set's log mass (scaled logits), their log-sum, and the log weights [P, n]."""
        log_mass = shift * inv + log_s
        log_total = torch.logsumexp(log_mass, dim=0)
        return log_total, log_mass - log_total

    shift, log_s = parts[:, _SHIFT], parts[:, _LOG_S]
    out[_SHIFT] = merged_shift(shift, log_s)
    log_total, log_w = log_masses(shift, log_s, inv_t)
    out[_LOG_S] = log_total - out[_SHIFT] * inv_t
    w = log_w.exp()
    out[_ENTROPY] = torch.where(w > 0, w * (parts[:, _ENTROPY] - log_w), zeros).sum(0)
    out[_TARGET_LOGIT] = parts[:, _TARGET_LOGIT].sum(0)  # one set holds the target, the others add 0
    if not tiling.with_ref:
        return out

    ref_shift, ref_log_s = parts[:, _REF_SHIFT], parts[:, _REF_LOG_S]
    out[_REF_SHIFT] = merged_shift(ref_shift, ref_log_s)
    ref_log_total, _ = log_masses(ref_shift, ref_log_s, inv_t)
    out[_REF_LOG_S] = ref_log_total - out[_REF_SHIFT] * inv_t
    out[_REF_TARGET_LOGIT] = parts[:, _REF_TARGET_LOGIT].sum(0)
    if tiling.separate_kl_temperature:
        kl_log_s, kl_ref_log_s = parts[:, _KL_LOG_S], parts[:, _KL_REF_LOG_S]
        kl_log_total, log_w = log_masses(shift, kl_log_s, inv_kl)
        kl_ref_log_total, log_w_ref = log_masses(ref_shift, kl_ref_log_s, inv_kl)
        out[_KL_LOG_S] = kl_log_total - out[_SHIFT] * inv_kl
        out[_KL_REF_LOG_S] = kl_ref_log_total - out[_REF_SHIFT] * inv_kl
    else:
        kl_log_s, kl_ref_log_s = log_s, ref_log_s
        _, log_w_ref = log_masses(ref_shift, ref_log_s, inv_t)
    w, w_ref = log_w.exp(), log_w_ref.exp()
    has_mass = kl_log_s > -math.inf
    # lambda_s = log(Z_s / Z_r,s) from maxima and c (no O(|logit|) terms); -inf without policy mass.
    lam = torch.where(has_mass, (shift - ref_shift) * inv_kl + parts[:, _LOG_RATIO], -math.inf)
    # lambda = lambda_0 + log sum_s w'_s e^{lambda_s - lambda_0}. Anchored on the set with the most
    # policy mass, w'_s e^{lambda_s - lambda_0} = w_s e^{lambda - lambda_0} <= P: nothing overflows.
    # Near lambda_0 the sum is 1 + sum w' expm1(gap) (log1p keeps the small difference exact); far
    # below (the anchor holds almost none of the reference's mass) it may underflow: log space.
    anchor = lam.gather(0, w.argmax(dim=0, keepdim=True))
    gap = lam - anchor
    spread_terms = torch.where(gap <= 1, w_ref * torch.expm1(gap), torch.exp(log_w_ref + gap) - w_ref)
    near = torch.log1p(torch.where(w_ref > 0, spread_terms, zeros).sum(0))
    far = torch.logsumexp(log_w_ref + gap, dim=0)
    log_growth = torch.where(far > -1, near, far)  # lambda - lambda_0
    beta = gap - log_growth  # log(w_s / w'_s)
    # w g(beta) = w' - w + w beta where e^{-beta} would overflow.
    w_g = torch.where(beta < -1, w_ref - w + w * beta, w * _g_float64(beta))
    # A set the reference masks entirely: each token contributes p (z - MASKED_LOGIT) / T_kl ~ 1e30 p, as
    # in _tile_statistics for single masked tokens (a stand-in for +inf that does not depend on tiling).
    stranded = w * (-MASKED_LOGIT * inv_kl)
    terms = torch.where(kl_ref_log_s > -math.inf, w * parts[:, _SET_KL] + w_g, stranded)
    out[_SET_KL] = torch.where(w > 0, terms, w_ref).sum(0)
    out[_LOG_RATIO] = (anchor[0] + log_growth) - (out[_SHIFT] - out[_REF_SHIFT]) * inv_kl
    return out


@dataclass
class TileResults:
    """Per-token results [N], what backward needs (``saved``, [3 or 7, N] compute dtype) and this rank's
    statistics before the merge over the group (``shard``, [K, N] float64; the first-use check's)."""

    logprob: torch.Tensor
    entropy: torch.Tensor
    ref_logprob: Optional[torch.Tensor]
    kl: Optional[torch.Tensor]
    saved: Optional[torch.Tensor]
    shard: Optional[torch.Tensor] = None


def save_results(ctx, inputs: tuple, results: TileResults, tiling: Tiling) -> tuple:
    """Autograd forward epilogue: keep the inputs and the per-token numbers, return the four outputs."""
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*inputs, results.saved)
    ctx.tiling = tiling
    if results.ref_logprob is not None:
        ctx.mark_non_differentiable(results.ref_logprob)
    return results.logprob, results.entropy, results.ref_logprob, results.kl


def finish_statistics(stats: torch.Tensor, tiling: Tiling) -> TileResults:
    """Per-token results from the statistics [K, N] of the whole vocabulary (of one shard: its results as if
    it were the vocabulary, which the first-use check compares without a collective)."""
    inv_t = tiling.inv_temperature
    logprob = (stats[_TARGET_LOGIT] - stats[_SHIFT]) * inv_t - stats[_LOG_S]
    # backward: log p = (z - shift) / T - log S; log p - log q = (z - z_r - shift + ref_shift) / T_kl - c
    saved = [_SHIFT, _LOG_S, _ENTROPY]
    ref_logprob = kl = None
    if tiling.with_ref:
        ref_logprob = (stats[_REF_TARGET_LOGIT] - stats[_REF_SHIFT]) * inv_t - stats[_REF_LOG_S]
        kl = stats[_SET_KL]
        saved += [_REF_SHIFT, _KL_LOG_S if tiling.separate_kl_temperature else _LOG_S, _LOG_RATIO, _SET_KL]
    return TileResults(logprob, stats[_ENTROPY], ref_logprob, kl, stats[saved].to(tiling.dtype))


def tiled_forward(load: Callable, targets: torch.Tensor, tiling: Tiling, device: torch.device) -> TileResults:
    """Walk the tiles, reduce and combine them, all-gather the per-token stats of the shards, merge."""
    return merge_shards(shard_statistics(load, targets, tiling, device), tiling)


def shard_statistics(load: Callable, targets: torch.Tensor, tiling: Tiling, device: torch.device) -> torch.Tensor:
    """This rank's statistics [K, N] (float64) of its valid columns, tile by tile: no collective."""
    n_rows = targets.shape[0]
    tiles = tiling.tiles()
    if tiles and n_rows:
        stats = torch.empty(stat_rows(tiling), n_rows, dtype=torch.float64, device=device)
        work = _Workspace(min(tiling.chunk_rows, n_rows), tiles[0][1], tiling.dtype, device)
        local_target = targets - tiling.vocab_start
        for start in range(0, n_rows, tiling.chunk_rows):
            stop = min(start + tiling.chunk_rows, n_rows)
            parts = torch.empty(len(tiles), *stats[:, start:stop].shape, dtype=stats.dtype, device=device)
            for part, (first, last) in zip(parts, tiles):
                z, zr = work.take(stop - start, last - first)[:2]
                load(start, stop, first, last, z, zr if tiling.with_ref else None)
                _tile_statistics(z, zr, local_target[start:stop] - first, tiling, work, part)
            stats[:, start:stop] = _combine(parts, tiling)
    else:
        stats = empty_shard_stats(tiling, n_rows, device)
    return stats


def merge_shards(stats: torch.Tensor, tiling: Tiling) -> TileResults:
    """Per-token results from this shard's statistics [K, N] (float64): one all-gather over the group, merged."""
    shard = stats
    if tiling.world > 1:
        gathered = torch.empty(tiling.world * stats.shape[0], stats.shape[1], dtype=stats.dtype, device=stats.device)
        _ALL_GATHER(gathered, stats, group=tiling.group)
        stats = _combine(gathered.view(tiling.world, *stats.shape), tiling)
    results = finish_statistics(stats, tiling)
    results.shard = shard
    return results


def tiled_backward(
    load: Callable, store: Callable, targets, saved, grad_logprob, grad_entropy, grad_kl, tiling: Tiling, device
) -> None:
    """Recompute each tile and hand d(loss)/d(policy logits) [n, columns] to ``store(start, stop, first, last, grad)``."""
    n_rows = targets.shape[0]
    tiles = tiling.tiles()
    if not (tiles and n_rows):
        return
    work = _Workspace(min(tiling.chunk_rows, n_rows), tiles[0][1], tiling.dtype, device)
    local_target = targets - tiling.vocab_start
    shift, log_s, entropy = (row.unsqueeze(1) for row in saved[:3])
    need_ref = grad_kl is not None
    inv_t, inv_kl = tiling.inv_temperature, tiling.inv_kl_temperature
    for start in range(0, n_rows, tiling.chunk_rows):
        stop = min(start + tiling.chunk_rows, n_rows)
        rows = slice(start, stop)
        for first, last in tiles:
            z, zr, log_p, p, grad, scratch = work.take(stop - start, last - first)
            load(start, stop, first, last, z, zr if need_ref else None)
            torch.sub(z, shift[rows], out=log_p)
            if inv_t != 1.0:
                log_p.mul_(inv_t)
            log_p.sub_(log_s[rows])
            torch.exp(log_p, out=p)
            grad.zero_()
            # d logprob_t / dz = (1{v=t} - p) / T ;  d H / dz = -p (log p + H) / T
            if grad_entropy is not None:
                coefficient = log_p.add_(entropy[rows]).mul_(grad_entropy[rows].unsqueeze(1))
                if grad_logprob is not None:
                    coefficient.add_(grad_logprob[rows].unsqueeze(1))
                grad.addcmul_(coefficient, p, value=-inv_t)
            elif grad_logprob is not None:
                grad.addcmul_(p, grad_logprob[rows].unsqueeze(1), value=-inv_t)
            if grad_logprob is not None:
                tile_target = local_target[rows] - first
                owned = (tile_target >= 0) & (tile_target < last - first)
                gain = torch.where(owned, grad_logprob[rows] * inv_t, torch.zeros_like(grad_logprob[rows]))
                grad.scatter_add_(1, tile_target.clamp(0, last - first - 1).unsqueeze(1), gain.unsqueeze(1))
            if need_ref:
                ref_shift, kl_log_s, log_ratio, kl = (row[rows].unsqueeze(1) for row in saved[3:])
                if tiling.separate_kl_temperature:
                    torch.sub(z, shift[rows], out=p).mul_(inv_kl).sub_(kl_log_s).exp_()
                # d KL / dz = p (log p - log q - KL) / T_kl
                excess = torch.sub(z, zr, out=scratch).sub_(shift[rows] - ref_shift).mul_(inv_kl)
                excess.sub_(log_ratio + kl)
                grad.addcmul_(excess.mul_(p), grad_kl[rows].unsqueeze(1), value=inv_kl)
            store(start, stop, first, last, grad)


def resolve_tiling(
    local_vocab: int,
    targets: torch.Tensor,
    *,
    group,
    vocab_size,
    chunk_size,
    vocab_chunk_size,
    temperature,
    kl_temperature,
    dtype,
    with_ref,
    device,
) -> Tiling:
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    full = world * local_vocab
    if vocab_size is None:
        vocab_size = full
    if not 0 < vocab_size <= full:
        raise ValueError(
            f"vocab_size={vocab_size} must be in (0, {full}] = tensor-parallel size {world} x "
            f"local vocabulary {local_vocab}"
        )
    for name, value in (("temperature", temperature), ("kl_temperature", kl_temperature)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    bad = (targets < 0) | (targets >= vocab_size)
    if targets.is_cuda:  # checked on the device: no host synchronisation per call
        torch._assert_async(~bad.any(), f"token statistics: a target id is outside the vocabulary [0, {vocab_size})")
    elif bool(bad.any()):
        position = int(bad.flatten().nonzero()[0])
        raise ValueError(
            f"targets[{position}] (flattened) = {int(targets.flatten()[position])} is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    default_rows, budget = _GPU_TILE if device.type == "cuda" else _CPU_TILE
    chunk_size = default_rows if chunk_size is None else chunk_size
    vocab_chunk_size = max(1, budget // chunk_size) if vocab_chunk_size is None else vocab_chunk_size
    for name, value in (("chunk_size", chunk_size), ("vocab_chunk_size", vocab_chunk_size)):
        if value < 1:
            raise ValueError(f"{name} must be a positive number, got {value}")
    start = rank * local_vocab
    return Tiling(
        group=group if world > 1 else None,
        world=world,
        vocab_start=start,
        valid_columns=max(0, min(local_vocab, vocab_size - start)),
        chunk_rows=int(chunk_size),
        tile_columns=int(vocab_chunk_size),
        inv_temperature=1.0 / temperature,
        inv_kl_temperature=1.0 / kl_temperature,
        dtype=dtype,
        with_ref=with_ref,
    )
