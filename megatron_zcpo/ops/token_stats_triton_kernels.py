"""Triton kernels of the token statistics: one HBM pass per row over its vocabulary shard, one elementwise backward.

The algebra is :mod:`megatron_zcpo.ops.token_stats_kernels`'s, in float32 registers. A program owns
``BLOCK_M`` rows and walks their valid columns in *super-blocks* of ``SUB`` x ``BLOCK_V`` columns.
Each super-block is a column set reduced exactly as the torch path reduces a tile: its maxima
(pass 1), its sums at the sampling and KL temperatures and the entropy accumulator (pass 2), then
the second-order sum G = sum e^u g(y) and A = sum e^u y with y = d - c' (pass 3). Passes 2 and 3
re-read the super-block just read by pass 1 (a few tens of KiB per program: L1/L2 hits), so HBM
is read once. Every pass keeps per-lane partial sums and reduces across lanes once per pass.
The super-block's statistics then merge into the row's running set by the exact tile merge
``KL = sum_s w_s (KL_s + g(beta_s))`` (float32, maxima differences taken before anything is
scaled, log1p / expm1 without cancellation), so a row needs no global maximum and no second
HBM pass. The result per row is the shard's statistics row block of the torch path (SHIFT, LOG_S,
...), merged over tensor-parallel ranks by the same float64 code after one all-gather.

With ``CACHE`` the forward also writes, per element, e^{(z - m)/T_hi} (m the super-block's policy
maximum, T_hi the larger of the two temperatures, so the other temperature's probabilities are a
power >= 1 of it) and y, both float16 (y clamped to +-6e4), plus per (row, super-block) the two
maxima and c'. The fused op's backward rebuilds p, log p and log p - log q from them with
per-(row, super-block) constants instead of recomputing the output-layer GEMM. At float16's 2**-11
relative precision the gradients differ from exact ones 10-40x less than by the bfloat16 rounding
of the logit gradient that the gradient GEMMs take anyway (tests/ops/test_token_stats_triton.py).

Logits at or below MASKED_LOGIT (including -inf) have probability exactly 0 and columns at or past
``n_cols`` are not read. Under ``TRITON_INTERPRET=1`` these kernels run on CPU tensors (tests).
"""

import os

import triton
import triton.language as tl

from megatron_zcpo.ops.token_stats_kernels import MASKED_LOGIT

# Triton's interpreter re-patches triton.language on every call of a jit function (milliseconds
# each); there the helpers below run as plain Python inside the interpreted kernels instead.
_helper = (lambda fn: fn) if os.environ.get("TRITON_INTERPRET") == "1" else triton.jit

MASKED = tl.constexpr(MASKED_LOGIT)
INF = tl.constexpr(float("inf"))
SERIES_RADIUS = tl.constexpr(0.5)  # token_stats_kernels._SERIES_RADIUS, where _g_series is float32-exact
HUGE_KL_SCALE = tl.constexpr(-MASKED_LOGIT)  # the KL of mass the reference masks, per unit of mass
Y_LIMIT = tl.constexpr(6e4)  # float16's range; |log p - log q| beyond it only where the reference masks a token
LOG2E = tl.constexpr(1.4426950408889634)  # hot loops use exp2 (Triton: ex2.approx.ftz, one instruction)
LN2 = tl.constexpr(0.6931471805599453)


# ------------------------------------------------------------------------------------------------
# scalar helpers (elementwise on per-row vectors)


@_helper
def _g_series(y):
    """g(y) / y^2 = sum_k (-y)^k / (k + 2)!: float32-exact on |y| <= 1/2 (token_stats_kernels._series_coefficients)."""
    h = -2.7557319223985893e-06 * y + 2.48015873015873e-05
    h = h * y - 0.0001984126984126984
    h = h * y + 0.001388888888888889
    h = h * y - 0.008333333333333333
    h = h * y + 0.041666666666666664
    h = h * y - 0.16666666666666666
    return h * y + 0.5


@_helper
def _log1p(x):
    """log(1 + x) to a few ulp (Goldberg: the rounding of 1 + x is divided out); x >= -1."""
    u = 1.0 + x
    small = u == 1.0
    denominator = tl.where(small, 1.0, u - 1.0)
    return tl.where(small, x, tl.where(u == INF, u, tl.log(u) * (x / denominator)))


@_helper
def _expm1(x):
    """exp(x) - 1 to a few ulp (Kahan: the rounding of exp(x) is divided out by log of it)."""
    u = tl.exp(x)
    um1 = u - 1.0
    plain = (um1 == 0.0) | (u == 0.0) | (u == INF)
    log_u = tl.where(plain, 1.0, tl.log(u))
    result = um1 * (x / log_u)
    return tl.where(um1 == 0.0, x, tl.where(plain, um1, result))


@_helper
def _g(y):
    """g(y) = y + expm1(-y) >= 0: the series on |y| <= 1/2, directly beyond (loses a few ulp there)."""
    clamped = tl.minimum(tl.maximum(y, -SERIES_RADIUS), SERIES_RADIUS)
    series = _g_series(clamped) * clamped * clamped
    return tl.where(tl.abs(y) <= SERIES_RADIUS, series, y + _expm1(-y))


@_helper
def _weights(log_ratio):
    """(w_a, w_b, log w_a, log w_b) of two sets from log(Z_a / Z_b) (+-inf when one set is empty)."""
    small = tl.exp(-tl.abs(log_ratio))
    soft = _log1p(small)
    big_w = 1.0 / (1.0 + small)
    small_w = small * big_w
    a_big = log_ratio >= 0.0
    log_small = -tl.abs(log_ratio) - soft
    return (
        tl.where(a_big, big_w, small_w),
        tl.where(a_big, small_w, big_w),
        tl.where(a_big, -soft, log_small),
        tl.where(a_big, log_small, -soft),
    )


@_helper
def _w_g(w, w_ref, beta):
    """w g(beta) with w / w_ref = e^beta; w_ref - w + w beta where e^{-beta} would overflow."""
    return tl.where(beta < -1.0, w_ref - w + w * beta, w * _g(beta))


@_helper
def _merge_kl(m_a, mr_a, s_a, sr_a, c_a, kl_a, m_b, mr_b, s_b, sr_b, c_b, kl_b, m_new, mr_new, inv_kl):
    """Exact KL and log ratio c of the union of two disjoint column sets (token_stats_kernels._combine).

    Per set: effective maxima m, mr (0 for a set without mass), sums s, sr at the KL temperature
    relative to them, c = log(s / sr) (0 unless both have mass) and its KL. m_new, mr_new: the
    union's effective maxima. Returns (c, KL) of the union relative to m_new, mr_new.
    """
    has_a, has_b = s_a > 0.0, s_b > 0.0
    ref_a, ref_b = sr_a > 0.0, sr_b > 0.0
    # log(Z_a / Z_b): maxima differences first, the sums' logs as one ratio.
    lw = tl.where(
        has_a & has_b, (m_a - m_b) * inv_kl + tl.log(s_a / tl.where(has_b, s_b, 1.0)), tl.where(has_a, INF, -INF)
    )
    lwr = tl.where(
        ref_a & ref_b, (mr_a - mr_b) * inv_kl + tl.log(sr_a / tl.where(ref_b, sr_b, 1.0)), tl.where(ref_a, INF, -INF)
    )
    w_a, w_b, _, _ = _weights(lw)
    wr_a, wr_b, lwr_a, lwr_b = _weights(lwr)
    # lambda_b - lambda_a, lambda = log(Z / Z_ref) of a set, from close differences only.
    gap_ba = ((m_b - mr_b) - (m_a - mr_a)) * inv_kl + (c_b - c_a)
    # Anchor on the set with more policy mass: the other's w_ref e^{gap} is then bounded.
    a_anchor = w_a >= w_b
    gap = tl.where(a_anchor, tl.where(has_b, gap_ba, -INF), tl.where(has_a, -gap_ba, -INF))
    wr_o = tl.where(a_anchor, wr_b, wr_a)
    lwr_o = tl.where(a_anchor, lwr_b, lwr_a)
    lwr_anchor = tl.where(a_anchor, lwr_a, lwr_b)
    shifted = tl.exp(lwr_o + gap)  # w_ref,o e^{gap}
    spread = tl.where(gap <= 1.0, wr_o * _expm1(gap), shifted - wr_o)
    near = _log1p(tl.where(wr_o > 0.0, spread, 0.0))
    top = tl.maximum(lwr_anchor, lwr_o + gap)
    low = tl.minimum(lwr_anchor, lwr_o + gap)
    far = tl.where(top == -INF, -INF, top + _log1p(tl.exp(low - top)))
    growth = tl.where(far > -1.0, near, far)  # lambda - lambda_anchor
    beta_anchor = -growth
    beta_o = gap - growth
    beta_a = tl.where(a_anchor, beta_anchor, beta_o)
    beta_b = tl.where(a_anchor, beta_o, beta_anchor)
    term_a = tl.where(
        w_a > 0.0, tl.where(ref_a, w_a * kl_a + _w_g(w_a, wr_a, beta_a), w_a * HUGE_KL_SCALE * inv_kl), wr_a
    )
    term_b = tl.where(
        w_b > 0.0, tl.where(ref_b, w_b * kl_b + _w_g(w_b, wr_b, beta_b), w_b * HUGE_KL_SCALE * inv_kl), wr_b
    )
    m_anchor = tl.where(a_anchor, m_a, m_b)
    mr_anchor = tl.where(a_anchor, mr_a, mr_b)
    c_anchor = tl.where(a_anchor, c_a, c_b)
    c = ((m_anchor - mr_anchor) - (m_new - mr_new)) * inv_kl + c_anchor + growth
    any_mass = has_a | has_b
    return tl.where(any_mass, c, 0.0), tl.where(any_mass, term_a + term_b, 0.0)


@_helper
def _rescale(m, m_new, s, scale):
    """Factor that moves sums relative to m onto m_new (0 for an empty set)."""
    return tl.where(s > 0.0, tl.exp((m - m_new) * scale), 0.0)


@_helper
def _load_raw(ptr, rows, row_ok, stride, cols, n_cols):
    """[BLOCK_M, BLOCK_V] float32 logits as stored (-inf possible), -inf past n_cols and past the rows."""
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :], mask=mask, other=-INF).to(tl.float32)


@_helper
def _load(ptr, rows, row_ok, stride, cols, n_cols):
    """[BLOCK_M, BLOCK_V] float32 logits, masked entries clamped to MASKED, columns past n_cols MASKED."""
    return tl.maximum(_load_raw(ptr, rows, row_ok, stride, cols, n_cols), MASKED)


@_helper
def _effective(m):
    """Shift of a set: its maximum, or 0 when every logit is masked (its mass is then 0)."""
    return tl.where(m > MASKED, m, 0.0)


# ------------------------------------------------------------------------------------------------
# forward


@triton.jit
def token_stats_forward_kernel(
    z_ptr,
    zr_ptr,
    z_stride,
    zr_stride,
    target_ptr,
    stats_ptr,
    stats_stride,
    e_cache_ptr,
    y_cache_ptr,
    cache_stride,
    block_ptr,
    n_super,
    block_plane,
    n_rows,
    n_cols,
    inv_t,
    inv_kl,
    WITH_REF: tl.constexpr,
    SEPARATE_KL: tl.constexpr,
    CACHE: tl.constexpr,
    CACHE_AT_KL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
    SUB: tl.constexpr,
):
    """Statistics rows [K, n_rows] (float32, token_stats_kernels' row order) of this shard's valid columns.

    z, zr: [n_rows, >= n_cols] logits (row strides given, any float dtype); target: [n_rows] int64
    target id relative to the shard's first column. With CACHE: e_cache [n_rows, n_cols] float16
    (at T_kl when CACHE_AT_KL, else at T), y_cache float16 (WITH_REF) and block [3, n_rows,
    n_super] float32 planes ``block_plane`` apart (per super-block: policy maximum, reference
    maximum, c').
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    lanes = tl.arange(0, BLOCK_V)
    width = BLOCK_V * SUB
    zeros = tl.zeros([BLOCK_M], tl.float32)
    # The running set: maxima, sums at T (and at T_kl), entropy accumulator, c and KL.
    m, s, ent = zeros + MASKED, zeros, zeros
    mr, sr, c, kl = zeros + MASKED, zeros, zeros, zeros
    sk, srk = zeros, zeros
    for start in range(0, n_cols, width):
        n_sub = tl.minimum(SUB, tl.cdiv(n_cols - start, BLOCK_V))
        block_at = rows.to(tl.int64) * n_super + start // width
        # pass 1: maxima (clamped once per row, not per element)
        mv = tl.full([BLOCK_M, BLOCK_V], MASKED, tl.float32)
        mrv = tl.full([BLOCK_M, BLOCK_V], MASKED, tl.float32)
        for j in range(0, n_sub):
            cols = start + j * BLOCK_V + lanes
            mv = tl.maximum(mv, _load_raw(z_ptr, rows, row_ok, z_stride, cols, n_cols))
            if WITH_REF:
                mrv = tl.maximum(mrv, _load_raw(zr_ptr, rows, row_ok, zr_stride, cols, n_cols))
        mb = tl.maximum(tl.max(mv, axis=1), MASKED)
        mb_e = _effective(mb)
        mrb = tl.maximum(tl.max(mrv, axis=1), MASKED)
        mrb_e = _effective(mrb)
        # exponents in base 2: (z - m) is formed exactly first, then one multiply and ex2
        k_t = inv_t * LOG2E
        k_kl = inv_kl * LOG2E
        # pass 2: sums and the entropy accumulator sum e^u u
        sv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        ev = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        srv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        skv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        srkv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
        for j in range(0, n_sub):
            cols = start + j * BLOCK_V + lanes
            d = _load(z_ptr, rows, row_ok, z_stride, cols, n_cols) - mb_e[:, None]
            u2 = d * k_t  # log2 of e^u
            eu = tl.exp2(u2)
            sv += eu
            ev += eu * u2  # e^u = 0 where u ~ -1e30: no 0 * inf
            cached = eu
            if WITH_REF:
                dr = _load(zr_ptr, rows, row_ok, zr_stride, cols, n_cols) - mrb_e[:, None]
                srv += tl.exp2(dr * k_t)
                if SEPARATE_KL:
                    ek = tl.exp2(d * k_kl)
                    skv += ek
                    srkv += tl.exp2(dr * k_kl)
                    if CACHE_AT_KL:
                        cached = ek
            if CACHE:
                at = rows[:, None].to(tl.int64) * cache_stride + cols[None, :]
                cache_mask = row_ok[:, None] & (cols < n_cols)[None, :]
                tl.store(e_cache_ptr + at, cached.to(tl.float16), mask=cache_mask)
        sb = tl.sum(sv, axis=1)
        eb = tl.sum(ev, axis=1) * LN2
        if CACHE:
            tl.store(block_ptr + block_at, mb_e, mask=row_ok)
        # the policy's running sums (online softmax with an entropy accumulator), applied below
        m_e = _effective(m)
        m_new = tl.maximum(m, mb)
        m_new_e = _effective(m_new)
        a = _rescale(m_e, m_new_e, s, inv_t)
        b = _rescale(mb_e, m_new_e, sb, inv_t)
        ent_new = tl.where(s > 0.0, a * (ent + (m_e - m_new_e) * inv_t * s), 0.0) + tl.where(
            sb > 0.0, b * (eb + (mb_e - m_new_e) * inv_t * sb), 0.0
        )
        if WITH_REF:
            srb = tl.sum(srv, axis=1)
            if SEPARATE_KL:
                skb = tl.sum(skv, axis=1)
                srkb = tl.sum(srkv, axis=1)
                s_kl, sr_kl = sk, srk
            else:
                skb, srkb = sb, srb
                s_kl, sr_kl = s, sr
            # pass 3: G = sum e^u g(y) and A = sum e^u y, y = d - c', c' ~ log of the sums' ratio
            both = (skb > 0.0) & (srkb > 0.0)
            c_prime = tl.where(both, tl.log(skb / tl.where(both, srkb, 1.0)), 0.0)
            e_c = tl.exp(c_prime)
            offset = (mb_e - mrb_e) * inv_kl + c_prime
            gv = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
            av = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
            for j in range(0, n_sub):
                cols = start + j * BLOCK_V + lanes
                z = _load(z_ptr, rows, row_ok, z_stride, cols, n_cols)
                zr = _load(zr_ptr, rows, row_ok, zr_stride, cols, n_cols)
                ek = tl.exp2((z - mb_e[:, None]) * k_kl)
                y = (z - zr) * inv_kl - offset[:, None]  # the close logits subtracted first
                clamped = tl.minimum(tl.maximum(y, -SERIES_RADIUS), SERIES_RADIUS)
                first = ek * y
                av += first
                # beyond the series, e^u g(y) = e^u y + e^{u_r + c'} - e^u: bounded for every y
                direct = first + tl.exp2((zr - mrb_e[:, None]) * k_kl) * e_c[:, None] - ek
                gv += tl.where(y == clamped, _g_series(clamped) * clamped * clamped * ek, direct)
                if CACHE:
                    at = rows[:, None].to(tl.int64) * cache_stride + cols[None, :]
                    cache_mask = row_ok[:, None] & (cols < n_cols)[None, :]
                    tl.store(
                        y_cache_ptr + at, tl.minimum(tl.maximum(y, -Y_LIMIT), Y_LIMIT).to(tl.float16), mask=cache_mask
                    )
            g_b = tl.sum(gv, axis=1)
            a_b = tl.sum(av, axis=1)
            # sum p e^{-y} = e^{-delta} with delta = c - c'; then G / S = KL + g(delta)
            total = tl.where(both, skb, 1.0)
            delta = -_log1p((g_b - a_b) / total)
            c_b = tl.where(both, c_prime + delta, 0.0)
            kl_b = tl.where(both, tl.maximum(g_b / total - _g(delta), 0.0), 0.0)
            mr_e = _effective(mr)
            mr_new = tl.maximum(mr, mrb)
            mr_new_e = _effective(mr_new)
            c, kl = _merge_kl(
                m_e, mr_e, s_kl, sr_kl, c, kl, mb_e, mrb_e, skb, srkb, c_b, kl_b, m_new_e, mr_new_e, inv_kl
            )
            sr = _rescale(mr_e, mr_new_e, sr, inv_t) * sr + _rescale(mrb_e, mr_new_e, srb, inv_t) * srb
            if SEPARATE_KL:
                sk = _rescale(m_e, m_new_e, sk, inv_kl) * sk + _rescale(mb_e, m_new_e, skb, inv_kl) * skb
                srk = _rescale(mr_e, mr_new_e, srk, inv_kl) * srk + _rescale(mrb_e, mr_new_e, srkb, inv_kl) * srkb
            mr = mr_new
            if CACHE:
                tl.store(block_ptr + block_at + block_plane, mrb_e, mask=row_ok)
                tl.store(block_ptr + block_at + 2 * block_plane, c_prime, mask=row_ok)
        s = a * s + b * sb
        ent = ent_new
        m = m_new
    _store_stats(
        z_ptr,
        zr_ptr,
        z_stride,
        zr_stride,
        target_ptr,
        stats_ptr,
        stats_stride,
        rows,
        row_ok,
        n_cols,
        m,
        s,
        ent,
        mr,
        sr,
        c,
        kl,
        sk,
        srk,
        WITH_REF,
        SEPARATE_KL,
    )


@_helper
def _store_stats(
    z_ptr,
    zr_ptr,
    z_stride,
    zr_stride,
    target_ptr,
    stats_ptr,
    stats_stride,
    rows,
    row_ok,
    n_cols,
    m,
    s,
    ent,
    mr,
    sr,
    c,
    kl,
    sk,
    srk,
    WITH_REF: tl.constexpr,
    SEPARATE_KL: tl.constexpr,
):
    """Write the shard's statistics rows (token_stats_kernels: _SHIFT, _LOG_S, ...) for ``rows``."""
    target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
    owned = row_ok & (target >= 0) & (target < n_cols)
    safe = tl.where(owned, target, 0).to(tl.int64)
    row64 = rows.to(tl.int64)
    target_logit = tl.maximum(tl.load(z_ptr + row64 * z_stride + safe, mask=owned, other=0.0).to(tl.float32), MASKED)
    tl.store(stats_ptr + rows, _effective(m), mask=row_ok)
    tl.store(stats_ptr + stats_stride + rows, tl.log(s), mask=row_ok)
    tl.store(
        stats_ptr + 2 * stats_stride + rows,
        tl.where(s > 0.0, tl.log(s) - ent / tl.where(s > 0.0, s, 1.0), 0.0),
        mask=row_ok,
    )
    tl.store(stats_ptr + 3 * stats_stride + rows, tl.where(owned, target_logit, 0.0), mask=row_ok)
    if WITH_REF:
        ref_target = tl.maximum(
            tl.load(zr_ptr + row64 * zr_stride + safe, mask=owned, other=0.0).to(tl.float32), MASKED
        )
        tl.store(stats_ptr + 4 * stats_stride + rows, _effective(mr), mask=row_ok)
        tl.store(stats_ptr + 5 * stats_stride + rows, tl.log(sr), mask=row_ok)
        tl.store(stats_ptr + 6 * stats_stride + rows, tl.where(owned, ref_target, 0.0), mask=row_ok)
        tl.store(stats_ptr + 7 * stats_stride + rows, c, mask=row_ok)
        tl.store(stats_ptr + 8 * stats_stride + rows, kl, mask=row_ok)
        if SEPARATE_KL:
            tl.store(stats_ptr + 9 * stats_stride + rows, tl.log(sk), mask=row_ok)
            tl.store(stats_ptr + 10 * stats_stride + rows, tl.log(srk), mask=row_ok)


# ------------------------------------------------------------------------------------------------
# backward


@triton.jit
def token_stats_backward_kernel(
    z_ptr,
    zr_ptr,
    z_stride,
    zr_stride,
    e_cache_ptr,
    y_cache_ptr,
    cache_stride,
    block_ptr,
    n_super,
    block_plane,
    target_ptr,
    saved_ptr,
    saved_stride,
    grad_lp_ptr,
    grad_ent_ptr,
    grad_kl_ptr,
    out_ptr,
    out_stride,
    n_rows,
    n_cols,
    out_cols,
    inv_t,
    inv_kl,
    cache_to_t,
    cache_to_kl,
    HAS_LP: tl.constexpr,
    HAS_ENT: tl.constexpr,
    HAS_KL: tl.constexpr,
    SEPARATE_KL: tl.constexpr,
    FROM_CACHE: tl.constexpr,
    CACHE_AT_KL: tl.constexpr,
    SUPER_WIDTH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """out [n_rows, out_cols] = d(sum g_lp logprob + g_ent entropy + g_kl KL) / d(policy logits); 0 past n_cols.

    From the logits z, zr, or (FROM_CACHE) from the forward's e / y caches and per-super-block
    constants; ``cache_to_t`` = T_cache / T and ``cache_to_kl`` = T_cache / T_kl. saved: [7, n_rows]
    float32 rows of token_stats_kernels.finish_statistics (shift, log S, entropy, ref shift, log S at T_kl,
    c, KL). BLOCK_V divides SUPER_WIDTH (the forward's super-block width), so a program's columns
    share their super-block constants.
    """
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    first = tl.program_id(1) * BLOCK_V
    cols = first + tl.arange(0, BLOCK_V)
    row_ok = rows < n_rows
    valid = row_ok[:, None] & (cols < n_cols)[None, :]
    row64 = rows.to(tl.int64)
    shift = tl.load(saved_ptr + rows, mask=row_ok, other=0.0)
    log_s = tl.load(saved_ptr + saved_stride + rows, mask=row_ok, other=0.0)
    # log2 p = log2_p: exponents in base 2 (exp2 is one instruction); log p = log2_p * LN2.
    if FROM_CACHE:
        block_at = row64 * n_super + first // SUPER_WIDTH
        m_block = tl.load(block_ptr + block_at, mask=row_ok, other=0.0)
        at = row64[:, None] * cache_stride + cols[None, :]
        e = tl.load(e_cache_ptr + at, mask=valid, other=0.0).to(tl.float32)
        log2_e = tl.log2(e)  # -inf where e = 0 (masked, or below float16's range)
        to_p = ((m_block - shift) * inv_t - log_s) * LOG2E
        if CACHE_AT_KL:
            log2_p = log2_e * cache_to_t + to_p[:, None]
            p = tl.where(e > 0.0, tl.exp2(log2_p), 0.0)
        else:
            p = e * tl.exp2(to_p)[:, None]
            log2_p = log2_e + to_p[:, None]
    else:
        z = _load(z_ptr, rows, row_ok, z_stride, cols, n_cols)
        log2_p = (z - shift[:, None]) * (inv_t * LOG2E) - (log_s * LOG2E)[:, None]
        p = tl.exp2(log2_p)
    grad = tl.zeros([BLOCK_M, BLOCK_V], tl.float32)
    if HAS_LP:
        grad_lp = tl.load(grad_lp_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_ENT:
        # d H / dz = -p (log p + H) / T
        entropy = tl.load(saved_ptr + 2 * saved_stride + rows, mask=row_ok, other=0.0)
        grad_ent = tl.load(grad_ent_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        grad = tl.where(p > 0.0, -inv_t * p * ((log2_p * LN2 + entropy[:, None]) * grad_ent[:, None]), 0.0)
    if HAS_LP:
        # d logprob_t / dz = (1{v=t} - p) / T
        target = tl.load(target_ptr + rows, mask=row_ok, other=-1)
        grad = grad - (inv_t * grad_lp)[:, None] * p
        grad = tl.where(cols[None, :] == target[:, None], grad + (inv_t * grad_lp)[:, None], grad)
    if HAS_KL:
        # d KL / dz = p_kl (log p_kl - log q_kl - KL) / T_kl
        ref_shift = tl.load(saved_ptr + 3 * saved_stride + rows, mask=row_ok, other=0.0)
        kl_log_s = tl.load(saved_ptr + 4 * saved_stride + rows, mask=row_ok, other=0.0)
        c = tl.load(saved_ptr + 5 * saved_stride + rows, mask=row_ok, other=0.0)
        kl = tl.load(saved_ptr + 6 * saved_stride + rows, mask=row_ok, other=0.0)
        grad_kl = tl.load(grad_kl_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if FROM_CACHE:
            ref_block = tl.load(block_ptr + block_at + block_plane, mask=row_ok, other=0.0)
            c_block = tl.load(block_ptr + block_at + 2 * block_plane, mask=row_ok, other=0.0)
            y = tl.load(y_cache_ptr + at, mask=valid, other=0.0).to(tl.float32)
            # y = log p - log q - (per super-block constant): put back the maxima and c' - c
            excess = y + (((m_block - ref_block) - (shift - ref_shift)) * inv_kl + (c_block - c) - kl)[:, None]
            if SEPARATE_KL:
                to_p_kl = ((m_block - shift) * inv_kl - kl_log_s) * LOG2E
                if CACHE_AT_KL:
                    p_kl = e * tl.exp2(to_p_kl)[:, None]
                else:
                    p_kl = tl.where(e > 0.0, tl.exp2(log2_e * cache_to_kl + to_p_kl[:, None]), 0.0)
            else:
                p_kl = p
        else:
            zr = _load(zr_ptr, rows, row_ok, zr_stride, cols, n_cols)
            excess = (z - zr - (shift - ref_shift)[:, None]) * inv_kl - (c + kl)[:, None]
            if SEPARATE_KL:
                p_kl = tl.exp2((z - shift[:, None]) * (inv_kl * LOG2E) - (kl_log_s * LOG2E)[:, None])
            else:
                p_kl = p
        grad = grad + tl.where(p_kl > 0.0, (inv_kl * grad_kl)[:, None] * (p_kl * excess), 0.0)
    grad = tl.where(valid, grad, 0.0)
    out_mask = row_ok[:, None] & (cols < out_cols)[None, :]
    tl.store(out_ptr + row64[:, None] * out_stride + cols[None, :], grad.to(out_ptr.dtype.element_ty), mask=out_mask)
