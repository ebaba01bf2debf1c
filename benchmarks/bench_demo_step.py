"""Per-step time of the CPU demo's workload (32 prompts x 8 samples, TP=2), side by side across source trees.

Each variant is ``zcpo train`` run in fresh processes from a source tree (``PYTHONPATH``) on the
same model (the current tree's demo assets) and the same prompts, with dynamic sampling's
filter off so that every step trains exactly 32 x 8 samples; no evaluation. Reported: the median
over the steps after the first two (warm-up) of each phase as the trainer logs it (rollout =
generation + rewards, experience, update, weight push, whole step), the ratio to the first
variant, and the peak resident set of the largest process. Variants run alternately, ``--repeat``
times each, so that a shared machine's load hits them alike; the spread over repeats is the noise.

  python benchmarks/bench_demo_step.py --variant main=/work/main:train.micro_batch_tokens=1024 \
      --variant new=. --steps 10 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

PHASES = ("time/step", "time/rollout", "time/experience", "time/update", "time/weight_sync")
REPO = Path(__file__).resolve().parents[1]
# Launches one training in a fresh interpreter and prints the peak RSS (KiB) of its processes.
_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
            "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def workload_config(assets: Path, run_dir: Path, steps: int) -> dict:
    """The demo config fixed to 32 prompts x 8 samples per step, TP=2, no evaluation or checkpoints."""
    from megatron_zcpo.cli.demo import demo_config

    config = demo_config(assets, run_dir, {}, steps)
    config["rollout"].update(prompts_per_step=32, samples_per_prompt=8)
    config["rollout"]["dynamic_sampling"] = {"drop_tied_groups": False, "oversample_factor": 1.0, "max_rounds": 1}
    config["parallel"]["tensor"] = 2
    config["eval"].update(at_start=False, at_end=False, every=0)
    config["checkpoint"]["every"] = 0
    config["logging"].update(console="quiet", tensorboard=False)
    return config


def run_variant(tree: Path, overrides: list, config_path: Path, run_dir: Path) -> dict:
    """One training run from ``tree``; returns {phase: median seconds after warm-up, "peak_mib"}."""
    command = [sys.executable, "-c", _WRAPPER, sys.executable, "-m", "megatron_zcpo.cli.main", "train",
               str(config_path), f"logging.run_dir={run_dir}", *overrides]
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode:
        raise RuntimeError(f"training from {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    peak = next(int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_KIB"))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/step" in r][2:]
    result = {phase: statistics.median(r[phase] for r in rows) for phase in PHASES}
    result["peak_mib"] = peak / 1024
    return result


def parse_variant(text: str):
    """``name=TREE[:key=value,...]`` -> (name, tree path, [key=value overrides])."""
    name, _, rest = text.partition("=")
    tree, _, overrides = rest.partition(":")
    return name, Path(tree or ".").resolve(), [o for o in overrides.split(",") if o]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", default=[],
                        help="name=TREE[:key=value,...] (repeatable; the first is the reference; default: this tree)")
    parser.add_argument("--steps", type=int, default=10, help="training steps per run (the first 2 are not timed)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per variant, interleaved")
    args = parser.parse_args()
    from megatron_zcpo.recipe.demo_assets import build_demo_assets

    variants = [parse_variant(v) for v in args.variant] or [("current", REPO, [])]
    assets = build_demo_assets(log=lambda line: print(line, file=sys.stderr))
    results = {name: [] for name, _, _ in variants}
    with tempfile.TemporaryDirectory() as tmp:
        config_path = Path(tmp) / "workload.yaml"
        config_path.write_text(yaml.safe_dump(workload_config(assets, Path(tmp) / "run", args.steps)))
        for repeat in range(args.repeat):
            for name, tree, overrides in variants:
                run_dir = Path(tmp) / f"{name}-{repeat}"
                results[name].append(run_variant(tree, overrides, config_path, run_dir))
                print(f"{name} #{repeat}: " + ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in results[name][-1].items()),
                      file=sys.stderr)
    print(f"| variant | {' | '.join(p.split('/')[-1] + ' s' for p in PHASES)} | step vs {variants[0][0]} | peak MiB |")
    print("|---" * (len(PHASES) + 3) + "|")
    reference = statistics.median(r["time/step"] for r in results[variants[0][0]])
    for name, _, overrides in variants:
        runs = results[name]
        cells = []
        for phase in PHASES:
            values = [r[phase] for r in runs]
            spread = f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""
            cells.append(f"{statistics.median(values):.3f}{spread}")
        step = statistics.median(r["time/step"] for r in runs)
        peak = max(r["peak_mib"] for r in runs)
        print(f"| {name} | {' | '.join(cells)} | {reference / step:.2f}x faster | {peak:.0f} |")


if __name__ == "__main__":
    main()
