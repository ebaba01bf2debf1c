"""Every example's train.sbatch asks for USR1 before the time limit, appends to its log, requeues, and
records a stop signal from its first command (what zcpo_job.sh acts on; the behaviour itself runs
under real Slurm in test_example_jobs_slurm.py)."""

import re
from pathlib import Path

import pytest

from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "common" / "zcpo_job.sh"
RECORD_STOP_SIGNALS = (
    "ZCPO_STOP_SIGNAL=\"\"; trap 'ZCPO_STOP_SIGNAL=${ZCPO_STOP_SIGNAL:-USR1}' USR1; "
    "trap 'ZCPO_STOP_SIGNAL=${ZCPO_STOP_SIGNAL:-TERM}' TERM"
)


@pytest.mark.parametrize("example", sorted(p.parent.name for p in (ROOT / "examples").glob("*/train.sbatch")))
def test_sbatch_requests_the_time_limit_signal_appends_requeues_and_records_stops_first(example):
    script = (ROOT / "examples" / example / "train.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR1@300$", script, re.M)
    assert re.search(r"^#SBATCH --requeue$", script, re.M)
    assert re.search(r"^#SBATCH --open-mode=append$", script, re.M)  # a requeued job's log continues
    commands = [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands[0] == RECORD_STOP_SIGNALS  # before anything a signal could interrupt


def test_the_job_script_requeues_on_the_exit_code_of_a_stopped_run():
    assert f"PREEMPTED_EXIT_CODE={PREEMPTED_EXIT_CODE}" in JOB.read_text()
