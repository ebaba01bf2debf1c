"""Per-term gradient checks of every Triton path against float64 (policy != reference, KL >= 1e-2), and
the mutations of the KL gradient they must catch. Under Triton's interpreter without a GPU (tests/conftest.py)."""

import pytest
import torch
import triton  # noqa: F401 -- the dev extra installs it: a broken install fails here, never skips

from megatron_zcpo.ops import token_stats_triton
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.token_stats_terms import (
    drifted_layer,
    drifted_logits,
    failures,
    fused_term_errors,
    fused_value_errors,
    logits_term_errors,
)
from megatron_zcpo.utils.devices import has_cuda

DEVICE = torch.device("cuda" if has_cuda() else "cpu")
TOKENS, HIDDEN, VOCAB, PADDED_VOCAB = 23, 16, 250, 256
TEMPERATURES = [(1.0, 1.0), (0.7, 1.0), (1.3, 0.6)]  # the same; cache at T_kl; cache at T


def _logits(dtype=torch.float32):
    return drifted_logits(TOKENS, PADDED_VOCAB, VOCAB, device=DEVICE, dtype=dtype)


def _layer():
    return drifted_layer(TOKENS, HIDDEN, PADDED_VOCAB, VOCAB, device=DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES)
def test_from_logits_each_term(dtype, temperature, kl_temperature):
    errors = logits_term_errors(
        *_logits(dtype), vocab_size=VOCAB, temperature=temperature, kl_temperature=kl_temperature
    )
    assert failures(errors) == [], errors


@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES)
def test_fused_with_gradients_each_term(temperature, kl_temperature):
    errors = fused_term_errors(
        *_layer(), vocab_size=VOCAB, chunk_size=8, temperature=temperature, kl_temperature=kl_temperature
    )
    assert failures(errors) == [], errors


@pytest.mark.parametrize("temperature,kl_temperature", TEMPERATURES[::2])
def test_fused_without_gradients_each_value(temperature, kl_temperature):
    errors = fused_value_errors(
        *_layer(), vocab_size=VOCAB, chunk_size=8, temperature=temperature, kl_temperature=kl_temperature
    )
    assert failures(errors) == [], errors


def _scaled_kl_gradient(factor):
    """token_stats_triton._backward with the KL's part of the logit gradient multiplied by ``factor``."""
    backward = token_stats_triton._backward

    def mutated(out, targets, saved, grads, tiling, **kwargs):
        backward(out, targets, saved, grads, tiling, **kwargs)
        if grads[2] is not None:
            kl_part = torch.empty_like(out)
            backward(kl_part, targets, saved, (None, None, grads[2]), tiling, **kwargs)
            out.add_(kl_part, alpha=factor - 1.0)

    return mutated


@pytest.mark.parametrize("factor", [0.0, 3.0, -1.0], ids=["dropped", "tripled", "sign-flipped"])
def test_a_wrong_kl_gradient_fails_the_checks(factor, monkeypatch):
    monkeypatch.setattr(token_stats_triton, "_backward", _scaled_kl_gradient(factor))
    bad = failures(logits_term_errors(*_logits(), vocab_size=VOCAB, temperature=0.7))
    assert [line.split()[0] for line in bad] == ["kl"], bad
    bad = failures(fused_term_errors(*_layer(), vocab_size=VOCAB, chunk_size=8, temperature=0.7))
    assert [" ".join(line.split()[:2]) for line in bad] == ["kl hidden", "kl weight"], bad


def test_inputs_without_drift_are_refused():
    z, _, targets = _logits()
    assert any("min KL" in line for line in failures(logits_term_errors(z, z, targets, vocab_size=VOCAB)))


def _tp_worker(rank, world):
    """Each term on this rank's vocabulary shard, from logits and fused (with and without gradients)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    local = PADDED_VOCAB // world
    columns = slice(rank * local, (rank + 1) * local)
    z, zr, targets = _logits(torch.bfloat16)
    options = dict(group=dist.group.WORLD, vocab_size=VOCAB, temperature=0.7)
    logits = logits_term_errors(z[:, columns], zr[:, columns], targets, **options)
    hidden, weight, ref_hidden, ref_weight, targets = _layer()
    layer = (hidden, weight[columns], ref_hidden, ref_weight[columns], targets)
    fused = fused_term_errors(*layer, chunk_size=8, kl_temperature=1.3, **options)
    values = fused_value_errors(*layer, chunk_size=8, **options)
    return failures(logits) + failures(fused) + failures(values)


@pytest.mark.skipif(has_cuda(), reason="gloo ranks run the kernels in the interpreter, on CPU tensors")
def test_tp2_each_term():
    assert run_distributed(_tp_worker, 2) == [[], []]
