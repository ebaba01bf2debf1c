"""A rank's helper processes under Slurm's stop signals: ``python -m tests.training.stop_signal_probe DIR``.

As a ``zcpo train`` rank starts (:func:`record_stop_signals` first), it sets up megatron-core in a
world of one, saves a checkpoint through ``dist_checkpointing`` (which starts megatron-core's write-results
``Manager`` and multiprocessing's resource tracker) and starts a reward worker (forkserver). Then
SIGUSR1 and SIGTERM go to every process of its tree, as Slurm's proctrack sends them to every process
of a step. Prints one JSON line: the processes signalled, the stop the guard saw, whether every
helper survived, and whether a second save and a reward call still work.
"""

import json
import os
import signal
import sys
import time


def main() -> None:
    from megatron_zcpo.training.preemption import PreemptionGuard, record_stop_signals

    record_stop_signals()
    import psutil
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.rewards.pool import RewardWorkerPool

    root = sys.argv[1]  # the checkpoints go here

    def save(index: int) -> None:
        os.makedirs(f"{root}/{index}")
        state = {"weight": ShardedTensor.from_rank_offsets("weight", torch.arange(8.0) + index)}
        dist_checkpointing.save(state, f"{root}/{index}")

    setup_megatron()
    with PreemptionGuard() as guard:
        save(0)
        pool = RewardWorkerPool("megatron_zcpo.rewards.math:dapo_math_reward", num_workers=1, timeout_s=60)
        pool.map([("\\boxed{1}", "1", {})])
        me = psutil.Process()
        helpers = me.children(recursive=True)
        for signum in (signal.SIGUSR1, signal.SIGTERM):
            for process in [*helpers, me]:
                os.kill(process.pid, signum)
            time.sleep(0.5)
        survived = all(process.is_running() and process.status() != psutil.STATUS_ZOMBIE for process in helpers)
        stop = guard.should_stop()
        save(1)
        outcome = pool.map([("\\boxed{2}", "2", {})])[0]
        print(
            json.dumps(
                {
                    "helpers": [" ".join(process.cmdline())[:120] for process in helpers],
                    "survived": survived,
                    "stop": stop,
                    "second_save": sorted(os.listdir(f"{root}/1")),
                    "reward": outcome.status,
                    "reward_worker_restarts": pool.restarts,
                }
            ),
            flush=True,
        )
        pool.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
