"""The demo's training runs as ``zcpo train`` processes: several at once, each with its own log, finished ones reused.

Every run is its own ``zcpo train`` process tree (torchrun and ``parallel.tensor`` ranks), so runs
share nothing but the cached model and data files: running them at once changes no number. With
one run at a time the run's console goes to the terminal; with several each run writes
``<run_dir>.log`` and the terminal gets a line per start and finish.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, List, Optional, Sequence

import yaml

DONE_FILE = "summary.json"  # written into a run's directory once it finished and was summarised


@dataclass
class TrainingJob:
    """One training run: its (fresh) ``run_dir``, the full run config as a plain dict, a display name,
    and once it finished, its wall time (NaN when reused)."""

    name: str
    run_dir: Path
    config: dict
    wall_s: float = math.nan

    @property
    def config_path(self) -> Path:
        return self.run_dir.with_suffix(".yaml")

    @property
    def log_path(self) -> Path:
        return self.run_dir.with_suffix(".log")

    def config_text(self) -> str:
        return yaml.safe_dump(self.config, sort_keys=False)

    def finished_before(self) -> bool:
        """Whether ``run_dir`` holds this very run already: summarised (DONE_FILE) with the same config."""
        return (
            (self.run_dir / DONE_FILE).is_file()
            and self.config_path.is_file()
            and self.config_path.read_text() == self.config_text()
        )


def run_jobs(
    jobs: Sequence[TrainingJob],
    at_once: int = 1,
    reuse: bool = False,
    on_done: Optional[Callable[[TrainingJob], None]] = None,
    log: Callable[[str], None] = print,
) -> int:
    """Run ``jobs`` in order, at most ``at_once`` at a time; returns 0 or the first failure's exit code.

    reuse: skip a job whose run directory holds the same finished run (TrainingJob.finished_before);
    otherwise its directory is emptied first. on_done(job) is called in the parent for each job as
    it finishes successfully (and for each reused job), in finishing order. After a failure no
    new job starts and the running ones are waited for; an interrupt (Ctrl-C) reaches the runs
    too (same process group), and this waits for them to stop.
    """
    if at_once < 1:
        raise ValueError(f"at_once must be >= 1, got {at_once}")
    pending = list(jobs)
    running: List[tuple] = []
    failure = 0
    try:
        while pending or running:
            while pending and len(running) < at_once and not failure:
                job = pending.pop(0)
                if reuse and job.finished_before():
                    log(f"{job.name}: reusing the finished run in {job.run_dir}")
                    if on_done:
                        on_done(job)
                    continue
                running.append((job, *_start(job, quiet=at_once > 1, log=log)))
            if not running:
                break
            finished = _wait_any(running)
            job, process, handle, started = finished
            running.remove(finished)
            if handle is not None:
                handle.close()
            code = process.returncode
            if code:
                log(
                    f"[red]{job.name}: training failed (exit code {code})"
                    + (f"; its log: {job.log_path}" if handle is not None else "")
                )
                failure = failure or code
            else:
                job.wall_s = time.perf_counter() - started
                log(f"{job.name}: finished in {job.wall_s:.0f} s")
                if on_done:
                    on_done(job)
            if failure:
                pending.clear()
    finally:
        for _job, process, handle, _ in running:  # only after an interrupt or an error here
            process.wait()
            if handle is not None:
                handle.close()
    return failure


def _start(job: TrainingJob, quiet: bool, log: Callable[[str], None]):
    """Start ``zcpo train`` for ``job`` in a fresh run directory: (process, log handle or None, start time)."""
    shutil.rmtree(job.run_dir, ignore_errors=True)
    job.run_dir.mkdir(parents=True)
    job.config_path.write_text(job.config_text())
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank: a second one costs more than it gains here
    handle: Optional[IO] = open(job.log_path, "w") if quiet else None  # noqa: SIM115 -- closed when the job ends
    tensor = (job.config.get("parallel") or {}).get("tensor", 1)
    log(
        f"[bold]{job.name}[/bold]: training with {job.config_path} ({tensor} process(es))"
        + (f", log {job.log_path}" if quiet else "")
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(job.config_path)],
        stdout=handle,
        stderr=subprocess.STDOUT if quiet else None,
        env=env,
    )
    return process, handle, time.perf_counter()


def _wait_any(running: List[tuple]) -> tuple:
    """The first of the running jobs to finish (polls every 0.2 s; the runs take minutes)."""
    while True:
        for entry in running:
            if entry[1].poll() is not None:
                return entry
        time.sleep(0.2)
