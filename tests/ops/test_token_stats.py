"""Vocab-parallel token statistics: float64 references, exact-KL accuracy, autograd, TP=1/2/4 over gloo."""

import functools
import math

import pytest
import torch

from megatron_zcpo.ops.token_stats import MASKED_LOGIT, fused_token_stats, vocab_parallel_token_stats
from megatron_zcpo.testing import run_distributed

FIELDS = ("logprob", "entropy", "ref_logprob", "kl")
VOCAB, PADDED_VOCAB = 250, 256  # 256 splits into 1, 2 or 4 shards; the last 6 columns are padding
TOKENS, HIDDEN = 23, 16  # 23 tokens walk chunks of 4 unevenly
TILE = 7  # vocabulary columns per tile where a test walks several tiles (uneven in every shard)
QWEN_VOCAB = 152064


# ------------------------------------------------------------------------------------------------
# inputs and float64 references


def mixed_logits(dtype=torch.float32, seed=0):
    """[TOKENS, PADDED_VOCAB] policy / reference logits with every hard case in some row.

    row 0: +-1e4 logits (the first tiles hold policy mass but e^-20000 of the reference's); row 1: -inf masks shared by both models; row 2: identical rows; row 3: the
    policy masks tokens the reference keeps; padding columns hold garbage that must not count.
    """
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(TOKENS, PADDED_VOCAB, generator=gen) * 3
    zr = z + 0.3 * torch.randn(TOKENS, PADDED_VOCAB, generator=gen)
    z[0] = torch.where(torch.rand(PADDED_VOCAB, generator=gen) < 0.5, 1e4, -1e4)
    zr[0] = torch.where(torch.rand(PADDED_VOCAB, generator=gen) < 0.5, 1e4, -1e4)
    z[0, :TILE], zr[0, : 2 * TILE] = 1e4, -1e4  # reference mass e^-2e4 in two tiles: underflows, not zero
    shared_mask = torch.rand(PADDED_VOCAB, generator=gen) < 0.6
    z[1, shared_mask], zr[1, shared_mask] = -math.inf, -math.inf
    zr[2] = z[2]
    z[3, ::3] = -math.inf
    z[:, VOCAB:], zr[:, VOCAB:] = 50.0, -50.0
    return z.to(dtype), zr.to(dtype)


def spread_targets():
    """Targets landing in every shard at TP=4, including the last valid id; row 3 on a kept token."""
    targets = (torch.arange(TOKENS) * 37) % VOCAB
    targets[4] = VOCAB - 1
    targets[3] = 1
    return targets


def reference_stats(z, zr, targets, vocab_size, temperature=1.0, kl_temperature=1.0):
    """float64 logprob, entropy, ref logprob and KL from the same (upcast) logits, straightforwardly."""
    z, zr = (x.double()[..., :vocab_size] for x in (z, zr))

    def log_softmax(x, t):
        return (x.masked_fill(x <= MASKED_LOGIT, -math.inf) / t).log_softmax(-1)

    lp, lq = log_softmax(z, temperature), log_softmax(zr, temperature)
    p = lp.exp()
    index = targets.unsqueeze(-1)
    entropy = -torch.where(p > 0, p * lp, 0).sum(-1)
    lpk, lqk = log_softmax(z, kl_temperature), log_softmax(zr, kl_temperature)
    pk = lpk.exp()
    kl = torch.where(pk > 0, pk * (lpk - lqk), 0).sum(-1)
    return {
        "logprob": lp.gather(-1, index).squeeze(-1),
        "entropy": entropy,
        "ref_logprob": lq.gather(-1, index).squeeze(-1),
        "kl": kl,
    }


def qwen_vocab_levels():
    """Policy logits [3, QWEN_VOCAB] and references at KL from ~1e-2 down to ~1e-9, two families.

    noise: independent perturbations; offset: every token but the argmax shifted by eps (KL is
    ~p_max eps^2 / 2 there, so a formula that subtracts O(eps^2) terms would cancel badly).
    """
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(3, QWEN_VOCAB, generator=gen) * 2
    noise = torch.randn(3, QWEN_VOCAB, generator=gen)
    levels = [("noise", eps, z + eps * noise) for eps in (1e-1, 1e-2, 1e-3, 1e-4, 3e-5)]
    top = z.argmax(-1, keepdim=True)
    for eps in (1e0, 1e-1, 1e-2, 1.5e-3):
        shifted = z + eps
        levels.append(("offset", eps, shifted.scatter(-1, top, z.gather(-1, top))))
    return z, levels


# ------------------------------------------------------------------------------------------------
# one process, the whole vocabulary local


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature,kl_temperature", [(1.0, 1.0), (0.7, 1.0), (1.3, 0.6)])
@pytest.mark.parametrize("tile", [None, TILE], ids=["whole-rows", "tiles"])
def test_matches_float64_reference(dtype, temperature, kl_temperature, tile):
    z, zr = mixed_logits(dtype)
    targets = spread_targets()
    stats = vocab_parallel_token_stats(
        z,
        targets,
        zr,
        vocab_size=VOCAB,
        chunk_size=4,
        vocab_chunk_size=tile,
        temperature=temperature,
        kl_temperature=kl_temperature,
    )
    expected = reference_stats(z, zr, targets, VOCAB, temperature, kl_temperature)
    for field in FIELDS:
        value = getattr(stats, field)
        assert value.dtype == torch.float32 and value.shape == targets.shape, field
        finite = expected[field].isfinite()
        torch.testing.assert_close(value.double()[finite], expected[field][finite], rtol=2e-6, atol=2e-5, msg=field)
    assert stats.kl[2] == 0  # identical rows
    assert (stats.kl >= 0).all()


def test_identical_distributions_give_exactly_zero_kl():
    for dtype in (torch.float32, torch.bfloat16):
        z, _ = mixed_logits(dtype)
        for temperature, kl_temperature in ((1.0, 1.0), (0.7, 1.3)):
            stats = vocab_parallel_token_stats(
                z,
                spread_targets(),
                z.clone(),
                vocab_size=VOCAB,
                chunk_size=4,
                vocab_chunk_size=TILE,
                temperature=temperature,
                kl_temperature=kl_temperature,
            )
            assert torch.equal(stats.kl, torch.zeros_like(stats.kl)), (dtype, temperature)
            assert torch.equal(stats.logprob, stats.ref_logprob)


def test_disjoint_distributions():
    gen = torch.Generator().manual_seed(2)
    policy_support = torch.rand(4, 64, generator=gen) < 0.5
    z = torch.where(policy_support, 1e4, -1e4)
    zr = torch.where(policy_support, -1e4, 1e4)  # the reference puts its mass exactly elsewhere
    targets = torch.zeros(4, dtype=torch.long)
    stats = vocab_parallel_token_stats(z, targets, zr, vocab_chunk_size=TILE)
    expected = reference_stats(z, zr, targets, 64)["kl"]
    assert (expected > 1.9e4).all()
    torch.testing.assert_close(stats.kl.double(), expected, rtol=1e-6, atol=0)
    # Supports disjoint by masks: the KL is infinite; we report at least 1e30 x the stranded mass.
    for tile in (None, TILE):
        masked = vocab_parallel_token_stats(
            z.masked_fill(~policy_support, -math.inf),
            targets,
            zr.masked_fill(policy_support, -math.inf),
            vocab_chunk_size=tile,
        )
        assert (masked.kl > 1e29).all() and not masked.kl.isnan().any()


def test_kl_relative_accuracy_on_qwen_vocabulary_and_naive_log_softmax_is_far_off():
    z, levels = qwen_vocab_levels()
    targets = torch.tensor([0, 70000, QWEN_VOCAB - 1])
    report = []
    for family, eps, zr in levels:
        stats = vocab_parallel_token_stats(z, targets, zr)
        expected = reference_stats(z, zr, targets, QWEN_VOCAB)["kl"]
        ours = ((stats.kl.double() - expected) / expected).abs().max().item()
        naive_kl = (z.softmax(-1) * (z.log_softmax(-1) - zr.log_softmax(-1))).sum(-1).double()
        naive = ((naive_kl - expected) / expected).abs().max().item()
        report.append((family, eps, expected.min().item(), ours, naive))
        assert (stats.kl >= 0).all(), (family, eps)
        assert ours <= 1e-4, (family, eps, expected.tolist(), stats.kl.tolist())
    print("\nfamily eps min-KL rel-err-ours rel-err-naive-fp32")
    for row in report:
        family, eps, kl, ours, naive = row
        print(f"{family:<6s} {eps:.0e} {kl:.2e} {ours:.1e} {naive:.1e}")
    assert min(row[2] for row in report) < 1e-8  # the levels reach below 1e-8
    tiny = [row for row in report if row[2] < 1e-6]
    assert all(row[4] > 1e-2 and row[4] > 100 * row[3] for row in tiny)


def test_float64_gradcheck_logits():
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    zr = z + 0.5 * torch.randn(5, 12, generator=gen, dtype=torch.float64)
    z[1, :4] = -math.inf
    zr[1, :4] = -math.inf
    z[2, 5] = 40.0  # some terms beyond the series radius, some inside
    targets = torch.tensor([0, 5, 9, 3, 7])

    def outputs(logits):
        stats = vocab_parallel_token_stats(
            logits, targets, zr, vocab_size=10, chunk_size=2, vocab_chunk_size=3, temperature=0.8, kl_temperature=1.2
        )
        return stats.logprob, stats.entropy, stats.kl

    assert torch.autograd.gradcheck(outputs, (z.requires_grad_(),))


def test_float64_gradcheck_fused():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    ref_hidden = hidden + 0.3 * torch.randn(6, 5, generator=gen, dtype=torch.float64)
    ref_weight = weight + 0.3 * torch.randn(12, 5, generator=gen, dtype=torch.float64)
    targets = torch.tensor([0, 1, 9, 3, 7, 2])

    def outputs(h, w):
        stats = fused_token_stats(
            h, w, targets, ref_hidden, ref_weight, vocab_size=10, chunk_size=4, vocab_chunk_size=3, temperature=1.1
        )
        return stats.logprob, stats.entropy, stats.kl

    assert torch.autograd.gradcheck(outputs, (hidden.requires_grad_(), weight.requires_grad_()))


def test_fused_equals_logits_path_without_bf16_rounding():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen).to(torch.bfloat16)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen).to(torch.bfloat16)
    ref_weight = (weight.float() + 0.05 * torch.randn(PADDED_VOCAB, HIDDEN, generator=gen)).to(torch.bfloat16)
    targets = spread_targets()
    fused = fused_token_stats(
        hidden, weight, targets, hidden, ref_weight, vocab_size=VOCAB, chunk_size=4, vocab_chunk_size=TILE
    )
    # The fp32 logits of the bf16 operands; rounding them to bf16 (what a bf16 output layer emits) differs.
    logits, ref_logits = hidden.float() @ weight.float().T, hidden.float() @ ref_weight.float().T
    exact = vocab_parallel_token_stats(logits, targets, ref_logits, vocab_size=VOCAB)
    rounded = vocab_parallel_token_stats(logits.bfloat16(), targets, ref_logits.bfloat16(), vocab_size=VOCAB)
    for field in FIELDS:
        torch.testing.assert_close(getattr(fused, field), getattr(exact, field), rtol=1e-6, atol=1e-6, msg=field)
    assert ((rounded.kl - exact.kl).abs() / exact.kl).max() > 1e-3


def _saved_tensor_sizes(fn):
    sizes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: sizes.append(t.numel()) or t, lambda t: t):
        fn()
    return sizes


def test_no_grad_path_saves_nothing_and_grad_path_saves_only_inputs_and_per_token_numbers():
    z, zr = mixed_logits()
    targets = spread_targets()
    hidden = torch.randn(TOKENS, HIDDEN)
    weight = torch.randn(PADDED_VOCAB, HIDDEN)
    with torch.no_grad():
        stats = vocab_parallel_token_stats(z.requires_grad_(), targets, zr)
    assert stats.kl.grad_fn is None and stats.logprob.grad_fn is None
    assert _saved_tensor_sizes(lambda: vocab_parallel_token_stats(z.detach(), targets, zr)) == []
    with torch.no_grad():
        assert (
            _saved_tensor_sizes(lambda: fused_token_stats(hidden, weight.requires_grad_(), targets, hidden, weight))
            == []
        )
    sizes = _saved_tensor_sizes(lambda: fused_token_stats(hidden, weight, targets, hidden, weight, chunk_size=4))
    inputs = {hidden.numel(), weight.numel(), targets.numel()}
    assert all(size in inputs or size <= 7 * TOKENS for size in sizes), sizes


def _largest_allocation(fn):
    """Bytes of the largest single CPU allocation any op makes while ``fn`` runs."""
    with torch.profiler.profile(profile_memory=True) as prof:
        fn()
    return max(event.cpu_memory_usage for event in prof.events())


def test_fused_forward_and_backward_allocate_a_tile_never_the_logits():
    tokens, vocab, rows, columns = 512, 2048, 32, 512
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(tokens, 8, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)

    def update_pass():
        stats = fused_token_stats(
            hidden, weight, targets, hidden.detach(), weight.detach(), chunk_size=rows, vocab_chunk_size=columns
        )
        (stats.logprob + stats.entropy + stats.kl).sum().backward()

    logits_bytes = tokens * vocab * 4
    assert _largest_allocation(lambda: (hidden @ weight.T).sum().backward()) >= logits_bytes  # the probe sees it
    assert _largest_allocation(update_pass) <= 6 * rows * columns * 4 < logits_bytes / 4


def test_rejects_bad_input():
    z, zr = mixed_logits()
    targets = spread_targets()
    bad = targets.clone()
    bad[5] = VOCAB
    with pytest.raises(ValueError, match=r"targets\[5\].*= 250"):
        vocab_parallel_token_stats(z, bad, zr, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="ref_logits"):
        vocab_parallel_token_stats(z, targets, zr[:, :10])
    with pytest.raises(ValueError, match="vocab_size=300"):
        vocab_parallel_token_stats(z, targets, vocab_size=300)
    with pytest.raises(ValueError, match="kl_temperature"):
        vocab_parallel_token_stats(z, targets, zr, kl_temperature=0.0)
    with pytest.raises(ValueError, match="ref_hidden and ref_weight"):
        fused_token_stats(torch.randn(TOKENS, HIDDEN), torch.randn(8, HIDDEN), targets % 8, torch.randn(TOKENS, HIDDEN))


# ------------------------------------------------------------------------------------------------
# tensor parallel over gloo


def _vocab_shard(x, rank, world, dim):
    local = x.shape[dim] // world
    return x.narrow(dim, rank * local, local)


def _float64_gradients(group, rank, world):
    """Gradients of sum(a logprob + b entropy + c kl) w.r.t. the logits shard and the fused inputs."""
    gen = torch.Generator().manual_seed(9)
    z, zr = (x.double() for x in mixed_logits())
    a, b, c = torch.randn(3, TOKENS, generator=gen, dtype=torch.float64)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    ref_weight = weight + 0.2 * torch.randn(PADDED_VOCAB, HIDDEN, generator=gen, dtype=torch.float64)
    targets = spread_targets()

    def loss(stats):
        return (a * stats.logprob + b * stats.entropy + c * stats.kl).sum()

    logits = _vocab_shard(z, rank, world, 1).clone().requires_grad_()
    loss(
        vocab_parallel_token_stats(
            logits,
            targets,
            _vocab_shard(zr, rank, world, 1),
            group=group,
            vocab_size=VOCAB,
            chunk_size=4,
            vocab_chunk_size=TILE,
            temperature=0.9,
        )
    ).backward()
    h = hidden.clone().requires_grad_()
    w = _vocab_shard(weight, rank, world, 0).clone().requires_grad_()
    loss(
        fused_token_stats(
            h,
            w,
            targets,
            hidden,
            _vocab_shard(ref_weight, rank, world, 0),
            group=group,
            vocab_size=VOCAB,
            chunk_size=4,
            vocab_chunk_size=TILE,
            kl_temperature=1.3,
        )
    ).backward()
    return {"logits": logits.grad, "hidden": h.grad, "weight": w.grad}


def _tp_worker(rank, world, use_megatron):
    """Every TP check on this rank; returns per-rank results for the parent to compare."""
    import torch.distributed as dist

    if use_megatron:
        from megatron.core import parallel_state

        from megatron_zcpo.megatron.initialize import setup_megatron

        setup_megatron(tensor_parallel=world)
        group = parallel_state.get_tensor_model_parallel_group()
    else:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
    results = {}
    targets = spread_targets()
    for dtype in (torch.float32, torch.bfloat16):
        z, zr = mixed_logits(dtype)
        for name, ref in (("mixed", zr), ("identical", z)):
            stats = vocab_parallel_token_stats(
                _vocab_shard(z, rank, world, 1),
                targets,
                _vocab_shard(ref, rank, world, 1),
                group=group,
                vocab_size=VOCAB,
                chunk_size=4,
                vocab_chunk_size=TILE,
                temperature=0.7,
            )
            results[name, str(dtype)] = {f: getattr(stats, f) for f in FIELDS}
    z, levels = qwen_vocab_levels()
    qwen_targets = torch.tensor([0, 70000, QWEN_VOCAB - 1])
    results["qwen"] = [
        vocab_parallel_token_stats(
            _vocab_shard(z, rank, world, 1), qwen_targets, _vocab_shard(zr, rank, world, 1), group=group
        ).kl
        for _, _, zr in levels
    ]
    results["grads"] = _float64_gradients(group, rank, world)
    if world == 4:  # two TP groups of 2 inside a world of 4: the group's rank, not the global one, counts
        sub_group, _ = dist.new_subgroups(group_size=2)
        results["subgroup_grads"] = _float64_gradients(sub_group, dist.get_rank(sub_group), 2)
    return results


@pytest.fixture(scope="module")
def single_rank():
    return run_distributed(_tp_worker, 1, False)[0]


@functools.cache
def _tp_references():
    """float64 references for what _tp_worker computes (shared by every rank's check)."""
    mixed = {}
    for dtype in (torch.float32, torch.bfloat16):
        z, zr = mixed_logits(dtype)
        for name, ref in (("mixed", zr), ("identical", z)):
            mixed[name, str(dtype)] = reference_stats(z, ref, spread_targets(), VOCAB, temperature=0.7)
    z, levels = qwen_vocab_levels()
    qwen_targets = torch.tensor([0, 70000, QWEN_VOCAB - 1])
    qwen = [(family, eps, reference_stats(z, zr, qwen_targets, QWEN_VOCAB)["kl"]) for family, eps, zr in levels]
    return mixed, qwen


def _check_against_reference(results):
    mixed, qwen = _tp_references()
    for dtype in (torch.float32, torch.bfloat16):
        for name in ("mixed", "identical"):
            expected = mixed[name, str(dtype)]
            for field in FIELDS:
                value = results[name, str(dtype)][field].double()
                finite = expected[field].isfinite()
                torch.testing.assert_close(
                    value[finite], expected[field][finite], rtol=2e-6, atol=2e-5, msg=f"{name} {dtype} {field}"
                )
            kl = results[name, str(dtype)]["kl"]
            assert (kl >= 0).all()
            if name == "identical":
                assert torch.equal(kl, torch.zeros_like(kl))
    for (family, eps, expected), kl in zip(qwen, results["qwen"]):
        assert (kl >= 0).all()
        assert ((kl.double() - expected) / expected).abs().max() <= 1e-4, (family, eps)


def _assert_same_gradients(per_rank, single, world):
    logits = torch.cat([r["logits"] for r in per_rank], dim=1)
    weight = torch.cat([r["weight"] for r in per_rank], dim=0)
    torch.testing.assert_close(logits, single["logits"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weight, single["weight"], rtol=1e-10, atol=1e-12)
    for rank, r in enumerate(per_rank):
        torch.testing.assert_close(r["hidden"], single["hidden"], rtol=1e-10, atol=1e-12, msg=f"rank {rank} of {world}")
    assert single["logits"][:, VOCAB:].abs().max() == 0 and single["weight"][VOCAB:].abs().max() == 0
    assert single["logits"].abs().max() > 1e-3 and single["hidden"].abs().max() > 1e-3


def test_tp1_over_gloo_matches_float64_reference(single_rank):
    _check_against_reference(single_rank)


@pytest.mark.parametrize("world,use_megatron", [(2, True), (4, False)], ids=["TP2-megatron-group", "TP4"])
def test_tensor_parallel_matches_reference_and_tp1_gradients(single_rank, world, use_megatron):
    per_rank = run_distributed(_tp_worker, world, use_megatron)
    for results in per_rank:
        _check_against_reference(results)
        for key in results:
            if key not in ("grads", "subgroup_grads", "qwen"):
                for field in FIELDS:  # every rank returns the same per-token numbers
                    torch.testing.assert_close(results[key][field], per_rank[0][key][field], rtol=0, atol=0)
    _assert_same_gradients([r["grads"] for r in per_rank], single_rank["grads"], world)
    if world == 4:
        for pair in ((0, 1), (2, 3)):
            _assert_same_gradients([per_rank[r]["subgroup_grads"] for r in pair], single_rank["grads"], 2)
