"""Wall time of one ``zcpo demo --compare`` arm set, side by side: one run at a time vs several at once, TP=2 vs TP=1.

Each variant runs the same comparison (``--arms``, ``--seeds``, ``--steps``, task) from a source
tree (``PYTHONPATH``) in a fresh interpreter, with its own flags (e.g. ``--jobs 2 --nproc 1``),
after the demo assets of that tree are cached (built beforehand, not timed). Reported per variant:
the wall seconds of the whole comparison, the CPU seconds of all its processes (user + system;
steadier than wall time on a shared machine, and on an idle 2-core machine the wall time cannot be
below CPU / 2), the ratios to the first variant, the peak resident memory of all its processes
together (sampled every 0.5 s) and each arm's held-out accuracy after training (mean over seeds):
variants at the same tensor-parallel size must give the same numbers, whatever runs at once.
Variants run alternately, ``--repeat`` times each, so that a shared machine's load hits them alike.

  python benchmarks/bench_demo_compare.py --variant today=/tmp/base: \\
      --variant jobs2=.:--jobs=2 --variant jobs2-tp1=.:--jobs=2,--nproc=1 --seeds 2 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import psutil

REPO = Path(__file__).resolve().parents[1]


def parse_variant(text: str) -> Tuple[str, Path, List[str], Dict[str, str]]:
    """``name=TREE:flag,flag`` -> (name, tree, ["--jobs", "2", ...], environment); a flag ``--a=b``
    becomes ``--a b``, and ``env:NAME=VALUE`` sets a variable for the variant's processes."""
    name, rest = text.split("=", 1)
    tree, _, flags = rest.partition(":")
    args, env = [], {"OMP_NUM_THREADS": "1"}
    for flag in filter(None, flags.split(",")):
        if flag.startswith("env:"):
            key, value = flag[len("env:") :].split("=", 1)
            env[key] = value
        else:
            args.extend(flag.split("=", 1))
    return name, Path(tree or ".").resolve(), args, env


# Runs the command in argv and prints the CPU seconds of all its (waited-for) descendants.
_WRAPPER = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "usage = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print('CPU_S', usage.ru_utime + usage.ru_stime); sys.exit(code)"
)


def run_variant(tree: Path, flags: List[str], env: Dict[str, str], common: List[str], out: Path) -> dict:
    """One comparison from ``tree``: wall s, CPU s of the process tree, peak total RSS (MiB), per-arm accuracy."""
    command = [
        sys.executable,
        "-c",
        _WRAPPER,
        sys.executable,
        "-m",
        "megatron_zcpo.cli.main",
        "demo",
        "--compare",
        *common,
        *flags,
        "--out",
        str(out),
    ]
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(log, "w") as handle:  # a file, not a pipe: nobody reads a pipe while the comparison runs
        process = psutil.Popen(
            command,
            env={**os.environ, **env, "PYTHONPATH": str(tree)},
            cwd=tree,
            stdout=handle,
            stderr=subprocess.STDOUT,
        )
        peak, loads = 0, []
        while process.poll() is None:
            loads.append(os.getloadavg()[0])
            total = 0
            for member in [process, *process.children(recursive=True)]:
                try:
                    total += member.memory_info().rss
                except psutil.Error:
                    continue
            peak = max(peak, total)
            time.sleep(0.5)
    wall = time.perf_counter() - started
    output = log.read_text(errors="replace")
    if process.returncode:
        raise RuntimeError(f"{command} from {tree} failed:\n{output[-4000:]}")
    cpu = float(output.rsplit("CPU_S", 1)[1].split()[0])
    summary = json.loads((out / "summary.json").read_text())
    after = {row["method"]: row["after"] for row in summary["methods"]}
    return {
        "wall": wall,
        "cpu": cpu,
        "peak_mib": peak / 2**20,
        "after": after,
        "load": statistics.mean(loads) if loads else os.getloadavg()[0],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="name=TREE:flag,flag (first: the reference)")
    parser.add_argument("--arms", default="dapo,dapo-k3,zcpo")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=0, help="training steps (default: the demo config's)")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    common = ["--seeds", str(args.seeds)] + (["--task", args.task] if args.task != "addition" else [])
    if args.arms != "dapo,dapo-k3,zcpo":
        common += ["--arms", args.arms]
    if args.steps:
        common += ["--steps", str(args.steps)]
    results: Dict[str, List[dict]] = {name: [] for name, *_ in variants}
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as scratch:
        for repeat in range(args.repeat):
            for name, tree, flags, env in variants:
                result = run_variant(tree, flags, env, common, Path(scratch) / f"{name}-{repeat}")
                results[name].append(result)
                print(
                    f"{name} #{repeat}: {result['wall']:.0f} s wall, {result['cpu']:.0f} CPU s, "
                    f"peak {result['peak_mib']:.0f} MiB, mean load average {result['load']:.1f}",
                    flush=True,
                )
    reference = results[variants[0][0]]
    ref_wall = statistics.median(r["wall"] for r in reference)
    ref_cpu = statistics.median(r["cpu"] for r in reference)
    print(f"\n{args.seeds} seeds x arms {args.arms}, task {args.task}; medians over {args.repeat} repeat(s)")
    print(
        "| variant | flags, environment | wall s | CPU s | wall vs first | CPU vs first | peak MiB (all processes) | "
        "held-out after per arm | load average |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, _tree, flags, env in variants:
        rows = results[name]
        wall, cpu = statistics.median(r["wall"] for r in rows), statistics.median(r["cpu"] for r in rows)
        after = ", ".join(f"{arm} {value:.3f}" for arm, value in rows[0]["after"].items())
        setting = " ".join(flags + [f"{k}={v}" for k, v in env.items()])
        print(
            f"| {name} | {setting} | {wall:.0f} ({min(r['wall'] for r in rows):.0f}-"
            f"{max(r['wall'] for r in rows):.0f}) | {cpu:.0f} | {ref_wall / wall:.2f}x | {ref_cpu / cpu:.2f}x | "
            f"{max(r['peak_mib'] for r in rows):.0f} | {after} | "
            f"{min(r['load'] for r in rows):.1f}-{max(r['load'] for r in rows):.1f} |"
        )


if __name__ == "__main__":
    main()
