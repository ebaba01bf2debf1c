"""Checkpoint faults: kill -9 mid-save never yields a wrong resume; unwritable/full directories are named; no pickles run."""

import contextlib
import glob
import json
import os
import random
import signal
import time

import pytest
import torch

from megatron_zcpo.checkpoint.io import (
    LATEST,
    CheckpointWriteError,
    UnsafeCheckpointError,
    check_checkpoint_dir,
    check_plain_state,
    find_latest,
    read_plain_state,
)
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.utils.runtime import free_port
from megatron_zcpo.utils.spawn import rank_context
from tests.cases import checkpoint_fault_cases

KILL_ROUNDS = 3


class _WritesAFile:
    """What a crafted checkpoint could hold: unpickling it calls ``open(marker, "w")``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return open, (self.marker, "w")


def test_crafted_pickle_in_a_checkpoint_is_refused(tmp_path):
    marker = tmp_path / "code_ran"
    crafted = tmp_path / "step_00000001" / "trainer_state.pt"
    crafted.parent.mkdir()
    torch.save({"trainer_step": 1, "loop": _WritesAFile(str(marker))}, crafted)
    with pytest.raises(UnsafeCheckpointError, match="trainer_state.pt holds objects other than tensors"):
        read_plain_state(crafted)
    assert not marker.exists()
    torch.load(crafted, weights_only=False)  # the file really is harmful when unpickled the old way
    assert marker.exists()


def test_only_plain_state_is_saved():
    check_plain_state({"loop": {"data": {"epoch": 1, "fingerprint": "ab"}}, "rng": [torch.zeros(2), None, 1.5]})
    with pytest.raises(TypeError, match=r"trainer_state\.loop\.data is a object"):
        check_plain_state({"loop": {"data": object()}})


def test_unwritable_or_full_checkpoint_directory_is_named(tmp_path):
    check_checkpoint_dir(tmp_path / "new" / "ckpt")  # probed at tmp_path, created by the first save only
    assert not (tmp_path / "new").exists() and not list(tmp_path.iterdir())
    blocked = tmp_path / "a_file"
    blocked.write_text("")
    with pytest.raises(CheckpointWriteError, match=f"checkpoint directory {blocked}/ckpt is not writable"):
        check_checkpoint_dir(blocked / "ckpt")
    full = tmp_path / "full"
    full.mkdir()
    os.symlink("/dev/full", full / ".zcpo_write_probe")  # every write to it fails with ENOSPC
    with pytest.raises(CheckpointWriteError, match=f"checkpoint directory {full} is not writable: No space left"):
        check_checkpoint_dir(full)
    with pytest.raises(
        CheckpointWriteError, match=f"checkpoint directory {tmp_path} has .* MiB free, but a checkpoint needs"
    ):
        check_checkpoint_dir(tmp_path, needed_bytes=2**62)


def _wait_for(path, procs, timeout):
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p.exitcode for p in procs if p.exitcode is not None]
        assert not dead, f"a rank exited with {dead} before its first save (a wrong resume raises there)"
        assert time.monotonic() < deadline, f"no save within {timeout}s"
        time.sleep(0.05)
    return json.loads(path.read_text())


def _assert_namespace_consistent(root):
    """Every step_XXXXXXXX directory is complete and ``latest`` names one of them."""
    named = [p for p in root.iterdir() if p.name.startswith("step_") and len(p.name) == len("step_00000000")]
    for path in named:
        assert (path / "trainer_state.pt").is_file(), f"{path.name} carries a step name but is incomplete"
    if (root / LATEST).exists():
        assert (root / (root / LATEST).read_text()).is_dir(), "latest points at a missing directory"


def _kill_with_descendants(pid: int) -> None:
    """SIGKILL ``pid`` and the processes it started (megatron's async-save workers, multiprocessing's
    helpers): killed alone, those outlived the test as orphans."""
    tree, index = [pid], 0
    while index < len(tree):
        for children in glob.glob(f"/proc/{tree[index]}/task/*/children"):
            with contextlib.suppress(OSError), open(children) as listed:  # (that thread may have ended)
                tree += [int(child) for child in listed.read().split()]
        index += 1
    for member in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def test_kill_9_during_saves_always_resumes_the_last_complete_checkpoint(tmp_path):
    """Rank processes save back to back; a random rank is SIGKILLed at a random moment (then the
    other, as a launcher would), several times over the same directory. Each restart verifies the
    checkpoint it resumes from (every parameter equals its step, RNG draws as recorded)."""
    ctx = rank_context()  # (forked from a server that imported torch and megatron-core once)
    chooser = random.Random(17)
    resumed_steps = []
    for round_index in range(KILL_ROUNDS):
        report = tmp_path / f"round_{round_index}.json"
        port = free_port()
        procs = [
            ctx.Process(
                target=checkpoint_fault_cases.rank_main,
                args=(rank, 2, port, checkpoint_fault_cases.save_until_killed, str(tmp_path / "ckpt"), str(report)),
            )
            for rank in range(2)
        ]
        for proc in procs:
            proc.start()
        try:
            first = _wait_for(report, procs, timeout=300)
            resumed_steps.append(first["resumed"])
            time.sleep(chooser.uniform(0.0, 3.0 * first["save_s"]))
            victim = chooser.randrange(2)
            _kill_with_descendants(procs[victim].pid)
            time.sleep(chooser.uniform(0.0, 0.2))
        finally:
            for proc in procs:
                if proc.is_alive():
                    _kill_with_descendants(proc.pid)
                proc.join()
        _assert_namespace_consistent(tmp_path / "ckpt")
    # Every restart got past a verified resume, and resumed no earlier than the one before.
    assert resumed_steps[0] == 0 and all(b > a for a, b in zip(resumed_steps, resumed_steps[1:])), resumed_steps
    latest = find_latest(tmp_path / "ckpt")
    results = run_distributed(checkpoint_fault_cases.verify_then_fail_a_save, 2, str(tmp_path / "ckpt"))
    assert results[0]["resumed"] == int(latest.name.split("_")[1]) > resumed_steps[-1]
    # A save that fails on rank 1 only (file size limit) is reported on both ranks, naming the path,
    # and leaves the previous checkpoint in place.
    failed_at = tmp_path / "ckpt" / f"step_{results[0]['resumed'] + 1:08d}.tmp"
    for result in results:
        assert result["error"].startswith(f"saving checkpoint {failed_at} failed (rank 0: ")
        assert "CheckpointException ranks:dict_keys([1])" in result["error"]  # the rank that could not write
    assert find_latest(tmp_path / "ckpt") == latest
    _assert_namespace_consistent(tmp_path / "ckpt")
