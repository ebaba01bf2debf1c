"""Resumed runs equal uninterrupted ones, rollouts included: after a plain restart (TP1) and after SIGUSR1 (TP2)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - the fixture is used by name
from tests.recipe.reward_gate import GATE_ENV

NO_EVAL = {"at_start": False, "at_end": False}


def _command(path, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "ZCPO_STARTUP_CHECKED"):
        env.pop(name, None)
    return [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(path), *overrides], env


def _config(directory, model, **changes):
    directory.mkdir()
    return write_config(directory, model, **changes)


def _train(path, *overrides):
    command, env = _command(path, *overrides)
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _catches(pid, signum):
    """Whether process ``pid`` has a handler installed for ``signum`` (Linux: SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as status:
        caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) >> (signum - 1) & 1)


def _step_metrics(run_dir):
    """{step: metrics} of the trained steps, without timings and the run id (which differ run to run)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {
            k: v for k, v in r.items() if not k.startswith("time") and k not in ("train/tokens_per_s", "run_id")
        }
        for r in records
        if "rollout/reward_mean" in r
    }


def test_resumed_run_equals_the_uninterrupted_one_tp1(tmp_path, tiny_model):
    straight = _config(tmp_path / "a", tiny_model, parallel={"tensor": 1}, eval=NO_EVAL)
    _train(straight)
    resumed = _config(tmp_path / "b", tiny_model, parallel={"tensor": 1}, eval=NO_EVAL)
    _train(resumed, "train.steps=1")
    assert "at step 1" in _train(resumed).stdout
    expected, got = _step_metrics(tmp_path / "a" / "run"), _step_metrics(tmp_path / "b" / "run")
    assert sorted(got) == [1, 2]
    assert got[2] == expected[2]
    records = [json.loads(line) for line in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in records} == {(tmp_path / "b" / "run" / "run_id").read_text().strip()}  # one run


GATED = dict(  # TP2, 3 steps, the steps after the first waiting for a stop signal (tests.recipe.reward_gate)
    train={"steps": 3},
    checkpoint={"every": 0},
    eval=NO_EVAL,
    reward={"function": "tests.recipe.reward_gate:gated_dapo_math_reward"},
)


@pytest.fixture(scope="module")
def gated_reference(tmp_path_factory, tiny_model):
    """The metrics of an uninterrupted run of the GATED config (ungated: no gate file), shared by the tests
    that stop its twin."""
    root = tmp_path_factory.mktemp("reference")
    _train(_config(root / "a", tiny_model, **GATED))
    return _step_metrics(root / "a" / "run")


def _started_run(tmp_path, model):
    """(config path of a GATED run, its process just started)."""
    path = _config(tmp_path / "b", model, **GATED)
    command, env = _command(path)
    env[GATE_ENV] = str(tmp_path / "b" / "run" / "metrics.jsonl")
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    return path, process


def test_sigusr1_stops_a_tp2_run_with_a_checkpoint_and_the_rerun_continues_exactly(
    tmp_path, tiny_model, gated_reference
):
    expected = gated_reference
    path, process = _started_run(tmp_path, tiny_model)
    metrics = tmp_path / "b" / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and '"rollout/reward_mean"' in metrics.read_text()):  # step 1 is trained
        assert process.poll() is None, process.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.kill(process.pid, signal.SIGUSR1)  # what Slurm sends (--signal=B:USR1@300) ahead of the time limit
    _, stderr = process.communicate(timeout=600)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    stopped = int((tmp_path / "b" / "run" / "checkpoints" / "latest").read_text().split("_")[1])
    assert stopped in (1, 2) and f"stopped at step {stopped} after SIGUSR1" in stderr
    rerun = _train(path)
    assert f"at step {stopped}" in rerun.stdout
    got = _step_metrics(tmp_path / "b" / "run")
    assert sorted(got) == [1, 2, 3]
    for step in range(stopped + 1, 4):
        assert got[step] == expected[step], step


def _ranks_started(pid):
    import psutil

    ranks = [
        p for p in psutil.Process(pid).children(recursive=True) if "megatron_zcpo.cli.main" in " ".join(p.cmdline())
    ]
    return len(ranks) >= 2


@pytest.mark.parametrize("first_signal", ["launcher-start-up", "ranks-start-up"])
def test_stop_signals_from_the_first_moment_never_kill_a_tp2_run(tmp_path, tiny_model, gated_reference, first_signal):
    # SIGUSR1 every 0.3 s from the launcher's first handled moment on (it stops before starting the
    # ranks), or from the moment its ranks exist (relayed through $ZCPO_STOP_FILE, never signalled to
    # them, so one still importing cannot die): the run exits with the requeue code, and the rerun
    # trains every step exactly as an uninterrupted run.
    path, process = _started_run(tmp_path, tiny_model)
    deadline = time.monotonic() + 600
    ready = _catches if first_signal == "launcher-start-up" else (lambda pid, _: _ranks_started(pid))
    while not ready(process.pid, signal.SIGUSR1):  # (the interpreter's own start-up has no Python handler)
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()[1][-3000:]
        time.sleep(0.01)
    while process.poll() is None and time.monotonic() < deadline:
        os.kill(process.pid, signal.SIGUSR1)
        time.sleep(0.3)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == PREEMPTED_EXIT_CODE, stderr[-3000:]
    expected_stop = "before starting" if first_signal == "launcher-start-up" else "after SIGUSR1"
    assert expected_stop in stderr, stderr[-3000:]
    _train(path)
    assert _step_metrics(tmp_path / "b" / "run") == gated_reference
