"""The Triton kernels of the token statistics against float64: values, gradients, TP=2, under the interpreter.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py before triton is first imported); with one, on CUDA tensors. Shapes are tiny: the interpreter
costs ~0.1 ms per operation.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401 -- the dev extra installs it: a broken install fails here, never skips

from megatron_zcpo.ops.token_stats import fused_token_stats, vocab_parallel_token_stats
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.utils.devices import has_cuda, kernel_backend
from tests.ops.test_token_stats import (
    FIELDS,
    HIDDEN,
    PADDED_VOCAB,
    QWEN_VOCAB,
    TOKENS,
    VOCAB,
    _vocab_shard,
    mixed_logits,
    qwen_vocab_levels,
    reference_stats,
    spread_targets,
)

DEVICE = torch.device("cuda" if has_cuda() else "cpu")
ROOT = Path(__file__).resolve().parents[2]
TEMPERATURES = [(1.0, 1.0), (0.7, 1.0), (1.3, 0.6)]  # one pair each: same, cache at T_kl, cache at T


def _on_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


def _assert_matches_reference(stats, expected, rtol=2e-6, atol=2e-5):
    for field in FIELDS:
        value = getattr(stats, field).cpu().double()
        finite = expected[field].isfinite()
        torch.testing.assert_close(value[finite], expected[field][finite], rtol=rtol, atol=atol, msg=field)
    assert (stats.kl >= 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES)
def test_logits_kernel_matches_float64_reference(dtype, temperature, kl_temperature):
    z, zr = mixed_logits(dtype)
    targets = spread_targets()
    stats = vocab_parallel_token_stats(
        *_on_device(z, targets, zr),
        vocab_size=VOCAB,
        temperature=temperature,
        kl_temperature=kl_temperature,
        backend="triton",
    )
    _assert_matches_reference(stats, reference_stats(z, zr, targets, VOCAB, temperature, kl_temperature))
    assert stats.kl[2] == 0  # identical rows: exactly zero


def test_identical_and_disjoint_distributions():
    z, _ = mixed_logits(torch.bfloat16)
    stats = vocab_parallel_token_stats(
        *_on_device(z, spread_targets(), z.clone()),
        vocab_size=VOCAB,
        temperature=0.7,
        kl_temperature=1.3,
        backend="triton",
    )
    assert torch.equal(stats.kl, torch.zeros_like(stats.kl)) and torch.equal(stats.logprob, stats.ref_logprob)
    gen = torch.Generator().manual_seed(2)
    support = torch.rand(4, 64, generator=gen) < 0.5
    z, zr, targets = torch.where(support, 1e4, -1e4), torch.where(support, -1e4, 1e4), torch.zeros(4, dtype=torch.long)
    stats = vocab_parallel_token_stats(*_on_device(z, targets, zr), backend="triton")
    torch.testing.assert_close(stats.kl.cpu().double(), reference_stats(z, zr, targets, 64)["kl"], rtol=1e-6, atol=0)
    # Supports disjoint by masks: infinite KL, reported as at least 1e30 x the stranded mass.
    masked = vocab_parallel_token_stats(
        *_on_device(z.masked_fill(~support, -math.inf), targets, zr.masked_fill(support, -math.inf)), backend="triton"
    )
    assert (masked.kl > 1e29).all() and not masked.kl.isnan().any()


def test_kl_relative_accuracy_on_qwen_vocabulary():
    z, levels = qwen_vocab_levels()
    targets = torch.tensor([0, 70000, QWEN_VOCAB - 1])
    for family, eps, zr in (levels[4], levels[8]):  # the smallest KL of each family (4e-10, 8e-9)
        stats = vocab_parallel_token_stats(*_on_device(z, targets, zr), backend="triton")
        expected = reference_stats(z, zr, targets, QWEN_VOCAB)["kl"]
        assert ((stats.kl.cpu().double() - expected) / expected).abs().max() <= 1e-4, (family, eps)


def _float64_logit_gradients(z, zr, targets, weights, **options):
    logits = z.double().requires_grad_()
    stats = vocab_parallel_token_stats(logits, targets, zr.double(), backend="torch", **options)
    sum(w * getattr(stats, f) for w, f in zip(weights, ("logprob", "entropy", "kl"))).sum().backward()
    return logits.grad


@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES)
def test_logits_kernel_gradients_match_float64(temperature, kl_temperature):
    z, zr = mixed_logits(torch.float32)
    z[0], zr[0] = z[5], zr[5]  # the +-1e4 row has gradients of 1e4 x rounding: compare the others
    targets = spread_targets()
    weights = torch.randn(3, TOKENS, generator=torch.Generator().manual_seed(3))
    options = dict(vocab_size=VOCAB, temperature=temperature, kl_temperature=kl_temperature)
    expected = _float64_logit_gradients(z, zr, targets, weights, **options)
    logits, device_targets, device_zr, device_weights = _on_device(z, targets, zr, weights)
    logits.requires_grad_()
    stats = vocab_parallel_token_stats(logits, device_targets, device_zr, backend="triton", **options)
    (
        device_weights[0] * stats.logprob + device_weights[1] * stats.entropy + device_weights[2] * stats.kl
    ).sum().backward()
    finite = expected.isfinite()
    torch.testing.assert_close(logits.grad.cpu().double()[finite], expected[finite], rtol=1e-5, atol=1e-6)
    assert logits.grad[:, VOCAB:].abs().max() == 0


def _fused_inputs(seed=6):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)
    ref_weight = weight + 0.3 * torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)
    ref_hidden = hidden + 0.1 * torch.randn(TOKENS, HIDDEN, generator=gen)
    return hidden, weight, ref_hidden, ref_weight, torch.randn(3, TOKENS, generator=gen)


def _fused_loss(hidden, weight, ref_hidden, ref_weight, weights, backend, **options):
    stats = fused_token_stats(
        hidden, weight, spread_targets().to(hidden.device), ref_hidden, ref_weight, backend=backend, **options
    )
    loss = (weights[0] * stats.logprob + weights[1] * stats.entropy + weights[2] * stats.kl).sum()
    return stats, loss


@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES)
def test_fused_kernel_values_and_cached_gradients_match_float64(temperature, kl_temperature):
    hidden, weight, ref_hidden, ref_weight, weights = _fused_inputs()
    options = dict(vocab_size=VOCAB, chunk_size=8, temperature=temperature, kl_temperature=kl_temperature)
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    expected, loss = _fused_loss(
        h64, w64, ref_hidden.double(), ref_weight.double(), weights.double(), "torch", **options
    )
    loss.backward()
    h, w, rh, rw, device_weights = _on_device(hidden, weight, ref_hidden, ref_weight, weights)
    h.requires_grad_(), w.requires_grad_()
    stats, loss = _fused_loss(h, w, rh, rw, device_weights, "triton", **options)
    for field in FIELDS:
        torch.testing.assert_close(
            getattr(stats, field).cpu().double(), getattr(expected, field).detach(), rtol=2e-6, atol=2e-5, msg=field
        )
    loss.backward()
    # Backward reads float16 probabilities and log-ratios cached by the forward: 1e-4 from exact,
    # where rounding the exact logit gradient to bf16 (the gradient GEMMs' operand) alone gives 1e-3.
    for name, got, want in (("hidden", h.grad, h64.grad), ("weight", w.grad, w64.grad)):
        relative = (got.cpu().double() - want).norm() / want.norm()
        assert relative < 3e-4, (name, relative.item())
    assert w.grad[VOCAB:].abs().max() == 0


def test_no_grad_saves_nothing_and_grad_keeps_the_caches():
    hidden, weight, ref_hidden, ref_weight, _ = _fused_inputs()
    h, w, rh, rw = _on_device(hidden, weight, ref_hidden, ref_weight)
    targets = spread_targets().to(DEVICE)
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append((t.numel(), t.dtype)) or t, lambda t: t):
        with torch.no_grad():
            fused_token_stats(h, w.requires_grad_(), targets, rh, rw, backend="triton")
        assert sizes == []
        fused_token_stats(h, w, targets, rh, rw, vocab_size=VOCAB, backend="triton")
    caches = [dtype for numel, dtype in sizes if numel == TOKENS * VOCAB]
    assert caches == [torch.float16, torch.float16], sizes  # and no float32 [tokens, vocab]


def test_backend_choice():
    assert kernel_backend(torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="choose one of"):
        kernel_backend(torch.device("cpu"), "cuda")
    with pytest.raises(ValueError, match="float64"):
        vocab_parallel_token_stats(
            torch.zeros(2, 4, dtype=torch.float64, device=DEVICE),
            torch.zeros(2, dtype=torch.long, device=DEVICE),
            backend="triton",
        )
    if not has_cuda():
        os.environ["TRITON_INTERPRET"] = "0"
        try:
            with pytest.raises(ValueError, match="TRITON_INTERPRET"):
                kernel_backend(torch.device("cpu"), "triton")
        finally:
            os.environ["TRITON_INTERPRET"] = "1"


# ------------------------------------------------------------------------------------------------
# tensor parallel over gloo


def _tp_worker(rank, world):
    """This rank's results and gradients on its vocabulary shard, Triton backend."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    z, zr = mixed_logits(torch.bfloat16)
    targets = spread_targets()
    stats = vocab_parallel_token_stats(
        _vocab_shard(z, rank, world, 1),
        targets,
        _vocab_shard(zr, rank, world, 1),
        group=dist.group.WORLD,
        vocab_size=VOCAB,
        temperature=0.7,
        backend="triton",
    )
    hidden, weight, ref_hidden, ref_weight, weights = _fused_inputs()
    h, w = hidden.clone().requires_grad_(), _vocab_shard(weight, rank, world, 0).clone().requires_grad_()
    fused, loss = _fused_loss(
        h,
        w,
        ref_hidden,
        _vocab_shard(ref_weight, rank, world, 0),
        weights,
        "triton",
        group=dist.group.WORLD,
        vocab_size=VOCAB,
        chunk_size=8,
        kl_temperature=1.3,
    )
    loss.backward()
    return {
        "stats": {f: getattr(stats, f) for f in FIELDS},
        "fused": {f: getattr(fused, f).detach() for f in FIELDS},
        "hidden": h.grad,
        "weight": w.grad,
    }


@pytest.mark.skipif(has_cuda(), reason="gloo ranks run the kernels in the interpreter, on CPU tensors")
def test_tp2_over_gloo_matches_float64():
    per_rank = run_distributed(_tp_worker, 2)
    z, zr = mixed_logits(torch.bfloat16)
    expected = reference_stats(z, zr, spread_targets(), VOCAB, temperature=0.7)
    hidden, weight, ref_hidden, ref_weight, weights = _fused_inputs()
    h64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    fused64, loss = _fused_loss(
        h64,
        w64,
        ref_hidden.double(),
        ref_weight.double(),
        weights.double(),
        "torch",
        vocab_size=VOCAB,
        kl_temperature=1.3,
    )
    loss.backward()
    for results in per_rank:
        for field in FIELDS:
            torch.testing.assert_close(results["stats"][field], per_rank[0]["stats"][field], rtol=0, atol=0)
            torch.testing.assert_close(
                results["fused"][field].double(), getattr(fused64, field).detach(), rtol=2e-6, atol=2e-5, msg=field
            )
        finite = expected["kl"].isfinite()
        torch.testing.assert_close(
            results["stats"]["kl"].double()[finite], expected["kl"][finite], rtol=2e-6, atol=2e-5
        )
        assert (results["hidden"].double() - h64.grad).norm() / h64.grad.norm() < 3e-4
    weight_grad = torch.cat([r["weight"] for r in per_rank]).double()
    assert (weight_grad - w64.grad).norm() / w64.grad.norm() < 3e-4


# ------------------------------------------------------------------------------------------------
# the GPU-side scripts, run where there is no GPU


def test_kernels_compile_for_hopper_without_a_gpu():
    """What the interpreter accepts but the compiler would reject fails here (tools/check_triton_kernels.py)."""
    result = subprocess.run(
        [sys.executable, "tools/check_triton_kernels.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "0 failed" in result.stdout.splitlines()[-1]


def _gpu_bench_dry_run(*options):
    return subprocess.run(
        [sys.executable, "benchmarks/bench_token_stats.py", "--gpu", "--dry-run", *options],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.skipif(has_cuda(), reason="the real benchmark runs on the GPU")
def test_gpu_benchmark_dry_run_passes_every_check_and_times_every_case():
    result = _gpu_bench_dry_run()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "ERROR" not in result.stdout and "FAIL" not in result.stdout, result.stdout
    assert "# token-stats GPU bench: PASS: 10/10 checks passed" in result.stdout
    assert result.stdout.count(" ms  peak") == 14  # every case of the four tables
    assert result.stdout.count("-> met") == 2 and result.stdout.count("DRAM read") == 2


@pytest.mark.skipif(has_cuda(), reason="the real benchmark runs on the GPU")
@pytest.mark.parametrize(
    "options,reason",
    [
        (["--target-scale", "0"], "update 24 x 16 x 320: ours (triton), logprob missed its target"),
        (["--budget", "0"], "stats 24 x 320: ours (triton) skipped (time budget)"),
        (["--omit-check", "update each term"], "ours (triton), logprob unchecked (update each term omitted)"),
    ],
    ids=["missed", "skipped", "unchecked"],
)
def test_gpu_benchmark_fails_on_a_missed_skipped_or_unchecked_target(options, reason):
    result = _gpu_bench_dry_run(*options)
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert "# token-stats GPU bench: FAIL" in result.stdout and reason in result.stdout, result.stdout[-3000:]


def test_fused_buffers_have_aligned_rows_for_any_shard_width():
    """Row strides that are multiples of 16 elements let Triton emit vector loads (shard width 250 here)."""
    hidden, weight, ref_hidden, ref_weight, _ = _fused_inputs()
    h, w, rh, rw = _on_device(hidden, weight[:VOCAB], ref_hidden, ref_weight[:VOCAB])
    strides = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: strides.append((t.dtype, t.stride())) or t, lambda t: t):
        fused_token_stats(h, w.requires_grad_(), spread_targets().to(DEVICE), rh, rw, backend="triton")
    caches = [stride for dtype, stride in strides if dtype == torch.float16]
    assert len(caches) == 2 and all(stride[0] % 16 == 0 for stride in caches), strides


def test_cuda_kernel_shapes_are_fixed_by_the_shard_width():
    """No timing-based choice: every rank and run launches the same kernels (bitwise reproducible)."""
    from megatron_zcpo.ops import token_stats_triton

    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    for n_cols in (1000, 18587, 19008, 152064):
        forward = {token_stats_triton._choose("forward", rows, n_cols, cuda) for rows in (1, 300, 4096)}
        backward = {token_stats_triton._choose("backward", rows, n_cols, cuda) for rows in (1, 300, 4096)}
        assert len(forward) == len(backward) == 1
        assert forward.pop().width % backward.pop().block_v == 0
