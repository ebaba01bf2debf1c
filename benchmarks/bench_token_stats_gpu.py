"""GPU benchmark of the token statistics (``bench_token_stats.py --gpu``): one CUDA device, TP=1, <= ~5 minutes.

Checks first, then times. Every Triton case is compared on the GPU with the torch backend (the
previous implementation) and, on a slice of rows, with float64; then each case is timed with CUDA
events beside the peer and the previous implementation:

  stats 4096 x 152,064 and 4096 x 19,008 (a TP=8 shard), bf16 logits of policy and reference:
    ours (triton)        logprob, entropy, ref logprob, exact KL: one kernel
    ours (torch)         the same op on its torch backend (the previous implementation)
    peer                 Megatron's vocab_parallel_cross_entropy + an entropy pass (no reference, no KL);
                         plain-torch cross-entropy + entropy when megatron-core is not installed
    compiled             the four statistics as plain functional torch (bf16 in, fp32 math,
                         logsumexp), 512-row chunks, under torch.compile
  experience 4096 x 5120 x 152,064: fused forward of policy and reference (2 GEMMs), no gradient
  update 4096 x 5120 x 152,064: forward + backward with the output-layer GEMMs
    ours (triton)        fused_token_stats(...).logprob backward: 3 GEMMs, logits never whole
    ours (triton) + KL   with the reference's hidden states and output layer (4 GEMMs)
    ours (torch)         the previous implementation (fp32 logits recomputed tile by tile)
    peer                 bf16 output layer + Megatron's (or plain torch) cross-entropy
    compiled             bf16 output layer + the compiled functional statistics
    GEMMs alone          the three bf16 GEMMs of an output layer's forward and backward

``--dry-run`` runs every check and case once on the CPU at toy sizes (Triton's interpreter), to test
this script where there is no GPU. Columns: ms per call, peak memory above the inputs, the fraction of the HBM roofline (the bytes the
case must read / time, against 4.8 TB/s) and of the dense bf16 roofline (GEMM FLOPs / time, against
790 TFLOP/s), and the time relative to the peer. Each case runs in its own try (an error is printed
and the run goes on); cases are skipped once ``--budget`` seconds have passed. Exit status 1 when a
check failed or a Triton case raised.
"""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Callable, Dict, List

import torch
import torch.nn.functional as F

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
BF16_FLOPS = 790e12  # H200 dense bf16 tensor cores
COMPILED_CHUNK = 512
DEVICE = torch.device("cuda")  # run(dry_run=True): the CPU


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
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


class Bench:
    """Runs checks and timed cases, each in its own try, under a time budget; prints as it goes."""

    def __init__(self, budget_s: float):
        self.deadline = time.perf_counter() + budget_s
        self.started = time.perf_counter()
        self.failed_checks: List[str] = []
        self.failed_cases: List[str] = []
        self.rows: Dict[str, List[tuple]] = {}

    def out_of_time(self, name: str) -> bool:
        if time.perf_counter() > self.deadline:
            print(f"  {name:<34} skipped: time budget spent", flush=True)
            return True
        return False

    def check(self, name: str, body: Callable[[], tuple]) -> None:
        """body() -> (ok, text)."""
        if self.out_of_time("check " + name):
            return
        try:
            ok, text = body()
        except Exception as error:
            ok, text = False, f"raised {type(error).__name__}: {error}"
            traceback.print_exc()
        print(f"  check {name:<28} {'PASS' if ok else 'FAIL'}  {text}", flush=True)
        if not ok:
            self.failed_checks.append(name)

    def case(
        self,
        table: str,
        name: str,
        fn: Callable,
        read_bytes: float = 0.0,
        flops: float = 0.0,
        required: bool = False,
        peer: bool = False,
    ) -> None:
        if self.out_of_time(name):
            return
        try:
            ms, peak = cuda_time(fn)
        except Exception as error:
            print(f"  {name:<34} ERROR {type(error).__name__}: {str(error)[:300]}", flush=True)
            traceback.print_exc()
            if required:
                self.failed_cases.append(f"{table}: {name}")
            return
        rows = self.rows.setdefault(table, [])
        rows.append((name, ms, peak, read_bytes, flops, peer))
        hbm = f"{read_bytes / (ms * 1e-3) / HBM_BYTES_PER_S:6.1%}" if read_bytes else "     -"
        tensor = f"{flops / (ms * 1e-3) / BF16_FLOPS:6.1%}" if flops else "     -"
        peer_ms = next((r[1] for r in rows if r[5]), None)
        ratio = f"{ms / peer_ms:6.2f}" if peer_ms else "     -"
        print(f"  {name:<34} {ms:9.3f} ms  peak +{peak:8.0f} MiB  HBM {hbm}  bf16 {tensor}  x peer {ratio}", flush=True)
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


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


def stats_cases(bench: Bench, tokens: int, vocab: int, peer_name: str, peer_ce) -> None:
    """Checks and timings of the statistics over given logits at tokens x vocab."""
    from megatron_zcpo.ops.token_stats import vocab_parallel_token_stats

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

    def gradients_against_torch():
        rows = slice(0, 512)
        grads = {}
        for backend in ("triton", "torch"):
            logits = z[rows].float().requires_grad_()
            stats = vocab_parallel_token_stats(logits, targets[rows], zr[rows], temperature=0.7, backend=backend)
            (stats.logprob + stats.entropy + 10.0 * stats.kl).sum().backward()
            grads[backend] = logits.grad
        error = relative(grads["triton"], grads["torch"])
        return error < 1e-4, f"512 rows, T=0.7, logprob + entropy + 10 KL: logit gradient rel {error:.1e}"

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

    bench.check(f"{vocab} T=1", against_torch)
    bench.check(f"{vocab} tiny KL", tiny_kl_against_float64)
    bench.check(f"{vocab} T=0.7 T_kl=1", lambda: against_torch(temperature=0.7))
    bench.check(f"{vocab} backward", gradients_against_torch)
    logits_bytes = 2 * z.numel() * z.element_size()
    with torch.no_grad():
        bench.case(
            table,
            f"peer ({peer_name} + entropy)",
            lambda: (peer_ce(z, targets), peer_entropy(z)),
            logits_bytes / 2,
            peer=True,
        )
        bench.case(table, "ours (triton)", lambda: ours(), logits_bytes, required=True)
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

    table = f"experience {tokens} x {hidden_size} x {vocab}"
    print(f"\n# {table}: fused forward of policy and reference, no gradient, bf16", flush=True)
    hidden, weight, ref_weight, targets = layer_inputs(tokens, hidden_size, vocab)
    gemm = 2.0 * tokens * hidden_size * vocab

    def peer():
        logits = hidden @ weight.t()
        return peer_ce(logits, targets), peer_entropy(logits), peer_ce(hidden @ ref_weight.t(), targets)

    with torch.no_grad():
        bench.case(table, f"peer (2 layers + {peer_name} x2 + H)", peer, flops=2 * gemm, peer=True)
        bench.case(
            table,
            "ours (triton)",
            lambda: fused_token_stats(hidden, weight, targets, hidden, ref_weight),
            flops=2 * gemm,
            required=True,
        )
        bench.case(
            table,
            "ours (torch backend, previous)",
            lambda: fused_token_stats(hidden, weight, targets, hidden, ref_weight, backend="torch"),
            flops=2 * gemm,
        )


def update_cases(bench: Bench, tokens: int, hidden_size: int, vocab: int, peer_name: str, peer_ce) -> None:
    """Checks and timings of the update: forward + backward through the output layer and the statistics."""
    from megatron_zcpo.ops.token_stats import fused_token_stats

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

    def against_torch():
        rows = min(1024, tokens)  # the previous implementation's update takes ~40 ms per 1024 tokens
        sub = dict(hidden=hidden[:rows], targets=targets[:rows])
        results = {}
        for backend in ("triton", "torch"):
            h, w = sub["hidden"].detach().requires_grad_(), weight.detach().requires_grad_()
            stats = fused_token_stats(h, w, sub["targets"], sub["hidden"], ref_weight, temperature=0.7, backend=backend)
            (stats.logprob + stats.entropy + 0.1 * stats.kl).sum().backward()
            results[backend] = (stats, h.grad, w.grad)
        new, old = results["triton"], results["torch"]
        values = max(relative(getattr(new[0], f), getattr(old[0], f)) for f in ("logprob", "entropy", "ref_logprob"))
        kl = kl_relative(new[0].kl, old[0].kl)
        grads = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(new[1:], old[1:])]
        text = (
            f"{rows} tokens, T=0.7, logprob + entropy + 0.1 KL: values rel {values:.1e}, KL rel {kl:.1e}; "
            f"gradient rel (norm) hidden {grads[0]:.1e}, weight {grads[1]:.1e}"
        )
        return values < 1e-5 and kl < 1e-4 and max(grads) < 1e-2, text

    bench.check("update vs torch backend", against_torch)
    bench.case(table, f"peer (bf16 layer + {peer_name})", peer, flops=3 * gemm, peer=True)
    bench.case(table, "ours (triton), logprob", lambda: ours(), flops=3 * gemm, required=True)
    bench.case(table, "ours (triton), + entropy + KL", lambda: ours(with_kl=True), flops=4 * gemm, required=True)
    bench.case(table, "ours (torch backend, previous)", lambda: ours("torch"), flops=4 * gemm)
    grad_logits = torch.randn(tokens, vocab, device=DEVICE).bfloat16()
    bench.case(
        table,
        "GEMMs alone (3 x bf16)",
        lambda: (hidden @ weight.t(), grad_logits @ weight, grad_logits.t() @ hidden),
        flops=3 * gemm,
    )


def run(budget_s: float = 270.0, dry_run: bool = False) -> int:
    """Every check and case; returns the exit status. ``dry_run``: on the CPU, toy sizes, no torch.compile
    (TRITON_INTERPRET=1 must be set before this module first runs a kernel)."""
    global DEVICE
    import triton

    from megatron_zcpo.ops import token_stats_check, token_stats_triton

    # The checks below compare every case with the torch backend themselves; the op's own first-use
    # check would instead switch a failing case to the torch backend and time that under its name.
    token_stats_check.MODE = "off"
    DEVICE = torch.device("cpu" if dry_run else "cuda")
    tokens, vocab, shard, hidden_size = (24, 320, 64, 16) if dry_run else (4096, 152064, 19008, 5120)
    bench = Bench(budget_s)
    device_name = "CPU dry run (Triton interpreter)" if dry_run else torch.cuda.get_device_name()
    print(
        f"# {device_name}, torch {torch.__version__}, triton {triton.__version__}; "
        f"roofline HBM {HBM_BYTES_PER_S / 1e12:.1f} TB/s, bf16 {BF16_FLOPS / 1e12:.0f} TFLOP/s",
        flush=True,
    )
    peer_name, peer_ce = _peer_cross_entropy()
    for size in (vocab, shard):
        try:
            stats_cases(bench, tokens, size, peer_name, peer_ce)
        except Exception:
            traceback.print_exc()
            bench.failed_cases.append(f"stats {size}")
    for cases in (update_cases, experience_cases):
        try:
            cases(bench, tokens, hidden_size, vocab, peer_name, peer_ce)
        except Exception:
            traceback.print_exc()
            bench.failed_cases.append(cases.__name__)
    if not dry_run:  # Inductor on the CPU would need a C++ toolchain and minutes
        try:
            compiled_cases(bench, tokens, (vocab, shard), hidden_size)
        except Exception:  # a baseline's failure is reported, not counted against the kernels
            traceback.print_exc()
    print("\n# kernel shapes launched (fixed by the shard width):")
    for key, config in token_stats_triton.chosen_configs().items():
        print(f"#   {key}: {config}")
    print(
        f"\n# token-stats GPU bench: {len(bench.failed_checks)} checks failed {bench.failed_checks}, "
        f"{len(bench.failed_cases)} Triton cases failed {bench.failed_cases}; "
        f"{time.perf_counter() - bench.started:.0f} s",
        flush=True,
    )
    return 1 if bench.failed_checks or bench.failed_cases else 0
