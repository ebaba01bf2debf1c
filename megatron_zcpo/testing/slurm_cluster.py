"""A real Slurm cluster on one machine, for tests and trials of the job scripts: Debian's Slurm 22.05
(``slurmctld``, several ``slurmd -N``) and munge, everything under one directory, stopped by PID.

Nodes are loopback addresses of a random ``127.a.b.0/24`` (node names are the addresses, as on
clusters whose node names resolve), each ``slurmd`` on its own port, with ``gres/gpu`` backed by
character devices (no GPU is used: the tasks see ``CUDA_VISIBLE_DEVICES`` and Slurm's variables)
and as many CPUs as asked (``SlurmdParameters=config_overrides``: more than the host has).
``proctrack/linuxproc`` and ``task/none``: a signal to a step reaches every process the step
started, as cgroups do on a real cluster. Timers are short (``KillWait``, and a requeued job starts
again after ``cred_expire`` seconds instead of 120). Ports, paths, the munge key and the job ids
are this instance's own, so several clusters run side by side on one machine.

Install the packages with ``tools/install_slurm.sh`` (root, Debian), then::

    python -m megatron_zcpo.testing.slurm_cluster up /tmp/cluster --nodes 4   # prints SLURM_CONF=...
    SLURM_CONF=/tmp/cluster/slurm.conf sbatch --nodes=2 --gpus-per-node=2 ...
    python -m megatron_zcpo.testing.slurm_cluster down /tmp/cluster
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

from megatron_zcpo.utils.runtime import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
DAEMONS = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "scancel", "squeue")
# Every process of a cluster (daemons, slurmstepd, the jobs of the cluster's sbatch) carries it in
# its environment: down() finds the ones left behind by it, never by a program's name.
MARKER_ENV = "ZCPO_SLURM_CLUSTER"
PIDS_FILE = "daemons.pids"


class SlurmUnavailable(RuntimeError):
    """Slurm's or munge's programs are not installed."""


def missing_programs() -> List[str]:
    """The programs of :data:`DAEMONS` not on PATH (or in /usr/sbin)."""
    search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in DAEMONS if shutil.which(name, path=search) is None]


def _program(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or name


class SlurmCluster:
    """``nodes`` slurmd of ``cpus_per_node`` CPUs and ``gpus_per_node`` GPUs under ``root``.

    ``start()`` (or ``with``) brings it up and waits until every node is idle; ``stop()`` cancels the
    jobs, stops the daemons by their PIDs and ends whatever the cluster's jobs left running.
    ``env()`` is the environment a client command (``sbatch``, ``scontrol``) needs.
    """

    def __init__(
        self,
        root: os.PathLike | str,
        nodes: int = 4,
        cpus_per_node: int = 8,
        gpus_per_node: int = 2,
        *,
        kill_wait_s: int = 5,
        requeue_delay_s: int = 5,
    ):
        self.root = Path(root).absolute()
        self.subnet = f"127.{random.randrange(16, 250)}.{random.randrange(1, 250)}"
        self.nodes = [f"{self.subnet}.{n}" for n in range(1, nodes + 1)]
        self.cpus_per_node, self.gpus_per_node = cpus_per_node, gpus_per_node
        self.kill_wait_s, self.requeue_delay_s = kill_wait_s, requeue_delay_s
        self.conf = self.root / "slurm.conf"
        self.pids: Dict[str, int] = {}

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def env(self, base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        """``base`` (default: this process's environment) with the cluster's config and marker."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf), MARKER_ENV: str(self.root)}

    def start(self, timeout_s: float = 60.0) -> None:
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(
                f"{', '.join(missing)} not installed: tools/install_slurm.sh installs {' '.join(PACKAGES)} (Debian, root)"
            )
        for directory in ("munge", "state", "log", "spool", "dev"):
            (self.root / directory).mkdir(parents=True, exist_ok=True)
        try:
            self._start_munge()
            self._write_config()
            self._spawn("slurmctld", [_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for node in self.nodes:
                (self.root / "spool" / node).mkdir(exist_ok=True)
                self._spawn(f"slurmd-{node}", [_program("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
            self._wait_until_idle(timeout_s)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Cancel every job, stop the daemons (SIGTERM, then SIGKILL) and end the cluster's leftovers."""
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"]):
            jobs = self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
            if jobs:
                self.run(["scancel", *jobs], check=False)
                deadline = time.monotonic() + self.kill_wait_s + 15
                while self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.split():
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
        for name in sorted(self.pids, key=lambda name: name != "munged"):  # munged last: slurmd's RPCs need it
            _end(self.pids[name])
        for pid in _processes_with_marker(str(self.root)):
            _end(pid, grace_s=0)
        self.pids.clear()
        _write_pids(self.root, self.pids)

    # ------------------------------------------------------------------ clients
    def run(self, command: Sequence[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """A client command (``scontrol ...``) against this cluster; its output as text."""
        done = subprocess.run(
            [_program(command[0]), *command[1:]], env=self.env(), capture_output=True, text=True, **kwargs
        )
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def sbatch(self, args: Sequence[str], env: Mapping[str, str], cwd: os.PathLike | str) -> str:
        """Submit ``sbatch ARGS`` with the job environment ``env`` (the cluster's added); the job id."""
        done = subprocess.run(
            [_program("sbatch"), "--parsable", *args], env=self.env(env), cwd=cwd, capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> Dict[str, str]:
        """``scontrol show job``'s fields of ``job_id`` (JobState, Restarts, ExitCode, BatchHost, ...)."""
        text = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(token.split("=", 1) for token in text.split() if "=" in token)

    def wait_for_job(self, job_id: str, states: Sequence[str], timeout_s: float, poll_s: float = 1.0) -> Dict[str, str]:
        """Poll until the job's state is one of ``states``; its fields. TimeoutError naming the state."""
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} still {fields.get('JobState')} after {timeout_s:g} s, not in {states}"
                )
            time.sleep(poll_s)

    # ------------------------------------------------------------------ set-up
    def _start_munge(self) -> None:
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge.chmod(0o755)  # the socket's directory: clients (the jobs' scontrol) connect through it
        self._spawn(
            "munged",
            [
                _program("munged"),
                "--foreground",
                "--force",  # root, and a key this directory's owner wrote
                f"--socket={munge / 'socket'}",
                f"--key-file={key}",
                f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}",
                f"--seed-file={munge / 'munged.seed'}",
            ],
        )
        deadline = time.monotonic() + 10
        while not (munge / "socket").exists():
            if time.monotonic() > deadline or not _alive(self.pids["munged"]):
                raise RuntimeError(f"munged did not start: {(self.root / 'log' / 'munged.out').read_text()}")
            time.sleep(0.05)

    def _write_config(self) -> None:
        root, gpus = self.root, self.gpus_per_node
        for index in range(gpus):
            device = root / "dev" / f"gpu{index}"
            if not device.exists():
                os.mknod(device, 0o666 | 0o020000, os.makedev(1, 3))  # a character device (as /dev/null)
        lines = [
            f"ClusterName=zcpo{random.randrange(10**6)}",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire: also the delay before a requeued job may start again (default 120 s)
            f"AuthInfo=socket={root / 'munge' / 'socket'},cred_expire={self.requeue_delay_s}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}/%n",
            f"SlurmctldPidFile={root / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "GresTypes=gpu",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # more CPUs and GPUs than the host has
            f"KillWait={self.kill_wait_s}",
            "JobRequeue=1",
            "MinJobAge=3600",  # an ended job stays visible to scontrol
            f"FirstJobId={random.randrange(1000, 10**6)}",  # another cluster's jobs have other ids (MASTER_PORT)
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
        ]
        for node in self.nodes:
            lines.append(
                f"NodeName={node} NodeAddr={node} Port={free_port()} CPUs={self.cpus_per_node} "
                f"RealMemory=4000 Gres=gpu:{gpus} State=UNKNOWN"
            )
        lines.append("PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        devices = f"{root / 'dev'}/gpu[0-{gpus - 1}]" if gpus > 1 else f"{root / 'dev'}/gpu0"
        (root / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.subnet}.[1-{len(self.nodes)}] Name=gpu File={devices}\n"
        )

    def _spawn(self, name: str, command: List[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as output:
            process = subprocess.Popen(
                command, stdout=output, stderr=subprocess.STDOUT, env=self.env(), start_new_session=True
            )
        self.pids[name] = process.pid
        _write_pids(self.root, self.pids)

    def _wait_until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states: List[str] = []
        while time.monotonic() < deadline:
            dead = [name for name, pid in self.pids.items() if not _alive(pid)]
            if dead:
                logs = "\n".join((self.root / "log" / f"{name}.out").read_text()[-2000:] for name in dead)
                raise RuntimeError(f"{', '.join(dead)} exited while starting:\n{logs}")
            done = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
            states = done.stdout.split()[1::2]
            if done.returncode == 0 and len(states) == len(self.nodes) and set(states) == {"idle"}:
                return
            time.sleep(0.5)
        raise TimeoutError(f"the nodes are not idle after {timeout_s:g} s: {states}; see {self.root / 'log'}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _end(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid``, SIGKILL it if it is still there after ``grace_s``, and reap it if it is ours."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    return
            except ChildProcessError:  # not our child: poll it
                if not _alive(pid):
                    return
            time.sleep(0.05)


def _processes_with_marker(root: str) -> List[int]:
    """PIDs whose environment holds ``MARKER_ENV=root`` (this cluster's daemons, steps and jobs)."""
    needle = f"{MARKER_ENV}={root}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:  # exited, or not ours to read
            continue
    return found


def _write_pids(root: Path, pids: Mapping[str, int]) -> None:
    (root / PIDS_FILE).write_text("".join(f"{name} {pid}\n" for name, pid in pids.items()))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="start a cluster under DIR and print its SLURM_CONF")
    up.add_argument("dir")
    up.add_argument("--nodes", type=int, default=4)
    up.add_argument("--cpus-per-node", type=int, default=8)
    up.add_argument("--gpus-per-node", type=int, default=2)
    down = commands.add_parser("down", help="stop the cluster under DIR (its daemons by PID, its jobs)")
    down.add_argument("dir")
    args = parser.parse_args(argv)
    if args.command == "up":
        cluster = SlurmCluster(args.dir, args.nodes, args.cpus_per_node, args.gpus_per_node)
        cluster.start()
        print(f"SLURM_CONF={cluster.conf}  nodes {cluster.nodes[0]}..{cluster.nodes[-1]}")
        return 0
    cluster = SlurmCluster(args.dir)
    pids_file = Path(args.dir) / PIDS_FILE
    if not pids_file.exists():
        print(f"no cluster under {args.dir}", file=sys.stderr)
        return 1
    cluster.pids = {name: int(pid) for name, pid in (line.split() for line in pids_file.read_text().splitlines())}
    cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
