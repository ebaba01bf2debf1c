"""Benchmark vocab-parallel token statistics: this op vs the naive way vs how peer frameworks do it.

Methods, each on bf16 vocab-sharded logits of a policy and a reference (as a bf16 model emits them),
forward only (the experience pass):
  ours   megatron_zcpo's vocab_parallel_token_stats: logprob, entropy, ref logprob and exact KL.
  naive  full [tokens, V_local] float32 vocab-parallel log_softmax of both, gather, KL = sum p (lp - lq).
  peer   megatron-core's tensor_parallel.vocab_parallel_cross_entropy for the log-prob plus a separate
         vocab-parallel entropy pass (what verl and slime do); no reference, no KL.

CPU (default): every (method, tokens, vocab, TP) case runs in fresh gloo processes, one thread each;
time is the slowest rank's wall time, peak memory the largest per-rank rise of the resident set
(VmHWM after the call minus VmRSS before it, the high-water mark reset first, with glibc made to
map and unmap every allocation of 64 KiB or more), so the inputs and reused heap pages do not count. ``--comm`` times the two communication patterns the op could use.
``--update`` times the update pass from hidden states (fused op vs Megatron's output layer + cross
entropy, forward and backward). ``--gpu`` (one CUDA device, TP=1, <= 5 minutes): per-term checks of
the Triton kernels against float64 and the torch backend on the GPU, then times and peak memory against
the HBM and bf16 rooflines beside the peer and the previous implementation, then the targets asserted
(exit 1 when one is missed, skipped or unchecked; ``bench_token_stats_gpu.py``).

    python benchmarks/bench_token_stats.py --sizes 1024x32768,4096x152064 --tp 1,2
    python benchmarks/bench_token_stats.py --comm
    python benchmarks/bench_token_stats.py --update --tp 1,2
    python benchmarks/bench_token_stats.py --gpu [--budget 270] [--compiled]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this repository's package, installed or not

METHODS = ("ours", "naive", "peer")


# ------------------------------------------------------------------------------------------------
# inputs


def make_shards(tokens: int, vocab: int, tp: int, rank: int, device="cpu"):
    """bf16 policy / reference logits of this rank's vocabulary shard and global targets.

    Rows are generated in blocks so no full-size float32 temporary inflates the baseline memory.
    The reference differs from the policy by small noise (KL ~ 1e-3 per token).
    """
    local = vocab // tp
    gen = torch.Generator().manual_seed(1000 + rank)
    logits = torch.empty(tokens, local, dtype=torch.bfloat16, device=device)
    ref_logits = torch.empty_like(logits)
    for start in range(0, tokens, 256):
        block = torch.randn(min(256, tokens - start), local, generator=gen) * 2.0
        logits[start : start + block.shape[0]] = block.to(device)
        ref_logits[start : start + block.shape[0]] = (block + 0.05 * torch.randn(block.shape, generator=gen)).to(device)
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(7)).to(device)
    return logits, ref_logits, targets


# ------------------------------------------------------------------------------------------------
# the three methods


def run_ours(logits, ref_logits, targets, group, vocab):
    from megatron_zcpo.ops.token_stats import vocab_parallel_token_stats

    return vocab_parallel_token_stats(logits, targets, ref_logits, group=group, vocab_size=vocab)


def _all_reduce(tensor, group, op=dist.ReduceOp.SUM):
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _vocab_parallel_log_softmax(logits, group):
    logits = logits.float()
    top = _all_reduce(logits.amax(-1, keepdim=True), group, dist.ReduceOp.MAX)
    shifted = logits - top
    total = _all_reduce(shifted.exp().sum(-1, keepdim=True), group)
    return shifted - total.log()


def _owned_target_values(values, targets, group):
    local = values.shape[-1]
    start = (dist.get_rank(group) if group is not None else 0) * local
    owned = (targets >= start) & (targets < start + local)
    picked = values.gather(-1, (targets - start).clamp(0, local - 1).unsqueeze(-1)).squeeze(-1)
    return _all_reduce(torch.where(owned, picked, torch.zeros_like(picked)), group)


def run_naive(logits, ref_logits, targets, group, vocab):
    log_p = _vocab_parallel_log_softmax(logits, group)
    log_q = _vocab_parallel_log_softmax(ref_logits, group)
    p = log_p.exp()
    kl = _all_reduce((p * (log_p - log_q)).sum(-1), group)
    entropy = _all_reduce(-(p * log_p).sum(-1), group)
    return _owned_target_values(log_p, targets, group), entropy, _owned_target_values(log_q, targets, group), kl


def peer_entropy(logits, group):
    """Vocab-parallel entropy as a separate pass over the logits, the way verl / slime compute it."""
    logits = logits.float()
    top = _all_reduce(logits.amax(-1, keepdim=True), group, dist.ReduceOp.MAX)
    exp_logits = (logits - top).exp()
    total = _all_reduce(exp_logits.sum(-1, keepdim=True), group)
    softmax = exp_logits / total
    expected_logit = _all_reduce((softmax * logits).sum(-1, keepdim=True), group)
    return (top + total.log() - expected_logit).squeeze(-1)


def run_peer(logits, ref_logits, targets, group, vocab):
    from megatron.core import tensor_parallel

    logprob = -tensor_parallel.vocab_parallel_cross_entropy(logits, targets)
    return logprob, peer_entropy(logits, group)


RUNNERS = {"ours": run_ours, "naive": run_naive, "peer": run_peer}


# ------------------------------------------------------------------------------------------------
# CPU cases in fresh gloo processes


def _memory_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(re.search(field + r":\s+(\d+)", status.read()).group(1))


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets VmHWM to the current resident set


def _measure(fn):
    """Run ``fn()`` once: (wall seconds, CPU seconds, peak rise of the resident set in MiB)."""
    dist.barrier()
    _reset_peak_rss()
    before = _memory_kib("VmRSS")
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = fn()
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    peak = _memory_kib("VmHWM") - before
    del outputs
    return seconds, cpu_seconds, peak / 1024


def cpu_case(rank, world, method, tokens, vocab):
    """One method on one size in this (fresh) process: (wall seconds, CPU seconds, peak extra MiB)."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group() if world > 1 else None
    logits, ref_logits, targets = make_shards(tokens, vocab, world, rank)
    runner = RUNNERS[method]
    with torch.no_grad():
        runner(logits[:8], ref_logits[:8], targets[:8], group, vocab)  # load code paths, not timed
        measured = _measure(lambda: runner(logits, ref_logits, targets, group, vocab))
    parallel_state.destroy_model_parallel()
    return measured


def run_cpu(sizes, tps, methods, repeats):
    from megatron_zcpo.testing import run_distributed

    # glibc serves every allocation of 64 KiB or more with its own mmap and unmaps it on free (no
    # dynamic threshold, no reuse of freed heap pages), so the resident set follows live tensors.
    # Spawned ranks inherit this environment before their allocator starts.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    print(
        f"# CPU: {os.cpu_count()} cores, torch {torch.__version__}, one thread per rank, bf16 inputs, forward; "
        f"best of {repeats} fresh runs; cpu = process CPU seconds of the slowest rank"
    )
    print(
        f"{'tokens x vocab':>16} {'TP':>3} {'method':>6} {'wall s':>8} {'cpu s':>8} {'peak MiB/rank':>14} "
        f"{'cpu/peer':>9} {'mem naive/ours':>15}"
    )
    for tokens, vocab in sizes:
        for tp in tps:
            results = {}
            for method in methods:
                runs = [run_distributed(cpu_case, tp, method, tokens, vocab, timeout=3600) for _ in range(repeats)]
                results[method] = min(
                    (tuple(max(r[i] for r in per_rank) for i in range(3)) for per_rank in runs),
                    key=lambda result: result[1],
                )
            for method, (seconds, cpu_seconds, peak) in results.items():
                vs_peer = f"{cpu_seconds / results['peer'][1]:.2f}" if "peer" in results else "-"
                vs_naive = (
                    f"{results['naive'][2] / max(peak, 1e-9):.1f}" if method == "ours" and "naive" in results else ""
                )
                print(
                    f"{f'{tokens}x{vocab}':>16} {tp:>3} {method:>6} {seconds:>8.2f} {cpu_seconds:>8.2f} "
                    f"{peak:>14.0f} {vs_peer:>9} {vs_naive:>15}",
                    flush=True,
                )


def update_step(method, hidden, weight, targets, group, vocab):
    """Update pass from bf16 hidden states: log-prob forward + backward into hidden and the output weight.

    ours: fused_token_stats (logits recomputed in fp32 tile by tile, also in backward); peer:
    Megatron's output layer (copy_to_tensor_model_parallel_region, bf16 GEMM) + vocab_parallel_cross_entropy.
    Returns the gradients of hidden and weight.
    """
    from megatron.core import tensor_parallel

    from megatron_zcpo.ops.token_stats import fused_token_stats

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    if method == "ours":
        fused_token_stats(h, w, targets, group=group, vocab_size=vocab).logprob.sum().backward()
    else:
        logits = tensor_parallel.copy_to_tensor_model_parallel_region(h) @ w.t()
        (-tensor_parallel.vocab_parallel_cross_entropy(logits, targets)).sum().backward()
    return h.grad, w.grad


def update_case(rank, world, method, tokens, vocab, hidden_size):
    """:func:`update_step` in this (fresh) process: (wall seconds, CPU seconds, peak extra MiB)."""
    from megatron.core import parallel_state

    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    group = parallel_state.get_tensor_model_parallel_group() if world > 1 else None
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16)
    full_weight = torch.randn(vocab, hidden_size, generator=torch.Generator().manual_seed(12)) * hidden_size**-0.5
    weight = full_weight.narrow(0, rank * (vocab // world), vocab // world).to(torch.bfloat16)
    del full_weight
    targets = torch.randint(0, vocab, (tokens,), generator=gen)

    update_step(method, hidden[:8], weight, targets[:8], group, vocab)  # load code paths, not timed
    measured = _measure(lambda: update_step(method, hidden, weight, targets, group, vocab))
    parallel_state.destroy_model_parallel()
    return measured


def run_update(tokens, vocab, hidden_size, tps):
    from megatron_zcpo.testing import run_distributed

    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)
    print(f"# CPU update pass: {tokens} tokens x {vocab} vocab, hidden {hidden_size}, bf16, log-prob fwd+bwd")
    print(f"{'TP':>3} {'method':>6} {'wall s':>8} {'cpu s':>8} {'peak MiB/rank':>14}")
    for tp in tps:
        for method in ("ours", "peer"):
            per_rank = run_distributed(update_case, tp, method, tokens, vocab, hidden_size, timeout=3600)
            seconds, cpu_seconds, peak = (max(r[i] for r in per_rank) for i in range(3))
            print(f"{tp:>3} {method:>6} {seconds:>8.2f} {cpu_seconds:>8.2f} {peak:>14.0f}", flush=True)


# ------------------------------------------------------------------------------------------------
# communication patterns at TP=2


def _all_gather(out, tensor):
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, tensor)


def comm_case(rank, world, tokens, chunk_rows, repeats):
    """Seconds per call for: two all-reduces per chunk; one all-gather per chunk; one per call."""
    dist.init_process_group("gloo")
    stats_per_token = 9
    timings = {}

    def timed(name, body):
        body()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            body()
        timings[name] = (time.perf_counter() - start) / repeats

    def max_and_sum_per_chunk():
        for _ in range(0, tokens, chunk_rows):
            dist.all_reduce(torch.zeros(chunk_rows, 2), op=dist.ReduceOp.MAX)
            dist.all_reduce(torch.zeros(chunk_rows, stats_per_token - 2))

    def gather_per_chunk():
        out = torch.empty(world * stats_per_token, chunk_rows, dtype=torch.float64)
        for _ in range(0, tokens, chunk_rows):
            _all_gather(out, torch.zeros(stats_per_token, chunk_rows, dtype=torch.float64))

    def gather_per_call():
        out = torch.empty(world * stats_per_token, tokens, dtype=torch.float64)
        _all_gather(out, torch.zeros(stats_per_token, tokens, dtype=torch.float64))

    timed("MAX + SUM all-reduce per chunk", max_and_sum_per_chunk)
    timed("one all-gather per chunk", gather_per_chunk)
    timed("one all-gather per call", gather_per_call)
    return timings


def run_comm(tokens=4096, repeats=5):
    from megatron_zcpo.testing import run_distributed

    for chunk_rows in (3, 128):  # whole 152064-column rows that fit L3; the op's default tile height
        timings = run_distributed(comm_case, 2, tokens, chunk_rows, repeats)[0]
        print(f"# gloo TP=2, {tokens} tokens, chunks of {chunk_rows} tokens ({-(-tokens // chunk_rows)} chunks)")
        for name, seconds in timings.items():
            print(f"{name:>32}: {seconds * 1e3:8.2f} ms per call")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1024x32768,1024x152064,4096x152064", help="tokens x vocab, comma list")
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes, comma list")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=1, help="fresh runs per case (CPU); the best is kept")
    parser.add_argument("--comm", action="store_true", help="time the communication patterns (gloo, TP=2)")
    parser.add_argument("--update", action="store_true", help="time the fused update pass (2048 x 152064, H=256)")
    parser.add_argument("--gpu", action="store_true", help="run the GPU section (one CUDA device)")
    parser.add_argument(
        "--budget", type=float, default=270.0, help="GPU section: seconds after which cases are skipped"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="with --gpu: every check and case once on the CPU at toy sizes (Triton's interpreter)",
    )
    parser.add_argument(
        "--target-scale", type=float, default=1.0, help="GPU section: a factor on the targets (0: all missed)"
    )
    parser.add_argument(
        "--omit-check", action="append", default=[], help="GPU section: a check not to run (its cases: unchecked)"
    )
    parser.add_argument("--compiled", action="store_true", help="GPU section: also the torch.compile baselines")
    args = parser.parse_args(argv)
    if args.gpu:
        if args.dry_run:
            os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is loaded
        import bench_token_stats_gpu

        return bench_token_stats_gpu.run(
            budget_s=args.budget,
            dry_run=args.dry_run,
            target_scale_by=args.target_scale,
            omit=args.omit_check,
            compiled=args.compiled,
        )
    elif args.comm:
        run_comm()
    elif args.update:
        run_update(2048, 152064, 256, [int(tp) for tp in args.tp.split(",")])
    else:
        sizes = [tuple(int(x) for x in size.split("x")) for size in args.sizes.split(",")]
        run_cpu(sizes, [int(tp) for tp in args.tp.split(",")], args.methods.split(","), args.repeat)


if __name__ == "__main__":
    sys.exit(main())
