"""Per-step time of the CPU demo's workload (32 prompts x 8 samples, TP=2), side by side across source trees.

Each variant is ``zcpo train`` run in fresh processes from a source tree (``PYTHONPATH``) on the
same model (the current tree's demo assets) and the same prompts, with dynamic sampling's
filter off so that every step trains exactly 32 x 8 samples; no evaluation. Reported: the median
over the steps after the first two (warm-up) of each phase as the trainer logs it (rollout =
generation + rewards, experience, update, weight push, whole step), the CPU seconds per step of
all its processes (user + system, from a run of ``--steps`` and one of half as many: the difference
over the extra steps, so start-up does not count; steadier than wall time on a loaded machine), the
ratios to the first variant, and the peak resident set of the largest process. Variants run
alternately, ``--repeat`` times each, so that a shared machine's load hits them alike; the spread
over repeats is the noise.

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
from typing import Tuple

import yaml

PHASES = ("time/step", "time/rollout", "time/experience", "time/update", "time/weight_sync")
REPO = Path(__file__).resolve().parents[1]
# Launches one training in a fresh interpreter and prints the peak RSS (KiB) of its processes.
_WRAPPER = (
    "import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
    "usage = resource.getrusage(resource.RUSAGE_CHILDREN); "
    "print('PEAK_KIB', usage.ru_maxrss); print('CPU_S', usage.ru_utime + usage.ru_stime); sys.exit(code)"
)


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


def _train(tree: Path, overrides: list, config_path: Path, run_dir: Path, steps: int) -> Tuple[dict, float, float]:
    """One training run from ``tree``: (its metrics per step, CPU seconds, peak RSS in KiB)."""
    command = [
        sys.executable,
        "-c",
        _WRAPPER,
        sys.executable,
        "-m",
        "megatron_zcpo.cli.main",
        "train",
        str(config_path),
        f"logging.run_dir={run_dir}",
        f"train.steps={steps}",
        *overrides,
    ]
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if done.returncode:
        raise RuntimeError(f"training from {tree} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    values = dict(line.split() for line in done.stdout.splitlines() if line.startswith(("PEAK_KIB", "CPU_S")))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "time/step" in r], float(values["CPU_S"]), float(values["PEAK_KIB"])


def run_variant(tree: Path, overrides: list, config_path: Path, run_dir: Path, steps: int) -> dict:
    """{phase: median wall seconds over the steps after the first two, "cpu_s": CPU seconds per
    step, "peak_mib"} of ``tree`` on the workload."""
    short = max(1, steps // 2)
    _, cpu_short, peak_short = _train(tree, overrides, config_path, run_dir.with_name(run_dir.name + "-short"), short)
    rows, cpu, peak = _train(tree, overrides, config_path, run_dir, steps)
    result = {phase: statistics.median(r[phase] for r in rows[2:]) for phase in PHASES}
    result["cpu_s"] = (cpu - cpu_short) / (steps - short)
    result["peak_mib"] = max(peak, peak_short) / 1024
    return result


def parse_variant(text: str):
    """``name=TREE[:key=value,...]`` -> (name, tree path, [key=value overrides])."""
    name, _, rest = text.partition("=")
    tree, _, overrides = rest.partition(":")
    return name, Path(tree or ".").resolve(), [o for o in overrides.split(",") if o]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        help="name=TREE[:key=value,...] (repeatable; the first is the reference; default: this tree)",
    )
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
                results[name].append(run_variant(tree, overrides, config_path, run_dir, args.steps))
                print(
                    f"{name} #{repeat}: "
                    + ", ".join(f"{k.split('/')[-1]} {v:.3f}" for k, v in results[name][-1].items()),
                    file=sys.stderr,
                )
    print(
        f"| variant | {' | '.join(p.split('/')[-1] + ' s' for p in PHASES)} | CPU s / step | "
        f"wall vs {variants[0][0]} | CPU vs {variants[0][0]} | peak MiB |"
    )
    print("|---" * (len(PHASES) + 5) + "|")
    reference = statistics.median(r["time/step"] for r in results[variants[0][0]])
    reference_cpu = statistics.median(r["cpu_s"] for r in results[variants[0][0]])
    for name, _, _overrides in variants:
        runs = results[name]
        cells = []
        for phase in (*PHASES, "cpu_s"):
            values = [r[phase] for r in runs]
            spread = f" ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else ""
            cells.append(f"{statistics.median(values):.3f}{spread}")
        step = statistics.median(r["time/step"] for r in runs)
        cpu = statistics.median(r["cpu_s"] for r in runs)
        peak = max(r["peak_mib"] for r in runs)
        print(f"| {name} | {' | '.join(cells)} | {reference / step:.2f}x | {reference_cpu / cpu:.2f}x | {peak:.0f} |")


if __name__ == "__main__":
    main()
