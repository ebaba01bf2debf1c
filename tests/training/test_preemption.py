"""A stop signal to one rank (real SIGUSR1/SIGTERM) stops every rank after the same step."""

import os
import signal
from pathlib import Path

from megatron_zcpo.testing import run_distributed
from megatron_zcpo.training.preemption import PreemptionGuard


def steps_until_signalled(rank, world, signals, signal_at):
    import torch.distributed as dist

    from megatron_zcpo.megatron.initialize import setup_megatron

    setup_megatron()
    with PreemptionGuard() as guard:
        for step in range(10):
            if step == signal_at and signals[rank] is not None:
                os.kill(os.getpid(), signals[rank])  # a real signal; the process survives it
            dist.barrier()  # "the step": ranks finish it in lockstep
            stop = guard.should_stop()
            if stop:
                return {"stopped_after": step, "signal": stop}
    return {"stopped_after": None, "signal": None}


def test_signal_to_one_rank_stops_every_rank_at_the_same_step():
    # Rank 0 gets nothing, rank 1 SIGUSR1, rank 2 SIGTERM (the highest signal number is reported).
    results = run_distributed(steps_until_signalled, 3, [None, signal.SIGUSR1, signal.SIGTERM], 3)
    assert results == [{"stopped_after": 3, "signal": "SIGTERM"}] * 3


def test_guard_restores_previous_handlers():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionGuard() as guard:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.should_stop() == "SIGUSR1"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_launcher_relays_a_stop_through_the_file_its_ranks_read(tmp_path, monkeypatch):
    from megatron_zcpo.training.preemption import STOP_FILE_ENV

    relay = tmp_path / "requested"
    with PreemptionGuard() as launcher:
        os.kill(os.getpid(), signal.SIGUSR1)  # before the ranks exist: written as soon as relaying starts
        launcher.relay_to(str(relay))
        assert relay.read_text() == str(int(signal.SIGUSR1))
        launcher.relay_to(None)
    relay.unlink()
    rank = PreemptionGuard()  # a rank started with $ZCPO_STOP_FILE: no signal of its own
    monkeypatch.setenv(STOP_FILE_ENV, str(relay))
    assert rank.requested() == 0 and rank.should_stop() is None
    with PreemptionGuard() as launcher:
        launcher.relay_to(str(relay))
        os.kill(os.getpid(), signal.SIGTERM)
    assert rank.should_stop() == "SIGTERM"


def test_a_ranks_helper_processes_survive_the_stop_signals_slurm_sends_to_every_process(tmp_path):
    """Slurm signals every process of a step: megatron-core's checkpoint Manager, the resource tracker
    and a forkserver reward worker must survive SIGUSR1 and SIGTERM, so that the save after the stop
    works (before: BrokenPipeError from the dead Manager)."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "tests.training.stop_signal_probe", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    helpers = " ".join(result["helpers"])
    assert "resource_tracker" in helpers and "spawn_main" in helpers and "forkserver" in helpers, helpers
    assert result["survived"] and result["stop"] == "SIGTERM", result
    assert "metadata.json" in result["second_save"] and result["reward"] == "ok", result
    assert result["reward_worker_restarts"] == 0, result
