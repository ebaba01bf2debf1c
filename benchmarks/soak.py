"""Soak run (not part of CI): the demo configuration for hundreds of steps while faults are injected at random.

`zcpo train` (TP=2 over gloo) rolls out through two mock SGLang servers (testing/mock_server.py,
the embedded engine behind SGLang's HTTP API, weights pushed from disk) while this script
- kills a server with SIGKILL now and then and restarts it a little later (server drops);
- has the servers fail a share of /generate requests at random (dropped connections, 503s,
  requests that hang until the client's timeout);
- scores with a reward function that raises or hangs past reward.timeout_s at random;
- sends SIGUSR1 to the training run now and then (a time-limit warning) and restarts it when it
  exits with the preemption code.
It then reports faults injected vs survived, steps lost (a step trained twice or never: must be
0), and whether every trained step used fully scored groups (reward/failed == 0 in the kept
groups) and the current weights (rollout/stale_samples == 0).

    python benchmarks/soak.py --steps 300 --out runs/soak
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REWARD_FAILURE_RATE = 0.01  # per response: raise
REWARD_HANG_RATE = 0.005  # per response: sleep past reward.timeout_s
REWARD_TIMEOUT_S = 2.0


def flaky_reward(response: str, ground_truth: str, metadata=None) -> float:
    """The math reward, failing at random: raises, or hangs past ``reward.timeout_s`` (logged to $SOAK_DIR).

    The start-up check calls it with the answer as the response: that call never fails.
    """
    from megatron_zcpo.rewards.math import dapo_math_reward

    draw = random.random()
    if response != ground_truth and draw < REWARD_FAILURE_RATE + REWARD_HANG_RATE:
        kind = "raise" if draw < REWARD_FAILURE_RATE else "hang"
        with open(Path(os.environ["SOAK_DIR"]) / "reward_faults.log", "a") as log:
            log.write(kind + "\n")
        if kind == "raise":
            raise RuntimeError("soak: injected reward failure")
        time.sleep(3 * REWARD_TIMEOUT_S)
    return dapo_math_reward(response, ground_truth, metadata)


class MockServer:
    """One mock SGLang server process on a fixed port (so a restarted one has the same URL)."""

    def __init__(self, assets: Path, port: int, out: Path, fault_rate: float, seed: int):
        self.command = [
            sys.executable,
            "-m",
            "megatron_zcpo.testing.mock_server",
            "--model-path",
            str(assets),
            "--port",
            str(port),
            "--fault-rate",
            str(fault_rate),
            "--random-seed",
            str(seed),
            "--fault-log",
            str(out / "server_faults.log"),
            "--enable-deterministic-inference",  # the client sends per-request seeds (sampling_seeds)
            "--context-length",
            "78",
        ]  # the demo's data.max_prompt_length 64 + 12 new tokens + 2
        self.url, self.log = f"http://127.0.0.1:{port}", out / f"server_{port}.log"
        self.process = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log, start_new_session=True)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


def soak_config(
    assets: Path, out: Path, steps: int, servers, request_timeout_s: float = 10.0, keep_tied_groups: bool = False
) -> Path:
    """The demo config on the mock servers, with the fault-tolerance settings a cluster run would use."""
    from megatron_zcpo.cli.demo import demo_config

    config = demo_config(
        assets,
        out / "run",
        {
            "train": {"steps": steps},
            # A barely warmed-up model (--sft-steps) ties most groups: keep them, so every step trains
            # (kept for 300 steps at the demo's lr they degrade the policy: see benchmarks/RESULTS.md).
            "rollout": {
                "engine": "sglang",
                "dynamic_sampling": {"drop_tied_groups": not keep_tied_groups},
                "sglang": {
                    "server_urls": [s.url for s in servers],
                    "client": {
                        "weight_sync": "disk",
                        "weight_dir": str(out / "weights"),
                        "request_timeout_s": request_timeout_s,
                        "max_retries": 2,
                        "backoff_s": 0.2,
                        "backoff_max_s": 1.0,
                        "min_healthy": 1,
                        "max_concurrency": 32,
                        "rollout_timeout_s": 600.0,
                        "startup_timeout_s": 120.0,
                        "sampling_seeds": True,
                    },
                },
            },
            "reward": {"function": "soak:flaky_reward", "timeout_s": REWARD_TIMEOUT_S, "on_failure": "skip-group"},
            "eval": {"every": 0, "at_start": False, "at_end": False},
            "checkpoint": {"every": 10, "keep_last": 2, "resume": "auto"},
            "logging": {"console": "plain", "tensorboard": False},
        },
    )
    path = out / "soak.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def count_lines(path: Path) -> dict:
    counts: dict = {}
    if path.exists():
        for line in path.read_text().split("\n"):
            if line.strip():
                kind = line.split()[-1]
                counts[kind] = counts.get(kind, 0) + 1
    return counts


def summarize(out: Path, steps_wanted, exit_code: int, restarts: int, injected: dict, wall_s: float) -> dict:
    """The soak's outcome from the run's metrics and the fault logs (``steps_wanted`` None: up to the last trained)."""
    from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE

    steps_wanted_given = steps_wanted
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "rollout/reward_mean" in r]
    steps = [int(r["step"]) for r in trained]
    steps_wanted = steps_wanted or max(steps, default=0)
    return {
        "exit_code": exit_code,
        "stopped_at_deadline": steps_wanted_given is None and exit_code == PREEMPTED_EXIT_CODE,
        "wall_s": round(wall_s, 1),
        "steps_trained": len(set(steps)),
        "steps_lost": len(steps) - len(set(steps)) + len(set(range(1, steps_wanted + 1)) - set(steps)),
        "restarts_after_sigusr1": restarts,
        "faults_injected": {
            **injected,
            **{f"request_{k}": v for k, v in count_lines(out / "server_faults.log").items()},
            **{f"reward_{k}": v for k, v in count_lines(out / "reward_faults.log").items()},
        },
        "servers_back_in_rotation": sum(
            "back in rotation" in line for line in (out / "train.log").read_text().splitlines()
        ),
        "steps_with_failed_rewards_trained": sum(r.get("reward/failed", 0) > 0 for r in trained),
        "stale_samples_trained": sum(r.get("rollout/stale_samples", 0) for r in trained),
        "rejected_samples": sum(r.get("rollout/rejected_samples", 0) for r in trained),
        "groups_dropped_invalid": sum(r.get("dynamic_sampling/groups_dropped_invalid", 0) for r in trained),
        "reward_mean_first_last": [trained[0]["rollout/reward_mean"], trained[-1]["rollout/reward_mean"]]
        if trained
        else [],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/soak")
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--fault-rate", type=float, default=0.02, help="share of /generate requests failed")
    parser.add_argument("--server-kill-every", type=float, default=90.0, help="mean seconds between server kills")
    parser.add_argument("--preempt-every", type=float, default=240.0, help="mean seconds between SIGUSR1s")
    parser.add_argument(
        "--sft-steps",
        type=int,
        default=0,
        help="cap on the demo model's warm-up steps (default: the demo's own; a loaded machine may need fewer)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=10.0,
        help="the client's per-request timeout: how long a hung request stalls a rollout",
    )
    parser.add_argument(
        "--max-minutes",
        type=float,
        default=0.0,
        help="stop (by SIGUSR1, not restarted) after this long and report the steps trained so far",
    )
    args = parser.parse_args()

    from megatron_zcpo.recipe.demo_assets import DemoSpec, build_demo_assets
    from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE
    from megatron_zcpo.utils.runtime import free_port

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    spec = DemoSpec()
    assets = build_demo_assets(dataclasses.replace(spec, sft_max_steps=args.sft_steps) if args.sft_steps else spec)
    servers = [MockServer(assets, free_port(), out, args.fault_rate, args.seed + i) for i in range(2)]
    for server in servers:
        server.start()
    config = soak_config(
        assets, out, args.steps, servers, args.request_timeout_s, keep_tied_groups=bool(args.sft_steps)
    )
    env = dict(
        os.environ,
        SOAK_DIR=str(out),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("RANK", None)
    injected = {"server_kill": 0, "sigusr1": 0}
    restarts, started = 0, time.monotonic()
    stop_at = started + 60 * args.max_minutes if args.max_minutes else float("inf")
    down = None  # (server, restart time) while one is dead
    try:
        while True:
            with open(out / "train.log", "a") as log:
                train = subprocess.Popen(
                    [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(config)],
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
            next_kill = time.monotonic() + rng.expovariate(1 / args.server_kill_every)
            next_preempt = time.monotonic() + rng.expovariate(1 / args.preempt_every)
            while train.poll() is None:
                now = time.monotonic()
                if down is not None and now >= down[1]:
                    down[0].start()
                    down = None
                    # One server down at a time: the restarted one gets time to load before the next kill
                    # (both down at once is below min_healthy, where the run is meant to stop).
                    next_kill = max(next_kill, now + 60.0)
                if down is None and now >= next_kill:
                    victim = rng.choice(servers)
                    victim.kill()
                    injected["server_kill"] += 1
                    down = (victim, now + rng.uniform(5.0, 30.0))
                    next_kill = now + rng.expovariate(1 / args.server_kill_every)
                if now >= min(next_preempt, stop_at):
                    os.kill(train.pid, signal.SIGUSR1)
                    injected["sigusr1"] += 1
                    next_preempt = stop_at = float("inf")  # one per training process
                time.sleep(0.2)
            if train.returncode == PREEMPTED_EXIT_CODE and time.monotonic() < started + 60 * (args.max_minutes or 1e9):
                restarts += 1
                continue
            break
    finally:
        if down is not None:
            down[0].start()
        for server in servers:
            server.stop()
    stopped_at_deadline = train.returncode == PREEMPTED_EXIT_CODE  # --max-minutes ran out
    report = summarize(
        out,
        None if stopped_at_deadline else args.steps,
        train.returncode,
        restarts,
        injected,
        time.monotonic() - started,
    )
    (out / "soak_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    ok = (
        report["exit_code"] in (0, PREEMPTED_EXIT_CODE)
        and report["steps_lost"] == 0
        and not report["stale_samples_trained"]
        and not report["steps_with_failed_rewards_trained"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
