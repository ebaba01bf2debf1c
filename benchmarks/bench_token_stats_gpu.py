"""GPU benchmark of the token statistics (``bench_token_stats.py --gpu``): one CUDA device, TP=1, <= 5 minutes.

Checks first, then times, then asserts the targets. The checks compare every Triton path with float64
*term by term* (log-prob, entropy and KL gradients separately, policy != reference with KL >= 1e-2:
``megatron_zcpo.testing.token_stats_terms``) and the statistics with the torch backend; then each case
is timed with CUDA events beside the peer and the previous implementation:

  stats 4096 x 152,064 and 4096 x 19,008 (a TP=8 shard), bf16 logits of policy and reference:
    ours (triton)        logprob, entropy, ref logprob, exact KL: one kernel        target <= 1.5 ms
    ours (torch)         the same op on its torch backend (the previous implementation)
    peer                 Megatron's vocab_parallel_cross_entropy + an entropy pass (no reference, no KL);
                         plain-torch cross-entropy + entropy when megatron-core is not installed
  experience 4096 x 5120 x 152,064: fused forward of policy and reference (2 GEMMs), no gradient
  update 4096 x 5120 x 152,064: forward + backward with the output-layer GEMMs
    ours (triton)        fused_token_stats(...).logprob backward: 3 GEMMs, logits never whole
                         (ZCPO's update: log-probs only)                            target <= 31 ms
    ours (triton) + KL   with the reference and the KL's gradient (kl_loss=full; 4 GEMMs)
    ours (torch)         the previous implementation (fp32 logits recomputed tile by tile)
    peer                 bf16 output layer + Megatron's (or plain torch) cross-entropy
    GEMMs alone          the three bf16 GEMMs of an output layer's forward and backward
  ``--compiled``: the statistics as plain functional torch under torch.compile (not in the 5 minutes)

Targets are an H200's (4.8 TB/s), scaled by HBM bandwidth on other GPUs (an H100 SXM: x 4.8 / 3.35).
Exit status 1 when a check fails, a Triton case raises, a target is missed, or a target case is
skipped (``--budget``) or unchecked (a check it depends on did not pass). Each target case prints the
DRAM bytes it read (CUPTI's dram__bytes_read.sum through torch.profiler where the driver allows it,
else the bytes it must read) against one read of its inputs. ``--dry-run`` runs every line on the CPU
at toy sizes (Triton's interpreter) with generous targets, to test this script where there is no GPU.
Columns: ms per call, peak memory above the inputs, the fraction of the HBM roofline (the bytes the
case must read / time) and of the dense bf16 roofline (GEMM FLOPs / time, 790 TFLOP/s), the time
relative to the peer.
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
from bench_gpu_harness import Bench, target_scale

COMPILED_CHUNK = 512
DEVICE = torch.device("cuda")  # run(dry_run=True): the CPU
# Targets on an H200 at 4096 tokens x 152,064 (x 5120 hidden), bf16, in ms (scaled on other GPUs).
STATS_TARGET_MS, UPDATE_TARGET_MS = 1.5, 31.0
DRY_RUN_TARGET_MS = 120_000.0  # toy sizes in the interpreter: the dry run tests the logic, not the speed
TERM_ROWS = 64  # rows of the per-term checks against float64 (float64 logits of 152,064 columns each)


# ------------------------------------------------------------------------------------------------
# the peer and the compiled functional version


def _peer_cross_entropy():
    """(name, cross_entropy(logits, targets) -> per-token loss): Megatron's, or plain torch's."""
    try:
        if DEVICE.type != "cuda":
            raise RuntimeError("dry run on the CPU")
        import torch.distributed as dist
        from megatron.core import parallel_state, tensor_parallel

        if not dist.is_initialized():
            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1)
        return "megatron CE", tensor_parallel.vocab_parallel_cross_entropy
    except Exception as error:  # megatron-core is not on every GPU image
        print(f"# peer: megatron-core unavailable ({type(error).__name__}: {error}); plain torch cross-entropy instead")
        return "torch CE", lambda logits, targets: F.cross_entropy(logits.float(), targets, reduction="none")


def peer_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy as a separate pass over the logits, the way verl / slime compute it."""
    logits = logits.float()
    top = logits.amax(-1, keepdim=True)
    exp_logits = (logits - top).exp()
    total = exp_logits.sum(-1, keepdim=True)
    return (top + total.log() - ((exp_logits / total) * logits).sum(-1, keepdim=True)).squeeze(-1)


def functional_stats(logits, ref_logits, targets):
    """logprob, entropy, ref logprob, KL of bf16 logit rows: plain torch, fp32 math (torch.compile fodder)."""
    z, zr = logits.float(), ref_logits.float()
    log_p = z - torch.logsumexp(z, -1, keepdim=True)
    log_q = zr - torch.logsumexp(zr, -1, keepdim=True)
    p = log_p.exp()
    index = targets.unsqueeze(-1)
    return (
        log_p.gather(-1, index).squeeze(-1),
        -(p * log_p).sum(-1),
        log_q.gather(-1, index).squeeze(-1),
        (p * (log_p - log_q)).sum(-1),
    )


def functional_logprob(logits, targets):
    z = logits.float()
    return (z - torch.logsumexp(z, -1, keepdim=True)).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def chunked(fn, *tensors):
    """fn over 512-row chunks of every tensor, outputs concatenated."""
    parts = [fn(*(t[i : i + COMPILED_CHUNK] for t in tensors)) for i in range(0, tensors[0].shape[0], COMPILED_CHUNK)]
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts))
    return torch.cat(parts)


# ------------------------------------------------------------------------------------------------
# measurement


def cuda_time(fn: Callable, budget_s: float = 1.5, max_repeats: int = 20):
    """(median ms per call, peak MiB above what was allocated before) after a warm-up call."""
    if DEVICE.type != "cuda":  # dry run: one call, wall time, no memory figure
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1e3, 0.0
    fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    repeats = max(1, min(max_repeats, int(budget_s * 1e3 / max(start.elapsed_time(stop), 1e-3))))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    torch.cuda.empty_cache()
    return statistics.median(times), peak


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| over finite entries, in float64."""
    a, b = a.double(), b.double()
    finite = b.isfinite()
    return ((a - b)[finite].abs().max() / b[finite].abs().max().clamp_min(1e-30)).item()


def kl_relative(kl: torch.Tensor, expected: torch.Tensor) -> float:
    """max over tokens of |KL - expected| / expected (tokens with expected > 0)."""
    kl, expected = kl.double(), expected.double()
    positive = expected > 0
    return ((kl - expected)[positive].abs() / expected[positive]).max().item()


# ------------------------------------------------------------------------------------------------
# inputs


def logits_pair(tokens: int, vocab: int, seed: int = 0):
    """bf16 policy / reference logits (reference = policy + 0.05 noise: KL ~ 1e-3) and targets, on the GPU."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    z = torch.randn(tokens, vocab, device=DEVICE, generator=gen) * 2.0
    zr = z + 0.05 * torch.randn(tokens, vocab, device=DEVICE, generator=gen)
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    return z.bfloat16(), zr.bfloat16(), targets


def layer_inputs(tokens: int, hidden_size: int, vocab: int, seed: int = 3):
    """bf16 hidden states and output layers of a policy and a nearby reference, and targets."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device=DEVICE, generator=gen).bfloat16()
    weight = torch.randn(vocab, hidden_size, device=DEVICE, generator=gen) * hidden_size**-0.5
    ref_weight = (weight + 1e-3 * torch.randn(weight.shape, device=DEVICE, generator=gen)).bfloat16()
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    return hidden, weight.bfloat16(), ref_weight, targets


# ------------------------------------------------------------------------------------------------
# the cases


def term_verdict(errors: dict, what: str) -> tuple:
    """(ok, text) of a token_stats_terms ``*_errors`` result: each entry's error in units of its tolerance."""
    from megatron_zcpo.testing.token_stats_terms import failures

    bad = failures(errors)
    shown = ", ".join(f"{k} {v:.2g}" for k, v in errors.items() if k != "min KL")
    return not bad, f"{what}, min KL {errors['min KL']:.2g}; error / tolerance: {shown}" + (
        f"; FAILED: {'; '.join(bad)}" if bad else ""
    )


def stats_cases(bench: Bench, tokens: int, vocab: int, peer_name: str, peer_ce, target_ms) -> None:
    """Checks and timings of the statistics over given logits at tokens x vocab."""
    from megatron_zcpo.ops.token_stats import vocab_parallel_token_stats
    from megatron_zcpo.testing.token_stats_terms import drifted_logits, logits_term_errors

    table = f"stats {tokens} x {vocab}"
    print(f"\n# {table}, bf16 logits of policy and reference", flush=True)
    z, zr, targets = logits_pair(tokens, vocab)
    fields = ("logprob", "entropy", "ref_logprob", "kl")

    def ours(backend="triton", **options):
        return vocab_parallel_token_stats(z, targets, zr, backend=backend, **options)

    def against_torch(**options):
        with torch.no_grad():
            new, old = ours(**options), ours("torch", **options)
            rows = slice(0, 64)  # float64 reference on a slice of rows
            exact = vocab_parallel_token_stats(z[rows].double(), targets[rows], zr[rows].double(), **options)
        worst = max(relative(getattr(new, f), getattr(old, f)) for f in fields[:3])
        kl_torch, kl_exact = kl_relative(new.kl, old.kl), kl_relative(new.kl[rows], exact.kl)
        old_exact = kl_relative(old.kl[rows], exact.kl)
        text = (
            f"vs torch backend: logprob/entropy/ref rel {worst:.1e}, KL rel {kl_torch:.1e}; vs float64 (64 rows): "
            f"KL rel {kl_exact:.1e} (torch backend {old_exact:.1e})"
        )
        return worst < 1e-5 and kl_torch < 1e-4 and kl_exact < 1e-4, text

    def each_term():
        rows = min(TERM_ROWS, tokens)
        drifted = drifted_logits(rows, vocab, vocab, seed=4, device=DEVICE, dtype=torch.bfloat16)
        return term_verdict(logits_term_errors(*drifted, temperature=0.7), f"{rows} rows, bf16, T=0.7")

    def tiny_kl_against_float64():
        gen = torch.Generator(device=DEVICE).manual_seed(1)
        rows = min(64, tokens)
        z32 = torch.randn(rows, vocab, device=DEVICE, generator=gen) * 2.0
        zr32 = z32 + 1e-4 * torch.randn(rows, vocab, device=DEVICE, generator=gen)  # KL ~ 5e-9
        with torch.no_grad():
            exact = vocab_parallel_token_stats(z32.double(), targets[:rows], zr32.double()).kl
            errors = [
                kl_relative(vocab_parallel_token_stats(z32, targets[:rows], zr32, backend=b).kl, exact)
                for b in ("triton", "torch")
            ]
        text = (
            f"fp32 logits, KL {exact.min().item():.1e}..{exact.max().item():.1e}: KL rel to float64 "
            f"{errors[0]:.1e} (torch backend {errors[1]:.1e})"
        )
        return errors[0] < 1e-4, text

    checks = [f"{vocab} T=1", f"{vocab} tiny KL", f"{vocab} T=0.7 T_kl=1", f"{vocab} each term"]
    bench.check(checks[0], against_torch)
    bench.check(checks[1], tiny_kl_against_float64)
    bench.check(checks[2], lambda: against_torch(temperature=0.7))
    bench.check(checks[3], each_term)
    logits_bytes = 2 * z.numel() * z.element_size()
    with torch.no_grad():
        bench.case(
            table,
            f"peer ({peer_name} + entropy)",
            lambda: (peer_ce(z, targets), peer_entropy(z)),
            logits_bytes / 2,
            peer=True,
        )
        bench.case(
            table,
            "ours (triton)",
            ours,
            logits_bytes,
            checked_by=checks,
            target_ms=target_ms,
            must_read=logits_bytes,
        )
        bench.case(table, "ours (torch backend, previous)", lambda: ours("torch"), logits_bytes)


def compiled_cases(bench: Bench, tokens: int, sizes, hidden_size: int) -> None:
    """The functional versions under torch.compile, last: Inductor's compiles take tens of seconds each."""
    try:
        compiled_stats = torch.compile(functional_stats, dynamic=False)
        compiled_logprob = torch.compile(functional_logprob, dynamic=False)
    except Exception as error:
        print(f"# torch.compile unavailable: {type(error).__name__}: {error}")
        return
    print("\n# compiled functional versions (rows added to the tables above)", flush=True)
    for vocab in sizes:
        z, zr, targets = logits_pair(tokens, vocab)
        with torch.no_grad():
            bench.case(
                f"stats {tokens} x {vocab}",
                f"compiled functional, {vocab}",
                lambda z=z, zr=zr, targets=targets: chunked(compiled_stats, z, zr, targets),
                2 * z.numel() * z.element_size(),
            )
    hidden, weight, _, targets = layer_inputs(tokens, hidden_size, sizes[0])

    def update():
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        chunked(compiled_logprob, h @ w.t(), targets).sum().backward()

    bench.case(
        f"update {tokens} x {hidden_size} x {sizes[0]}",
        "compiled functional logprob update",
        update,
        flops=3 * 2.0 * tokens * hidden_size * sizes[0],
    )


def experience_cases(bench: Bench, tokens: int, hidden_size: int, vocab: int, peer_name: str, peer_ce) -> None:
    """The experience pass: policy and reference output layers and all statistics, no gradient."""
    from megatron_zcpo.ops.token_stats import fused_token_stats
    from megatron_zcpo.testing.token_stats_terms import drifted_layer, fused_value_errors

    table = f"experience {tokens} x {hidden_size} x {vocab}"
    print(f"\n# {table}: fused forward of policy and reference, no gradient, bf16", flush=True)
    hidden, weight, ref_weight, targets = layer_inputs(tokens, hidden_size, vocab)
    gemm = 2.0 * tokens * hidden_size * vocab

    def peer():
        logits = hidden @ weight.t()
        return peer_ce(logits, targets), peer_entropy(logits), peer_ce(hidden @ ref_weight.t(), targets)

    def each_value():
        rows = min(4 * TERM_ROWS, tokens)
        layer = drifted_layer(rows, hidden_size, vocab, vocab, seed=5, device=DEVICE, dtype=torch.bfloat16)
        return term_verdict(fused_value_errors(*layer, temperature=0.7), f"{rows} tokens, bf16, T=0.7")

    bench.check("experience each value", each_value)
    with torch.no_grad():
        bench.case(table, f"peer (2 layers + {peer_name} x2 + H)", peer, flops=2 * gemm, peer=True)
        bench.case(
            table,
            "ours (triton)",
            lambda: fused_token_stats(hidden, weight, targets, hidden, ref_weight, backend="triton"),
            flops=2 * gemm,
            checked_by=["experience each value"],
        )
        bench.case(
            table,
            "ours (torch backend, previous)",
            lambda: fused_token_stats(hidden, weight, targets, hidden, ref_weight, backend="torch"),
            flops=2 * gemm,
        )


def update_cases(bench: Bench, tokens: int, hidden_size: int, vocab: int, peer_name: str, peer_ce, target_ms) -> None:
    """Checks and timings of the update: forward + backward through the output layer and the statistics."""
    from megatron_zcpo.ops.token_stats import fused_token_stats
    from megatron_zcpo.testing.token_stats_terms import drifted_layer, fused_term_errors

    table = f"update {tokens} x {hidden_size} x {vocab}"
    print(f"\n# {table}: forward + backward with the output-layer GEMMs, bf16", flush=True)
    hidden, weight, ref_weight, targets = layer_inputs(tokens, hidden_size, vocab)
    gemm = 2.0 * tokens * hidden_size * vocab

    def step(loss_of):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        loss_of(h, w).backward()
        return h.grad, w.grad

    def ours(backend="triton", with_kl=False):
        def loss(h, w):
            if with_kl:
                stats = fused_token_stats(h, w, targets, hidden, ref_weight, backend=backend)
                return (stats.logprob + stats.entropy + 0.1 * stats.kl).sum()
            return fused_token_stats(h, w, targets, backend=backend).logprob.sum()

        return step(loss)

    def peer():
        return step(lambda h, w: (-peer_ce(h @ w.t(), targets)).sum())

    def each_term():
        rows = min(4 * TERM_ROWS, tokens)
        layer = drifted_layer(rows, hidden_size, vocab, vocab, seed=6, device=DEVICE, dtype=torch.bfloat16)
        return term_verdict(fused_term_errors(*layer, temperature=0.7), f"{rows} tokens, bf16, T=0.7")

    bench.check("update each term", each_term)
    bench.case(table, f"peer (bf16 layer + {peer_name})", peer, flops=3 * gemm, peer=True)
    # ZCPO's update differentiates the log-probs only (the KL enters through the frozen coefficients)
    bench.case(
        table,
        "ours (triton), logprob",
        ours,
        flops=3 * gemm,
        checked_by=["update each term"],
        target_ms=target_ms,
        must_read=float(hidden.numel() + weight.numel()) * 2,  # one read of the inputs (hidden, weight)
    )
    bench.case(
        table,
        "ours (triton), + entropy + KL",
        lambda: ours(with_kl=True),
        flops=4 * gemm,
        checked_by=["update each term"],
    )
    bench.case(table, "ours (torch backend, previous)", lambda: ours("torch"), flops=4 * gemm)
    grad_logits = torch.randn(tokens, vocab, device=DEVICE).bfloat16()
    bench.case(
        table,
        "GEMMs alone (3 x bf16)",
        lambda: (hidden @ weight.t(), grad_logits @ weight, grad_logits.t() @ hidden),
        flops=3 * gemm,
    )


def run(budget_s: float = 270.0, dry_run: bool = False, target_scale_by=1.0, omit=(), compiled=False) -> int:
    """Every check and case; returns the exit status (Bench.verdict). ``dry_run``: on the CPU, toy sizes,
    generous targets (TRITON_INTERPRET=1 must be set before this module first runs a kernel);
    ``target_scale_by``: a factor on the targets (0: every target missed, to test the verdict); ``omit``:
    checks not run; ``compiled``: also the torch.compile baselines (not within the 5 minutes)."""
    global DEVICE
    import triton

    from megatron_zcpo.ops import token_stats_check, token_stats_triton

    # The checks below compare every case with float64 and the torch backend themselves; the op's own
    # first-use check would instead switch a failing case to the torch backend and time that under its name.
    token_stats_check.MODE = "off"
    DEVICE = torch.device("cpu" if dry_run else "cuda")
    tokens, vocab, shard, hidden_size = (24, 320, 64, 16) if dry_run else (4096, 152064, 19008, 5120)
    device_name = "CPU dry run (Triton interpreter)" if dry_run else torch.cuda.get_device_name()
    scale = 1.0 if dry_run else target_scale(device_name)
    stats_target, update_target = (
        (DRY_RUN_TARGET_MS, DRY_RUN_TARGET_MS) if dry_run else (STATS_TARGET_MS, UPDATE_TARGET_MS)
    )
    bench = Bench(budget_s, cuda_time, None if scale is None else scale * target_scale_by, omit)
    print(
        f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; H200 targets x "
        f"{scale if scale is not None else 'unknown (no bandwidth known for this GPU)'}",
        flush=True,
    )
    peer_name, peer_ce = _peer_cross_entropy()
    sections = [
        (stats_cases, (tokens, vocab, peer_name, peer_ce, stats_target)),
        (stats_cases, (tokens, shard, peer_name, peer_ce, None)),
        (update_cases, (tokens, hidden_size, vocab, peer_name, peer_ce, update_target)),
        (experience_cases, (tokens, hidden_size, vocab, peer_name, peer_ce)),
    ]
    for cases, arguments in sections:
        try:
            cases(bench, *arguments)
        except Exception:
            traceback.print_exc()
            bench.failures.append(f"{cases.__name__}{arguments[:2]} raised")
    print("# TP=2: not on one GPU; tests/ops/test_token_stats_terms.py checks it per term under the interpreter")
    if compiled and not dry_run:  # Inductor on the CPU would need a C++ toolchain and minutes
        try:
            compiled_cases(bench, tokens, (vocab, shard), hidden_size)
        except Exception:  # a baseline's failure is reported, not counted against the kernels
            traceback.print_exc()
    print("\n# kernel shapes launched (fixed by the shard width):")
    for key, config in token_stats_triton.chosen_configs().items():
        print(f"#   {key}: {config}")
    return bench.verdict()
