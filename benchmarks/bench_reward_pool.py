"""Benchmark the reward worker pool's dispatch: one message per call vs chunks of calls.

``RewardWorkerPool.map`` of the real ``dapo_math_reward`` on short boxed-integer answers (its integer
fast path takes microseconds, so the pool's inter-process messaging is nearly all of the time), as in
one step of the CPU demo (32 prompts x 8 samples = 256 calls). Dispatch:
  per-call  ``max_chunk_size=1``: a message to the worker and one back per call (two process wake-ups
            per call; the pool's dispatch before chunking).
  chunked   the default: chunks of up to 64 calls per message, one result message back per call.
Each case has its own pool (started and warmed up before timing); time is the best of ``--repeat``
``map`` calls (wall, ``time.perf_counter``), CPU the calling process's CPU time in that call, memory
the calling process's peak resident set (workers excluded).

    python benchmarks/bench_reward_pool.py
    python benchmarks/bench_reward_pool.py --calls 1024 --workers 1,2,4 --repeat 9
"""

from __future__ import annotations

import argparse
import resource
import time

from megatron_zcpo.rewards.pool import RewardWorkerPool

FUNCTION = "megatron_zcpo.rewards.math:dapo_math_reward"
CASES = {"per-call": 1, "chunked": None}


def make_calls(num_calls: int, group_size: int = 8):
    """``num_calls`` (response, ground truth, metadata) tuples: boxed integers, about 1 in 4 correct."""
    return [
        (f"Adding them up gives \\boxed{{{(index * 7) % 40}}}.", str(index % 10), {"uid": f"q{index // group_size}"})
        for index in range(num_calls)
    ]


def time_case(max_chunk_size, calls, num_workers: int, repeat: int):
    """(best wall s, calling process CPU s of that run) of ``repeat`` maps of ``calls``."""
    options = {} if max_chunk_size is None else {"max_chunk_size": max_chunk_size}
    with RewardWorkerPool(FUNCTION, num_workers=num_workers, timeout_s=30.0, **options) as pool:
        pool.map(calls)  # the workers start and import math-verify here, not in the timed runs
        runs = []
        for _ in range(repeat):
            wall, cpu = time.perf_counter(), time.process_time()
            outcomes = pool.map(calls)
            runs.append((time.perf_counter() - wall, time.process_time() - cpu))
            assert all(outcome.status == "ok" for outcome in outcomes), outcomes
    return min(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=256)
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    calls = make_calls(args.calls)
    print(f"{args.calls} calls of {FUNCTION}, best of {args.repeat}")
    print("| workers | dispatch | wall ms | parent CPU ms | us / call | wall vs per-call | parent peak RSS MiB |")
    print("|---|---|---|---|---|---|---|")
    for num_workers in [int(value) for value in args.workers.split(",")]:
        results = {name: time_case(chunk, calls, num_workers, args.repeat) for name, chunk in CASES.items()}
        for name, (wall, cpu) in results.items():
            peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(
                f"| {num_workers} | {name} | {wall * 1e3:.1f} | {cpu * 1e3:.1f} | {wall * 1e6 / args.calls:.0f} "
                f"| {wall / results['per-call'][0]:.2f} | {peak_mib:.0f} |"
            )


if __name__ == "__main__":
    main()
