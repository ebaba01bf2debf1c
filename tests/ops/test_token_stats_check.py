"""The Triton backend's first-use check: silent when the kernels agree, a warning and the torch backend when not.

The check runs on CUDA tensors; here ``token_stats_check.MODE = "always"`` also runs it under Triton's
interpreter on CPU tensors (TRITON_INTERPRET=1, set by tests/conftest.py before triton is first
imported), and wrong kernel results are injected by wrapping the backend's functions.
"""

import warnings

import pytest
import torch
import triton  # noqa: F401 -- the dev extra installs it: a broken install fails here, never skips

from megatron_zcpo.ops import token_stats_check, token_stats_triton
from megatron_zcpo.ops.token_stats import fused_token_stats, vocab_parallel_token_stats
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.utils.devices import has_cuda
from tests.ops.test_token_stats import FIELDS, HIDDEN, PADDED_VOCAB, TOKENS, VOCAB, mixed_logits, spread_targets

DEVICE = torch.device("cuda" if has_cuda() else "cpu")
MISMATCH = token_stats_check.TritonMismatchWarning


@pytest.fixture(autouse=True)
def always_check(monkeypatch):
    monkeypatch.setattr(token_stats_check, "MODE", "always")
    token_stats_check.reset()
    yield
    token_stats_check.reset()


def _logits_inputs():
    z, zr = mixed_logits(torch.bfloat16)
    z[0], zr[0] = z[5], zr[5]  # no +-1e4 row: its gradients are 1e4 x rounding
    return z.to(DEVICE).requires_grad_(), spread_targets().to(DEVICE), zr.to(DEVICE)


def _fused_inputs():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)
    ref_weight = weight + 0.3 * torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)
    return (
        hidden.to(DEVICE).requires_grad_(),
        weight.to(DEVICE).requires_grad_(),
        spread_targets().to(DEVICE),
        hidden.to(DEVICE),
        ref_weight.to(DEVICE),
    )


def _run(kind, backend, same_reference=False):
    """Values and gradients of one call with a gradient (logits: bf16 with the reference; fused: fp32 with it);
    ``same_reference``: the reference equals the policy (step 0: KL exactly 0)."""
    if kind == "logits":
        z, targets, zr = _logits_inputs()
        zr = z.detach().clone() if same_reference else zr
        stats = vocab_parallel_token_stats(z, targets, zr, vocab_size=VOCAB, temperature=0.7, backend=backend)
        leaves = (z,)
    else:
        hidden, weight, targets, ref_hidden, ref_weight = _fused_inputs()
        ref_weight = weight.detach().clone() if same_reference else ref_weight
        stats = fused_token_stats(
            hidden, weight, targets, ref_hidden, ref_weight, vocab_size=VOCAB, chunk_size=8, backend=backend
        )
        leaves = (hidden, weight)
    (stats.logprob - 0.5 * stats.entropy + 0.25 * stats.kl).sum().backward()
    return {f: getattr(stats, f).detach().cpu() for f in FIELDS}, [leaf.grad.cpu() for leaf in leaves]


def _assert_same(first, second):
    for field in FIELDS:
        assert torch.equal(first[0][field], second[0][field]), field
    for got, want in zip(first[1], second[1]):
        assert torch.equal(got, want)


def test_agreeing_kernels_are_checked_once_per_kind_of_call(recwarn):
    _run("logits", "triton")
    _run("logits", "triton")
    assert token_stats_check.status() == {"checked": 1, "pending": 0, "fallback": None}
    with torch.no_grad():  # another kind: no gradient
        vocab_parallel_token_stats(*_logits_inputs(), vocab_size=VOCAB, backend="triton")
    _run("fused", "triton")
    assert token_stats_check.status() == {"checked": 3, "pending": 0, "fallback": None}
    assert not [w for w in recwarn if issubclass(w.category, MISMATCH)]


def _wrong_shard_statistics(row, scale, offset):
    """token_stats_triton.merge_shards with the kernels' statistics row ``row`` of the last token changed
    to ``value * scale + offset`` (a kernel bug in a row past the first chunk of a fused call)."""
    merge = token_stats_triton.merge_shards

    def wrapped(stats, tiling):
        stats = stats.clone()
        stats[row, -1] = stats[row, -1] * scale + offset
        return merge(stats, tiling)

    return wrapped


@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_wrong_values_warn_once_and_fall_back_to_torch(kind, monkeypatch):
    monkeypatch.setattr(token_stats_triton, "merge_shards", _wrong_shard_statistics(3, 1.0, 1e-3))  # target logit
    with pytest.warns(MISMATCH, match=r"logprob: triton .* train\.token_stats_backend=torch"):
        checked = _run(kind, "triton")
    _assert_same(checked, _run(kind, "torch"))  # the failed call itself was recomputed
    assert token_stats_check.torch_instead()

    def no_triton(*args, **kwargs):
        raise AssertionError("the Triton backend ran after the fallback")

    for name in ("logits_forward", "fused_forward", "logits_backward"):
        monkeypatch.setattr(token_stats_triton, name, no_triton)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        _run("fused" if kind == "logits" else "logits", "triton")  # another kind, after the fallback
    assert not [w for w in later if issubclass(w.category, MISMATCH)]  # warned once


@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_a_wrong_gradient_is_caught(kind, monkeypatch):
    backward = token_stats_triton._backward

    def five_percent_off(out, *args, **kwargs):  # bf16 logit gradients are allowed two units: 1.6%
        backward(out, *args, **kwargs)
        out.mul_(1.05)

    monkeypatch.setattr(token_stats_triton, "_backward", five_percent_off)
    with pytest.warns(MISMATCH, match="logit gradient"):
        checked = _run(kind, "triton")
    _assert_same(checked, _run(kind, "torch"))


@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_a_wrong_value_in_a_later_row_is_caught(kind, monkeypatch):
    monkeypatch.setattr(token_stats_triton, "merge_shards", _wrong_shard_statistics(8, 1.01, 0.0))  # the KL
    with pytest.warns(MISMATCH, match=r"kl: triton"):
        checked = _run(kind, "triton")
    _assert_same(checked, _run(kind, "torch"))


@pytest.mark.parametrize("factor", [0.0, 3.0, -1.0], ids=["dropped", "tripled", "sign-flipped"])
@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_a_wrong_kl_gradient_is_caught_once_the_kl_is_not_zero(kind, factor, monkeypatch, recwarn):
    from tests.ops.test_token_stats_terms import _scaled_kl_gradient

    monkeypatch.setattr(token_stats_triton, "_backward", _scaled_kl_gradient(factor))
    _run(kind, "triton", same_reference=True)  # step 0: KL = 0, its gradient 0 whatever the factor
    _run(kind, "triton", same_reference=True)
    assert token_stats_check.status() == {"checked": 0, "pending": 1, "fallback": None}
    assert not [w for w in recwarn if issubclass(w.category, MISMATCH)]
    with pytest.warns(MISMATCH, match="kl logit gradient"):
        checked = _run(kind, "triton")  # the first call whose KL reaches KL_CHECK_MIN
    _assert_same(checked, _run(kind, "torch"))


@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_an_exception_falls_back_to_torch(kind, monkeypatch):
    def compile_failure(*args, **kwargs):
        raise RuntimeError("PassManager::run failed")

    name = "logits_forward" if kind == "logits" else "fused_forward"
    monkeypatch.setattr(token_stats_triton, name, compile_failure)
    with pytest.warns(MISMATCH, match="PassManager"):
        checked = _run(kind, "triton")
    _assert_same(checked, _run(kind, "torch"))
    assert token_stats_check.status()["fallback"] is not None


@pytest.mark.parametrize("kind", ["logits", "fused"])
def test_an_exception_in_the_backward_falls_back_to_torch(kind, monkeypatch):
    _run(kind, "triton")  # checked

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")

    name = "logits_backward" if kind == "logits" else "cached_logit_gradient"
    monkeypatch.setattr(token_stats_triton, name, out_of_memory)
    with pytest.warns(MISMATCH, match=f"{kind} backward"):
        checked = _run(kind, "triton")
    # the forward was Triton's, the backward the torch backend's over its saved numbers
    for got, want in zip(checked[1], _run(kind, "torch")[1]):
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-5, atol=1e-6)
    assert token_stats_check.torch_instead()


def _tp_worker(rank, world, failure):
    """Rank 1 alone computes wrong logit gradients, or raises in its Triton forward: both ranks must fall back
    together (and not hang in the forward's all-gather)."""
    import torch.distributed as dist

    from tests.ops.test_token_stats import _vocab_shard

    dist.init_process_group("gloo")
    token_stats_check.MODE = "always"
    if rank == 1 and failure == "gradient":
        backward = token_stats_triton._backward

        def wrong(out, *args, **kwargs):
            backward(out, *args, **kwargs)
            out.mul_(1.5)

        token_stats_triton._backward = wrong
    if rank == 1 and failure == "exception":

        def out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB")

        token_stats_triton.logits_forward = out_of_memory
    z, targets, zr = _logits_inputs()
    shard = _vocab_shard(z.detach(), rank, world, 1).requires_grad_()
    stats = vocab_parallel_token_stats(
        shard, targets, _vocab_shard(zr, rank, world, 1), group=dist.group.WORLD, vocab_size=VOCAB, backend="triton"
    )
    (stats.logprob + stats.kl).sum().backward()
    torch_shard = shard.detach().clone().requires_grad_()
    expected = vocab_parallel_token_stats(
        torch_shard,
        targets,
        _vocab_shard(zr, rank, world, 1),
        group=dist.group.WORLD,
        vocab_size=VOCAB,
        backend="torch",
    )
    (expected.logprob + expected.kl).sum().backward()
    return {
        "fallback": token_stats_check.torch_instead(),
        "same_grad": torch.equal(shard.grad, torch_shard.grad),
        "same_kl": torch.equal(stats.kl, expected.kl),
    }


@pytest.mark.skipif(has_cuda(), reason="gloo ranks run the kernels in the interpreter, on CPU tensors")
@pytest.mark.parametrize("failure", ["gradient", "exception"])
def test_tensor_parallel_ranks_fall_back_together(failure):
    # the ranks inherit TRITON_INTERPRET=1 (tests/conftest.py)
    for result in run_distributed(_tp_worker, 2, failure, timeout=300):
        assert result == {"fallback": True, "same_grad": True, "same_kl": True}
