"""The demo's job runner: finished runs reused only with the same config; a failed run stops the queue."""

import json

from megatron_zcpo.cli.demo_jobs import DONE_FILE, TrainingJob, run_jobs


def _finished(tmp_path, name: str, config: dict) -> TrainingJob:
    job = TrainingJob(name, tmp_path / name / "seed_1", config)
    job.run_dir.mkdir(parents=True)
    job.config_path.write_text(job.config_text())
    (job.run_dir / DONE_FILE).write_text(json.dumps({"after": 0.5}))
    return job


def test_a_finished_run_is_reused_only_with_the_same_config(tmp_path):
    job = _finished(tmp_path, "zcpo", {"algorithm": {"beta": 4.0}})
    assert job.finished_before()
    assert not TrainingJob("zcpo", job.run_dir, {"algorithm": {"beta": 1.0}}).finished_before()
    (job.run_dir / DONE_FILE).unlink()
    assert not job.finished_before()  # an interrupted run is trained again


def test_reuse_starts_nothing_and_a_failure_stops_the_queue(tmp_path):
    done, lines = [], []
    reused = _finished(tmp_path, "dapo", {"train": {"steps": 1}})
    assert run_jobs([reused], reuse=True, on_done=done.append, log=lines.append) == 0
    assert done == [reused] and "reusing the finished run" in lines[0]
    # A config `zcpo train` rejects at start-up: the run fails at once, and the next one never starts.
    broken = TrainingJob("broken", tmp_path / "broken" / "seed_1", {"algorithm": {"name": "no-such-algorithm"}})
    after = TrainingJob("after", tmp_path / "after" / "seed_1", {"train": {"steps": 1}})
    assert run_jobs([broken, after], at_once=1, on_done=done.append, log=lines.append) != 0
    assert done == [reused] and not after.run_dir.exists()
    assert "broken: training failed" in lines[-1] and broken.log_path.is_file() is False  # one at a time: console
