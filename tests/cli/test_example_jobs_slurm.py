"""The example job under a real Slurm on this machine (megatron_zcpo/testing/slurm_cluster.py: Debian's
Slurm 22.05, several slurmd, fake GPUs), through real sbatch, scaled down as test_example_jobs.py scales
it (the tiny model, 2 "GPUs" per node, TP2, the mock SGLang server and router). Three jobs at once,
sharing one checkpoint directory, which all three convert at the same time (the first complete one
stays):

- a plain run submitted with ``--ntasks-per-node=8`` (a site default or habit the job's steps must
  not inherit), trained to the end;
- a run that gets TERM on every process (the batch shell and every step's processes) while its
  servers start, requeues itself; then USR1 on the batch shell (the time limit's
  ``--signal=B:USR1@300``) after a periodic checkpoint, stops after the step in progress with a
  checkpoint, requeues itself; then runs to the end;
- a run whose every process gets TERM after a periodic checkpoint (the steps' processes, as at the
  start of a preemption's grace time: the ranks' helper processes too, and the ranks save again after
  it; and the batch shell, which must not turn it into a kill of the training step), requeues itself
  and runs to the end.

Each stop ends with the run resumed from its newest checkpoint, no step lost or repeated, nothing
half-written, the whole log in one file, and no process of the job left behind.
"""

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from megatron_zcpo.testing.slurm_cluster import MARKER_ENV, SlurmCluster, missing_programs
from tests.cli.test_train import tiny_model  # noqa: F401 - the fixture is used by name

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).resolve().parent / "slurm_standins"
STEPS = 8
# The tiny model on 2 CPU "GPUs" per node (as test_example_jobs.TINY_RUN), STEPS steps, a checkpoint
# every 2; each generate call answers after 1 s (the mock server's --generate-delay-s), so that a
# signal sent when a checkpoint appears lands in the step after it.
TINY_RUN = (
    "model.preset=null parallel.tensor=2 data.max_prompt_length=64 rollout.max_new_tokens=6 "
    "reward.max_response_length=6 reward.overlong_buffer=2 rollout.prompts_per_step=4 "
    "rollout.samples_per_prompt=2 rollout.dynamic_sampling.drop_tied_groups=false train.mini_batches=2 "
    f"train.micro_batch_tokens=256 train.steps={STEPS} train.bf16=false eval.every=0 eval.at_start=false "
    "eval.at_end=false reward.num_workers=1 logging.tensorboard=false rollout.sglang.client.max_concurrency=8 "
    "rollout.sglang.client.group_backend=gloo checkpoint.every=2"
)
TIMEOUT_S = 900
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY")

needs_slurm = pytest.mark.skipif(
    bool(missing_programs()) and not os.environ.get("ZCPO_REQUIRE_SLURM"),
    reason=f"Slurm is not installed ({', '.join(missing_programs())}): tools/install_slurm.sh",
)
pytestmark = needs_slurm


def job_environment(tmp: Path, model_dir: Path, ckpt: Path, run_dir: Path) -> dict:
    """What the user sets for the job (nothing else from this environment leaks in)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "sglang-python").write_text(
        f'#!/bin/bash\nexec {sys.executable} {STAND_INS / "sglang_python.py"} "$@"\n'
    )
    (bin_dir / "sglang-python").chmod(0o755)
    (tmp / "venv" / "bin").mkdir(parents=True)
    (tmp / "venv" / "bin" / "activate").write_text("")  # this interpreter's directory is on PATH instead
    return dict(
        PATH=f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        HOME=os.environ.get("HOME", str(tmp)),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        VENV=str(tmp / "venv"),
        HF_MODEL=str(model_dir),
        MEGATRON_CKPT=str(ckpt),
        RUN_DIR=str(run_dir),
        TRAIN_DATA=str(model_dir / "train.jsonl"),
        EVAL_DATA=f"{model_dir / 'eval.jsonl'},{model_dir / 'eval.jsonl'}",
        TRAIN_NODES="1",
        ROLLOUT_TP="2",
        SGLANG_PYTHON=str(bin_dir / "sglang-python"),
        SGLANG_NODE_ARGS="--extra-args=--generate-delay-s=1",
        SGLANG_STARTUP_TIMEOUT="300",
        SGLANG_HEALTH_POLL_S="0.5",
        ZCPO_OVERRIDES=TINY_RUN,
    )


class Job:
    """One submitted job: its id, output file, run directory, and the stops sent to it."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, model_dir: Path, ckpt: Path, sbatch_args=()):
        self.cluster, self.run_dir, self.ckpt = cluster, tmp / "run", ckpt
        env = job_environment(tmp, model_dir, ckpt, self.run_dir)
        args = ["--nodes=2", "--gpus-per-node=2", f"--output={tmp}/job-%j.out", *sbatch_args]
        self.id = cluster.sbatch([*args, "examples/qwen2.5-32b-zcpo/train.sbatch"], env, cwd=ROOT)
        self.output = tmp / f"job-{self.id}.out"
        self.sent: list = []  # (restart, signal, step of the newest checkpoint when sent)
        self.final: dict = {}  # scontrol's fields once ended

    def log(self) -> str:
        return _read(self.output)

    def latest_step(self) -> int:
        latest = self.run_dir / "checkpoints" / "latest"
        return int(latest.read_text().split("_")[1]) if latest.exists() else 0

    def logged_steps(self) -> list:
        return (
            [record["step"] for record in step_records(self.run_dir)]
            if (self.run_dir / "metrics.jsonl").exists()
            else []
        )

    def signal(self, restart: int, name: str, batch_shell: bool, steps: bool) -> None:
        if batch_shell:
            self.cluster.run(["scancel", f"--signal={name}", "--batch", self.id])
        if steps:  # every process of every step (proctrack), not the batch shell
            self.cluster.run(["scancel", f"--signal={name}", self.id])
        self.sent.append((restart, name, self.latest_step()))


def in_attempt(job: Job, restart: int) -> str:
    """The job's log since restart ``restart`` began ("" before)."""
    log = job.log()
    if restart == 0:
        return log
    marker = f"restart {restart} of job"
    return log.split(marker, 1)[1] if marker in log else ""


def servers_starting(job: Job, restart: int) -> bool:
    """This attempt's SGLang step has started its processes (the first attempt's: the log is new)."""
    return "SGLang processes on this node" in _read(job.run_dir / "sglang_step.log")


class StepAfterANewCheckpoint:
    """Ready once the attempt trained the step after a periodic checkpoint it wrote itself: a stop
    requested then comes after that checkpoint and before (or during) the next save, which the stop
    needs. The attempt's first checkpoint is the newest one when its log begins."""

    def __init__(self):
        self.start = None

    def __call__(self, job: Job, restart: int) -> bool:
        if self.start is None:
            if not in_attempt(job, restart):
                return False
            self.start = job.latest_step()
        return any(step - 1 > self.start and (step - 1) % 2 == 0 for step in job.logged_steps())


def drive(jobs_and_stops, deadline: float) -> None:
    """Send each job its stops, in order, each once its condition holds in the attempt it names."""
    pending = {job.id: list(stops) for job, stops in jobs_and_stops}
    jobs = {job.id: job for job, _ in jobs_and_stops}
    polls = 0
    while any(pending.values()):
        for job_id, stops in pending.items():
            if not stops:
                continue
            restart, ready, signal_name, batch_shell, steps = stops[0]
            if ready(jobs[job_id], restart):
                jobs[job_id].signal(restart, signal_name, batch_shell, steps)
                stops.pop(0)
        polls += 1
        if polls % 10 == 0:  # a job that ended before its stops came: its log says why
            for job_id, stops in pending.items():
                state = jobs[job_id].cluster.job(job_id).get("JobState")
                assert not stops or state not in ENDED, f"job {job_id} {state}:\n{jobs[job_id].log()}"
        assert time.monotonic() < deadline, {job_id: (stops, jobs[job_id].log()) for job_id, stops in pending.items()}
        time.sleep(0.2)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.fixture(scope="module")
def finished_jobs(tmp_path_factory, tiny_model):
    """The three jobs, run to their end at once on one 6-node cluster: {name: Job}, each with the
    processes of it still running after it ended."""
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=6, cpus_per_node=8, gpus_per_node=2) as cluster:
        ckpt = tmp_path_factory.mktemp("converted") / "ckpt"
        jobs = {
            "plain": Job(cluster, tmp_path_factory.mktemp("plain"), tiny_model, ckpt, ["--ntasks-per-node=8"]),
            "stopped": Job(cluster, tmp_path_factory.mktemp("stopped"), tiny_model, ckpt),
            "preempted": Job(cluster, tmp_path_factory.mktemp("preempted"), tiny_model, ckpt),
        }
        deadline = time.monotonic() + TIMEOUT_S
        drive(
            [
                (
                    jobs["stopped"],
                    [
                        (0, servers_starting, "TERM", True, True),
                        (1, StepAfterANewCheckpoint(), "USR1", True, False),
                    ],
                ),
                (jobs["preempted"], [(0, StepAfterANewCheckpoint(), "TERM", True, True)]),
            ],
            deadline,
        )
        for job in jobs.values():
            job.final = cluster.wait_for_job(job.id, ENDED, max(deadline - time.monotonic(), 1))
            job.leftovers = _processes_of_job(cluster, job.id)
        yield jobs


def _processes_of_job(cluster: SlurmCluster, job_id: str) -> list:
    """Processes still running with the job's id and this cluster's marker in their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0") if entry.name.isdigit() else []
        except OSError:
            continue
        if f"{MARKER_ENV}={cluster.root}".encode() in environ and f"SLURM_JOB_ID={job_id}".encode() in environ:
            found.append((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def step_records(run_dir: Path) -> list:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "rollout/reward_mean" in record]


def assert_nothing_half_written(run_dir: Path, ckpt: Path) -> None:
    from megatron_zcpo.checkpoint.verify import verify_checkpoint

    checkpoints = run_dir / "checkpoints"
    leftovers = [p.name for p in checkpoints.iterdir() if p.name.endswith((".tmp", ".discarded", ".damaged"))]
    assert not leftovers and not list(ckpt.parent.glob("*.partial*")), leftovers
    kept = sorted(p for p in checkpoints.iterdir() if p.name.startswith("step_"))
    assert kept and kept[-1].name == f"step_{STEPS:08d}"
    for checkpoint in kept:
        assert verify_checkpoint(checkpoint, full=True)["manifest"]  # every file against its manifest


def assert_stopped_and_resumed(job: Job, restarts: int) -> list:
    """The job completed after ``restarts`` requeues, one attempt after the other in its one log, each
    resumed from the checkpoint the one before stopped at; trained every step once, in one run; left
    nothing half-written and no process behind. The attempts' logs."""
    log = job.log()
    assert (job.final["JobState"], job.final["Restarts"], job.final["ExitCode"]) == (
        "COMPLETED",
        str(restarts),
        "0:0",
    ), log
    attempts = re.split(r"\n(?=\S+ \S+ restart \d+ of job)", log)  # each requeued attempt's first line
    assert len(attempts) == restarts + 1 and "training finished" in attempts[-1], log
    for restart, attempt in enumerate(attempts[1:], 1):
        assert f"restart {restart} of job {job.id}" in attempt and f"(restart {restart})" in attempts[restart - 1]
    stops = sorted({int(s) for s in re.findall(r"stopped at step (\d+) after SIG", log)})  # printed by every rank
    resumes = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", log)]
    assert stops == resumes and all(step < STEPS for step in stops), (stops, resumes, job.sent)
    records = step_records(job.run_dir)
    assert [record["step"] for record in records] == list(range(1, STEPS + 1))
    assert len({record["run_id"] for record in records}) == 1
    assert_nothing_half_written(job.run_dir, job.ckpt)
    assert not job.leftovers, job.leftovers
    return attempts


def test_a_job_submitted_with_ntasks_per_node_converts_serves_and_trains_to_the_end(finished_jobs):
    job = finished_jobs["plain"]
    attempts = assert_stopped_and_resumed(job, restarts=0)
    assert job.final["NtasksPerN:B:S:C"].startswith("8:"), job.final  # what every step would have inherited
    assert "More processors requested" not in attempts[0]
    assert _read(job.run_dir / "sglang_step.log").count("srun: sending Ctrl-C") == 1  # the servers' clean stop
    # all three jobs converted into the one directory at once: one rename won, the others used it
    logs = "".join(other.log() for other in finished_jobs.values())
    assert logs.count("converting ") == 3 and logs.count("was converted by another job meanwhile") == 2


def test_term_while_the_servers_start_then_usr1_after_a_checkpoint_each_requeue_the_job(finished_jobs):
    job = finished_jobs["stopped"]
    attempts = assert_stopped_and_resumed(job, restarts=2)
    assert [(restart, name) for restart, name, _ in job.sent] == [(0, "TERM"), (1, "USR1")]
    # the first: before training, the servers stopped, nothing trained, no checkpoint
    assert "TERM: stopping before training" in attempts[0] and "stopping the SGLang servers" in attempts[0]
    assert "training: zcpo train" not in attempts[0] and "resumed from" not in attempts[1]
    # the second: after the periodic checkpoint, the step in progress completed and saved, or (its rollout
    # abandoned) the checkpoint of the step before it kept
    stop = int(re.search(r"stopped at step (\d+) after SIGUSR1", attempts[1]).group(1))
    assert "USR1: training stops at its next safe point" in attempts[1] and stop >= job.sent[1][2] > 0
    servers = _read(job.run_dir / "sglang_step.log")  # TERM reached the SGLang step: it kept serving
    assert servers.count("sglang_node: received SIGTERM") == 1 and servers.count("srun: sending Ctrl-C") == 3


def test_term_to_every_process_after_a_checkpoint_stops_the_ranks_after_their_step_with_another(finished_jobs):
    job = finished_jobs["preempted"]
    attempts = assert_stopped_and_resumed(job, restarts=1)
    assert [(restart, name) for restart, name, _ in job.sent] == [(0, "TERM")]
    # the ranks and their helpers (the checkpoint Manager that wrote the periodic checkpoint, the
    # resource tracker, reward workers) got TERM; the ranks saved once more (or, the step's rollout
    # abandoned, kept the checkpoint of the step before) and exited 75
    stop = int(re.search(r"stopped at step (\d+) after SIGTERM", attempts[0]).group(1))
    assert stop >= job.sent[0][2] > 0 and "training stopped at a checkpoint (exit 75)" in attempts[0]
    assert "TERM: training stops at its next safe point" in attempts[0]  # the batch shell: no kill of the step
    servers = _read(job.run_dir / "sglang_step.log")
    assert servers.count("sglang_node: received SIGTERM") == 1 and servers.count("srun: sending Ctrl-C") == 2
