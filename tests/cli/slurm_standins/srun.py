"""A stand-in for ``srun`` (Slurm 24.05) inside an allocation: runs a step's tasks on this machine, each with
the variables srun and slurmstepd give a task.

Nodes are the allocation's (``SLURM_JOB_NODELIST``, comma-separated here), loopback addresses in the
tests, so a task on "node" 127.x.y.5 binds where a real one would. A step takes ``--nodelist`` (else the
first ``--nodes`` of the job), ``--ntasks`` (block distribution over its nodes) or ``--ntasks-per-node``
(default one task per node), runs every task's command at once (``--chdir``), forwards SIGTERM / SIGINT
/ SIGUSR1 to them, with ``--kill-on-bad-exit=1`` ends the others when one fails, and exits with the
highest exit code. Per task (srun(1) "OUTPUT ENVIRONMENT VARIABLES", slurmstepd): SLURM_NTASKS /
SLURM_NPROCS / SLURM_STEP_NUM_TASKS = the step's tasks, SLURM_NNODES / SLURM_STEP_NUM_NODES and
SLURM_NODELIST / SLURM_STEP_NODELIST = the step's nodes, SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE,
SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID (within the step), SLURM_GTIDS, SLURMD_NODENAME,
SLURM_TOPOLOGY_ADDR, SLURM_STEP_ID / SLURM_STEPID, SLURM_CPUS_PER_TASK and SLURM_GPUS_PER_NODE when
asked; SLURM_JOB_NODELIST and SLURM_JOB_NUM_NODES keep describing the whole job.

Test controls: every step is appended to ``$FAKE_SRUN_LOG`` (JSON: options, command, each task's
Slurm variables and the job's exports). ``FAKE_SRUN_TRAINING=record`` records the training step
(``zcpo train`` without ``--dry-run``) without running it.
"""

import json
import os
import signal
import subprocess
import sys
import time

STEP_VARIABLES = (
    "SLURM_STEP_ID",
    "SLURM_NTASKS",
    "SLURM_NPROCS",
    "SLURM_STEP_NUM_TASKS",
    "SLURM_NNODES",
    "SLURM_STEP_NUM_NODES",
    "SLURM_NODELIST",
    "SLURM_STEP_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NODEID",
    "SLURMD_NODENAME",
    "SLURM_JOB_NODELIST",
    "SLURM_JOB_NUM_NODES",
    "SLURM_CPUS_PER_TASK",
)
JOB_EXPORTS = ("MASTER_ADDR", "MASTER_PORT", "CUDA_DEVICE_MAX_CONNECTIONS", "ZCPO_SGLANG_API_KEY")


def parse(argv):
    """({option: value or True}, command): srun's options come before the command, as --key=value."""
    options, position = {}, 0
    while position < len(argv) and argv[position].startswith("-"):
        key, _, value = argv[position][2:].partition("=")
        options[key] = value or True
        position += 1
    return options, argv[position:]


def step_id(log_path):
    """The next step id of the job (steps may start at once: ids are claimed by creating a file)."""
    step = 0
    while True:
        try:
            os.close(os.open(f"{log_path}.step{step}", os.O_CREAT | os.O_EXCL))
            return step
        except FileExistsError:
            step += 1


def placement(options):
    """[(node, tasks on it)] of the step."""
    job_nodes = [node for node in os.environ["SLURM_JOB_NODELIST"].split(",") if node]
    if "nodelist" in options:
        nodes = options["nodelist"].split(",")
        unknown = [node for node in nodes if node not in job_nodes]
        if unknown:
            sys.exit(f"srun: error: Requested node configuration is not available: {unknown} not in the job")
    else:
        nodes = job_nodes[: int(options.get("nodes", len(job_nodes)))]
    if int(options.get("nodes", len(nodes))) != len(nodes):
        sys.exit(f"srun: error: --nodes={options['nodes']} but --nodelist has {len(nodes)} nodes")
    if "ntasks-per-node" in options:
        return [(node, int(options["ntasks-per-node"])) for node in nodes]
    tasks = int(options.get("ntasks", len(nodes)))
    per_node = -(-tasks // len(nodes))  # block distribution
    counts = [max(0, min(per_node, tasks - i * per_node)) for i in range(len(nodes))]
    return [(node, count) for node, count in zip(nodes, counts) if count]


def task_environments(options, step):
    layout = placement(options)
    tasks = sum(count for _, count in layout)
    nodes = [node for node, _ in layout]
    tasks_per_node = ",".join(str(count) for _, count in layout)
    environments, rank = [], 0
    for node_id, (node, count) in enumerate(layout):
        gtids = ",".join(str(rank + local) for local in range(count))
        for local in range(count):
            env = dict(os.environ)
            env.update(
                SLURM_STEP_ID=str(step),
                SLURM_STEPID=str(step),
                SLURM_NTASKS=str(tasks),
                SLURM_NPROCS=str(tasks),
                SLURM_STEP_NUM_TASKS=str(tasks),
                SLURM_NNODES=str(len(nodes)),
                SLURM_STEP_NUM_NODES=str(len(nodes)),
                SLURM_NODELIST=",".join(nodes),
                SLURM_STEP_NODELIST=",".join(nodes),
                SLURM_TASKS_PER_NODE=tasks_per_node,
                SLURM_STEP_TASKS_PER_NODE=tasks_per_node,
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(local),
                SLURM_NODEID=str(node_id),
                SLURM_GTIDS=gtids,
                SLURMD_NODENAME=node,
                SLURM_TOPOLOGY_ADDR=node,
            )
            if "cpus-per-task" in options:
                env["SLURM_CPUS_PER_TASK"] = options["cpus-per-task"]
            if "gpus-per-node" in options:
                env["SLURM_GPUS_PER_NODE"] = options["gpus-per-node"]
            environments.append(env)
            rank += 1
    return environments


def run(environments, command, cwd, kill_on_bad_exit):
    """Run every task; the step's exit code (the highest; 128 + N for a task killed by signal N)."""
    tasks = [subprocess.Popen(command, env=env, cwd=cwd) for env in environments]

    def forward(signum, _frame):
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, forward)
    while any(task.poll() is None for task in tasks):
        failed = [task for task in tasks if task.returncode not in (None, 0)]
        if failed and kill_on_bad_exit:
            forward(signal.SIGKILL, None)
        time.sleep(0.05)
    return max((128 - code if code < 0 else code) for code in (task.returncode for task in tasks))


def main():
    options, command = parse(sys.argv[1:])
    if any(key.startswith("container") for key in options):
        sys.exit("srun stand-in: no containers here")
    log_path = os.environ["FAKE_SRUN_LOG"]
    step = step_id(log_path)
    environments = task_environments(options, step)
    training = command[:2] == ["zcpo", "train"] and "--dry-run" not in command
    with open(log_path, "a") as log:
        record = {
            "step": step,
            "job_id": os.environ["SLURM_JOB_ID"],
            "options": options,
            "command": command,
            "tasks": [{key: env.get(key) for key in STEP_VARIABLES} for env in environments],
            "env": {key: os.environ.get(key) for key in JOB_EXPORTS},
        }
        log.write(json.dumps(record) + "\n")
    if training and os.environ.get("FAKE_SRUN_TRAINING") == "record":
        return 0
    return run(environments, command, options.get("chdir"), options.get("kill-on-bad-exit") == "1")


if __name__ == "__main__":
    sys.exit(main())
