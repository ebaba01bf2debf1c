"""Ranks that save checkpoints back to back (to be killed mid-save) and that verify what they resume from."""

import json
import os
import random
import resource
import signal
import time
from pathlib import Path

import torch

from tests.cases import trainer_cases


def _trainer():
    trainer = trainer_cases.make_trainer(2, 1, None, None, mini_batches=1)
    trainer.train_step(trainer_cases.rollout(num_groups=1))  # Adam's state exists from the first step on
    return trainer


def _local_parameters(trainer):
    from megatron_zcpo.utils.runtime import unwrap

    return list(unwrap(trainer.policy).parameters())


def _peek_rngs():
    """The next draw of every generator a checkpoint restores, leaving them where they were."""
    import numpy as np

    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    peek = {"torch": torch.rand(3).tolist(), "python": random.random(), "numpy": float(np.random.rand())}
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    return peek


def resume_and_verify(trainer, root) -> int:
    """Load the newest complete checkpoint under ``root`` and check it is exactly what was saved.

    Every saved step sets every parameter to the step number and records the next draw of every
    RNG: a checkpoint that loads wrongly (mixed steps, missing shards, other RNG) fails here.
    Returns the resumed step (0 when there is none).
    """
    from megatron_zcpo.checkpoint.io import find_latest

    latest = find_latest(root)
    if latest is None:
        return 0
    state = trainer.load(latest)
    step = trainer.step
    assert state["loop"]["step"] == step == int(latest.name.split("_")[1]), (state, latest)
    for param in _local_parameters(trainer):
        assert torch.all(param == float(step)), f"{latest}: parameter not all {step}"
    assert _peek_rngs() == state["loop"]["rng_peek"], f"{latest}: RNG states not restored"
    return step


def _save(trainer, root, step):
    for param in _local_parameters(trainer):
        param.data.fill_(float(step))
    trainer.step = step
    trainer.save(root, {"loop": {"step": step, "rng_peek": _peek_rngs()}}, keep_last=2)


def save_until_killed(rank, world, root, report):
    """Resume (verified), then save steps back to back; rank 0 reports the resumed step and save time."""
    trainer = _trainer()
    step = resume_and_verify(trainer, root)
    started = time.perf_counter()
    _save(trainer, root, step + 1)
    if rank == 0:
        Path(report).write_text(json.dumps({"resumed": step, "save_s": time.perf_counter() - started}))
    for next_step in range(step + 2, step + 10_000):
        _save(trainer, root, next_step)


def verify_then_fail_a_save(rank, world, root):
    """Verify the newest checkpoint, then save with rank 1 unable to write more than 1 KiB per file."""
    from megatron_zcpo.checkpoint.io import CheckpointWriteError

    trainer = _trainer()
    step = resume_and_verify(trainer, root)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        _save(trainer, root, step + 1)
    except CheckpointWriteError as error:
        return {"resumed": step, "error": str(error)}
    finally:
        if rank == 1:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    return {"resumed": step, "error": None}


def rank_main(rank, world, port, fn, *args):
    """Entry point of one raw rank process (the test kills these with SIGKILL)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    fn(rank, world, *args)
