"""The examples' sbatch scripts ask for USR1 before the time limit, pass it to training, and requeue on exit 75."""

import re
import subprocess
from pathlib import Path

import pytest

from megatron_zcpo.training.preemption import PREEMPTED_EXIT_CODE

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "examples" / "common" / "zcpo_job.sh"


@pytest.mark.parametrize("example", sorted(p.parent.name for p in (ROOT / "examples").glob("*/train.sbatch")))
def test_sbatch_requests_the_time_limit_signal_and_requeueing(example):
    header = (ROOT / "examples" / example / "train.sbatch").read_text()
    assert re.search(r"^#SBATCH --signal=B:USR1@300$", header, re.M)
    assert re.search(r"^#SBATCH --requeue$", header, re.M)


def test_job_script_passes_usr1_to_training_and_reads_its_exit_code():
    text = JOB.read_text()
    assert f"PREEMPTED_EXIT_CODE={PREEMPTED_EXIT_CODE}" in text and 'scontrol requeue "${SLURM_JOB_ID}"' in text
    # A stand-in for the training srun that exits 75 once it receives USR1; the batch shell gets USR1.
    script = f"""
set -euo pipefail
log() {{ echo "$*"; }}
source <(sed -n '/^PREEMPTED_EXIT_CODE=/,$p' {JOB})
bash -c 'trap "exit 75" USR1; for i in $(seq 300); do sleep 0.1; done; exit 0' &
training=$!
( sleep 1; kill -USR1 $$ ) &
wait_for_training $training
echo "exit=$TRAINING_EXIT_CODE"
"""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["USR1: training stops after its current step", f"exit={PREEMPTED_EXIT_CODE}"]
