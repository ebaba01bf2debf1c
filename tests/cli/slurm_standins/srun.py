"""A stand-in for ``srun`` (Slurm 22.05) inside an allocation, for the job shapes one machine cannot host
under the real one-machine Slurm (tests/cli/test_example_jobs_slurm.py): 8 tasks on each of up to 24
"nodes", loopback addresses in the tests, so a task on "node" 127.x.y.5 binds where a real one would.

It holds the differences from a naive launcher that real Slurm showed here (SPEC.md section 7):
- the job's ``SLURM_JOB_NODELIST`` is compressed (``127.0.0.[1-8]``) and the task counts too
  (``SLURM_TASKS_PER_NODE=8(x4)``); inside a step ``SLURM_NODELIST`` is still the job's list, the
  step's is ``SLURM_STEP_NODELIST``; ``SLURM_NNODES`` / ``SLURM_NTASKS`` are the step's;
- a step without ``--ntasks`` / ``--ntasks-per-node`` takes the job's (``SLURM_NTASKS``,
  ``SLURM_NTASKS_PER_NODE`` from ``sbatch --ntasks-per-node``), and more tasks on a node than its
  CPUs allow (``SLURM_CPUS_ON_NODE`` / ``--cpus-per-task``) is refused: "More processors requested
  than permitted";
- a step waits while another step without ``--overlap`` holds one of its nodes, unless it runs with
  ``--overlap`` itself ("Requested nodes are busy");
- a signal reaches every process a task started (its whole process tree, as proctrack does), not
  only the task; SIGTERM to srun kills the tasks (SIGKILL: "forcing job termination"); SIGINT is
  passed on with ``--disable-status``, else it prints the tasks' status and a second one within a
  second kills them; other signals are passed on;
- ``--wait=S``: once a task exited, the others are killed S seconds later.
Options it does not model are refused. Exit code: the highest of the tasks', 128 + N for a task
killed by signal N. Per task (srun(1) "OUTPUT ENVIRONMENT VARIABLES", slurmstepd): SLURM_STEP_ID,
SLURM_NTASKS / SLURM_NPROCS, SLURM_NNODES / SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST,
SLURM_TASKS_PER_NODE / SLURM_STEP_TASKS_PER_NODE, SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID (within
the step), SLURM_GTIDS, SLURMD_NODENAME, SLURM_TOPOLOGY_ADDR, SLURM_CPUS_PER_TASK and
SLURM_GPUS_PER_NODE when asked; SLURM_JOB_NODELIST, SLURM_NODELIST and SLURM_JOB_NUM_NODES keep
describing the whole job. Not modelled: requeue (a real kill and restart under the same job id,
minutes later), which the real cluster's tests cover.

Test controls: every step is appended to ``$FAKE_SRUN_LOG`` (JSON: options, command, each task's
Slurm variables and the job's exports). ``FAKE_SRUN_TRAINING=record`` records the training step
(``zcpo train`` without ``--dry-run``) without running it.
"""

import contextlib
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_zcpo.utils.slurm import parse_slurm_nodelist

STEP_VARIABLES = (
    "SLURM_JOB_ID",
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
# srun's options the job scripts use, with a value or as flags
VALUED = {"nodes", "ntasks", "ntasks-per-node", "nodelist", "chdir", "gpus-per-node", "cpus-per-task", "wait"}
FLAGS = {"overlap", "disable-status"}


def parse(argv):
    """({option: value or True}, command): srun's options come before the command, as --key=value."""
    options, position = {}, 0
    while position < len(argv) and argv[position].startswith("-"):
        key, _, value = argv[position][2:].partition("=")
        if key.startswith("container"):
            sys.exit("srun stand-in: no containers here")
        if not (key in VALUED and value) and not (key in FLAGS and not value):
            sys.exit(f"srun stand-in: option {argv[position]} is not modelled")
        options[key] = value or True
        position += 1
    return options, argv[position:]


def compress_hosts(hosts):
    """Slurm's compressed form of a host list: consecutive numeric suffixes of one prefix as a range."""
    parts = []
    for prefix, group in itertools.groupby(hosts, key=lambda host: re.match(r"(.*?)(\d*)$", host).group(1)):
        numbers = [host[len(prefix) :] for host in group]
        if len(numbers) == 1 or not all(numbers):
            parts += [prefix + number for number in numbers]
            continue
        ranges, start = [], 0
        for index in range(1, len(numbers) + 1):
            if index == len(numbers) or int(numbers[index]) != int(numbers[index - 1]) + 1:
                run = numbers[start:index]
                ranges.append(run[0] if len(run) == 1 else f"{run[0]}-{run[-1]}")
                start = index
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(parts)


def compress_counts(counts):
    """``8(x4)``, ``2,1``: Slurm's form of per-node task counts."""
    parts = []
    for count, group in itertools.groupby(counts):
        repeat = len(list(group))
        parts.append(f"{count}(x{repeat})" if repeat > 1 else str(count))
    return ",".join(parts)


def placement(options):
    """[(node, tasks on it)] of the step; exits with srun's error when the step is not possible."""
    job_nodes = parse_slurm_nodelist(os.environ["SLURM_JOB_NODELIST"])
    if "nodelist" in options:
        nodes = parse_slurm_nodelist(options["nodelist"])
        unknown = [node for node in nodes if node not in job_nodes]
        if unknown:
            sys.exit(f"srun: error: Requested node configuration is not available: {unknown} not in the job")
    else:
        nodes = job_nodes[: int(options.get("nodes", len(job_nodes)))]
    if int(options.get("nodes", len(nodes))) != len(nodes):
        sys.exit(f"srun: error: --nodes={options['nodes']} but --nodelist has {len(nodes)} nodes")
    # the job's task counts are srun's defaults (sbatch exports them)
    tasks = options.get("ntasks", os.environ.get("SLURM_NTASKS"))
    per_node = options.get("ntasks-per-node", os.environ.get("SLURM_NTASKS_PER_NODE"))
    if tasks is None:
        counts = [int(per_node or 1)] * len(nodes)
    else:
        tasks = int(tasks)
        if per_node is not None and int(per_node) * len(nodes) != tasks:
            print(
                f"srun: Warning: can't honor --ntasks-per-node set to {per_node} which doesn't match the requested "
                f"tasks {tasks} with the number of requested nodes {len(nodes)}. Ignoring --ntasks-per-node.",
                file=sys.stderr,
            )
        block = -(-tasks // len(nodes))  # block distribution
        counts = [max(0, min(block, tasks - i * block)) for i in range(len(nodes))]
    cpus_per_task = int(options.get("cpus-per-task", 1))
    if max(counts) * cpus_per_task > int(os.environ.get("SLURM_CPUS_ON_NODE", "1")):
        sys.exit(
            f"srun: error: Unable to create step for job {os.environ['SLURM_JOB_ID']}: "
            "More processors requested than permitted"
        )
    return [(node, count) for node, count in zip(nodes, counts) if count]


def task_environments(options, step):
    layout = placement(options)
    tasks = sum(count for _, count in layout)
    nodes = [node for node, _ in layout]
    tasks_per_node = compress_counts([count for _, count in layout])
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
                SLURM_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                SLURM_STEP_NODELIST=compress_hosts(nodes),
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


def step_id(log_path):
    """The next step id of the job (steps may start at once: ids are claimed by creating a file)."""
    step = 0
    while True:
        try:
            os.close(os.open(f"{log_path}.step{step}", os.O_CREAT | os.O_EXCL))
            return step
        except FileExistsError:
            step += 1


def wait_for_nodes(log_path, step, nodes, overlap):
    """Claim ``nodes`` for this step; without --overlap, first wait until no running step without
    --overlap holds one of them."""
    claims = Path(f"{log_path}.claims")
    claims.mkdir(exist_ok=True)
    mine = claims / f"{step}.json"
    busy_said = False
    while not overlap:
        busy = []
        for claim in claims.glob("*.json"):
            try:
                held = json.loads(claim.read_text())
            except (OSError, ValueError):
                continue
            if not held["overlap"] and _alive(held["pid"]) and set(held["nodes"]) & set(nodes):
                busy.append(claim)
        if not busy:
            break
        if not busy_said:
            print(
                f"srun: Job {os.environ['SLURM_JOB_ID']} step creation temporarily disabled, retrying "
                "(Requested nodes are busy)",
                file=sys.stderr,
            )
            busy_said = True
        time.sleep(0.1)
    mine.write_text(json.dumps({"pid": os.getpid(), "nodes": nodes, "overlap": overlap}))
    return mine


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def process_tree(roots):
    """The PIDs of ``roots`` and of every process descending from them (as proctrack/linuxproc finds them)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, pending = [], list(roots)
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending += children.get(pid, [])
    return found


def run(environments, command, options):
    """Run every task; the step's exit code (the highest; 128 + N for a task killed by signal N)."""
    tasks = [subprocess.Popen(command, env=env, cwd=options.get("chdir")) for env in environments]

    def signal_step(signum):
        for pid in process_tree([task.pid for task in tasks if task.poll() is None]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    last_interrupt = [0.0]

    def handle(signum, _frame):
        if signum == signal.SIGTERM:
            print("srun: forcing job termination", file=sys.stderr)
            signal_step(signal.SIGKILL)
        elif signum == signal.SIGINT and "disable-status" not in options:
            if time.monotonic() - last_interrupt[0] > 1:
                print("srun: interrupt (one more within 1 sec to abort)", file=sys.stderr)
                last_interrupt[0] = time.monotonic()
            else:
                signal_step(signal.SIGKILL)
        else:
            if signum == signal.SIGINT:
                step = environments[0]["SLURM_STEP_ID"]
                print(f"srun: sending Ctrl-C to StepId={os.environ['SLURM_JOB_ID']}.{step}", file=sys.stderr)
            signal_step(signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(signum, handle)
    first_exit = None
    while any(task.poll() is None for task in tasks):
        if first_exit is None and any(task.returncode is not None for task in tasks):
            first_exit = time.monotonic()
        if first_exit is not None and "wait" in options and time.monotonic() - first_exit > int(options["wait"]):
            signal_step(signal.SIGKILL)
        time.sleep(0.05)
    return max((128 - code if code < 0 else code) for code in (task.returncode for task in tasks))


def main():
    options, command = parse(sys.argv[1:])
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
    nodes = sorted({env["SLURMD_NODENAME"] for env in environments})
    claim = wait_for_nodes(log_path, step, nodes, "overlap" in options)
    try:
        return run(environments, command, options)
    finally:
        claim.unlink()


if __name__ == "__main__":
    sys.exit(main())
