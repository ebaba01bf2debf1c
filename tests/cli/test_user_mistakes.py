"""Issue 25's user mistakes, typed as a user types them (`zcpo ...` in a subprocess): each gets an early
answer naming the file, line or key and the fix, and nothing on disk is lost.

One finished 2-step run (one process, no launcher) is shared by the module; each test works on a
copy. Only two tests start training processes beyond it: a resume (set-up only) and the launcher's
report of a failing rank (two ranks, one rollout).
"""

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cli.test_examples import EXAMPLES
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - the fixture is used by name

NO_EVAL = {"at_start": False, "at_end": False}
ONE_PROCESS = {"parallel": {"tensor": 1}, "eval": NO_EVAL, "checkpoint": {"every": 1, "keep_last": 3}}


def _start(args):
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ZCPO_STARTUP_CHECKED"):
        environment.pop(name, None)
    return subprocess.Popen(
        [sys.executable, "-m", "megatron_zcpo.cli.main", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment,
    )


def zcpo_all(*commands):
    """Run several independent ``zcpo`` commands at once (both cores of a CI machine); their results in order."""
    processes = [_start(command) for command in commands]
    results = []
    for command, process in zip(commands, processes):
        stdout, stderr = process.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    return results


def zcpo(*args):
    """Run ``zcpo ARGS`` as a fresh process, as a user would."""
    return zcpo_all(args)[0]


def snapshot(directory: Path) -> dict:
    """{relative path: sha256} of every file under ``directory``."""
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model):
    """A finished run of 2 steps with checkpoints step_00000001 and step_00000002."""
    root = tmp_path_factory.mktemp("trained")
    done = zcpo("train", write_config(root, tiny_model, **ONE_PROCESS))
    assert done.returncode == 0, done.stderr[-3000:]
    return root / "run"


def copy_of(trained, tmp_path, model, **changes):
    """The config of a copy of the trained run, in ``tmp_path/run``."""
    shutil.copytree(trained, tmp_path / "run")
    return write_config(tmp_path, model, **{**ONE_PROCESS, **changes})


def run_id(run_dir):
    return (run_dir / "run_id").read_text().strip()


@pytest.mark.parametrize(
    "damaged,manifests",
    [("weights/__0_0.distcp", True), ("trainer_state.pt", False)],
    ids=["truncated-shard", "truncated-trainer-state-no-manifest"],
)
def test_a_damaged_checkpoint_is_named_kept_and_the_run_resumes_from_the_newest_intact_one(
    trained, tmp_path, tiny_model, damaged, manifests
):
    path = copy_of(trained, tmp_path, tiny_model)
    checkpoints = tmp_path / "run" / "checkpoints"
    if not manifests:  # checkpoints written before manifests existed still resume, with a note
        for manifest in checkpoints.glob("step_*/manifest.json"):
            manifest.unlink()
    victim = checkpoints / "step_00000002" / damaged
    os.truncate(victim, victim.stat().st_size // 2)
    before = snapshot(checkpoints / "step_00000002"), snapshot(checkpoints / "step_00000001")
    done = zcpo("train", path, "train.steps=1")  # resumes at step 1: set-up only, no step to train
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        f"checkpoint {checkpoints / 'step_00000002'} is damaged: {damaged}" in done.stderr
        and "moved aside to step_00000002.damaged (kept, not deleted); resuming from step_00000001 instead"
        in done.stderr
    ), done.stderr[-3000:]
    assert f"resumed from {checkpoints / 'step_00000001'} at step 1" in done.stdout
    assert ("written before checkpoints had manifests" in done.stdout) is not manifests
    assert (snapshot(checkpoints / "step_00000002.damaged"), snapshot(checkpoints / "step_00000001")) == before


def test_checkpoint_verify_names_what_is_damaged_without_training(trained, tmp_path, tiny_model):
    copy_of(trained, tmp_path, tiny_model)
    checkpoints = tmp_path / "run" / "checkpoints"
    state = checkpoints / "step_00000002" / "trainer_state.pt"
    os.truncate(state, 100)
    shard = checkpoints / "step_00000001" / "weights" / "__0_1.distcp"
    with open(shard, "r+b") as handle:  # one byte changed, the size kept: only a checksum sees it
        handle.seek(4000)
        byte = handle.read(1)
        handle.seek(4000)
        handle.write(bytes([byte[0] ^ 0xFF]))
    before = snapshot(checkpoints)
    full = zcpo("checkpoint", "verify", tmp_path / "run")
    assert full.returncode == 1
    assert "step_00000001: DAMAGED: weights/__0_1.distcp: crc32 " in full.stdout
    assert "step_00000002: DAMAGED: trainer_state.pt: 100 bytes, but its manifest records " in full.stdout
    quick = zcpo("checkpoint", "verify", "--quick", checkpoints / "step_00000001")
    assert quick.returncode == 0 and "step_00000001: intact (step 1, run " in quick.stdout
    assert snapshot(checkpoints) == before


def test_resume_never_into_a_run_is_refused_and_overwrite_replaces_it(trained, tmp_path, tiny_model):
    path = copy_of(trained, tmp_path, tiny_model)
    run_dir = tmp_path / "run"
    old_id, before = run_id(run_dir), snapshot(run_dir)
    refused = zcpo("train", path, "checkpoint.resume=never")
    assert refused.returncode == 2
    assert (
        f"logging.run_dir={run_dir} already holds run {old_id}: metrics.jsonl" in refused.stderr
        and "checkpoints step_00000001, step_00000002" in refused.stderr
        and "pass --overwrite to delete the old run" in refused.stderr
    ), refused.stderr
    assert snapshot(run_dir) == before
    replaced = zcpo("train", path, "checkpoint.resume=never", "train.steps=1", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert "--overwrite: deleting the run in" in replaced.stderr
    new_id = run_id(run_dir)
    assert new_id != old_id
    records = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["run_id"] for r in records} == {new_id} and {r["step"] for r in records} == {1}
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_00000001"]
    assert f'"run_id": "{new_id}"' in (run_dir / "checkpoints" / "step_00000001" / "manifest.json").read_text()


def test_a_checkpoint_of_another_run_is_refused(trained, tmp_path, tiny_model):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_id").write_text("another-run\n")
    path = write_config(tmp_path, tiny_model, **{**ONE_PROCESS, "checkpoint": {"dir": str(trained / "checkpoints")}})
    before = snapshot(trained)
    refused = zcpo("train", path)
    assert refused.returncode == 2
    assert (
        f"checkpoint {trained / 'checkpoints' / 'step_00000002'} belongs to run {run_id(trained)}, but "
        f"logging.run_dir={tmp_path / 'run'} holds run another-run: runs never mix" in refused.stderr
    ), refused.stderr
    assert snapshot(trained) == before


def test_a_layout_a_rank_would_refuse_is_refused_by_dry_run_plan_and_train_alike(tmp_path, tiny_model):
    path = write_config(tmp_path, tiny_model, eval=NO_EVAL)
    message = (
        "parallel.tensor=3 must divide the model's num_attention_heads=4 and num_key_value_heads=2 and "
        "intermediate_size=256 (parallel.tensor may be 1, 2)"
    )
    *refusals, batches, ranks, preset = zcpo_all(
        ("train", path, "parallel.tensor=3", "--dry-run"),
        ("plan", path, "parallel.tensor=3"),
        ("train", path, "parallel.tensor=3"),
        ("train", path, "train.mini_batches=8", "--dry-run"),
        ("train", path, "--nproc", "16", "--dry-run"),  # DP 8, but a mini-batch holds 4 responses
        ("train", path, "model.preset=Qwen3-4B", "--dry-run"),
    )
    for done in refusals:
        assert done.returncode != 0 and message in done.stderr, (done.args, done.stderr[-2000:])
    assert not [p for p in tmp_path.joinpath("run").rglob("*") if p.is_file()]  # refused before anything was written
    assert batches.returncode == 2
    assert "train.mini_batches=8 is more than the rollout's rollout.prompts_per_step=4 groups" in batches.stderr
    assert ranks.returncode == 2
    assert (
        "each of the train.mini_batches=2 mini-batches holds 4 responses (rollout.prompts_per_step=4 x "
        "rollout.samples_per_prompt=2) but the 8 data-parallel ranks need one each" in ranks.stderr
    ), ranks.stderr
    assert (
        preset.returncode == 2
        and f"model.preset='Qwen3-4B' does not describe model.path='{tiny_model}'" in preset.stderr
    )


def test_a_reward_that_fails_on_most_answers_stops_the_run_and_the_launcher_says_so_once(tmp_path, tiny_model):
    """Passes the start-up probe, then raises on every real answer: the run stops after the first
    rollout with the reward's own error, the count and an input; the launcher prints the failing
    rank's error last and once (not torchrun's table, not every rank's traceback)."""
    path = write_config(
        tmp_path,
        tiny_model,
        eval=NO_EVAL,
        train={"steps": 1},
        reward={"function": "tests.rewards.scripted_rewards:fails_unless_exact"},
    )
    done = zcpo("train", path)
    assert done.returncode == 1
    err = done.stderr
    assert err.count("zcpo train: rank 0 of 2 failed first") == 1, err[-4000:]
    assert (
        err.count("failed on 8 of the 8 responses of step 0's rollout (100%, above reward.max_failed_fraction=0.1)")
        == 1
    )
    assert "ground truth '" in err and err.rstrip().splitlines()[-1] == "KeyError: 'no boxed answer'"
    assert "dynamic sampling" not in err and "Root Cause" not in err and "[rank1]" not in err
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))  # no checkpoint of made-up rewards


def test_an_empty_data_file_a_yaml_error_and_a_missing_step_are_named(trained, tmp_path, tiny_model):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    (tmp_path / "a").mkdir()
    empty_data = write_config(tmp_path / "a", tiny_model, **ONE_PROCESS, data={"train_files": [str(empty)]})
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n train: {steps: 2}\n")
    before = snapshot(trained)
    empty_data, syntax, done = zcpo_all(
        ("train", empty_data),
        ("train", bad),
        (
            "eval",
            write_config(tmp_path, tiny_model, **ONE_PROCESS),
            "--checkpoint",
            trained / "checkpoints" / "step_00000009",
        ),
    )
    assert empty_data.returncode == 2
    assert f"data.train_files: DataError: {empty}: the file holds no records" in empty_data.stderr
    assert syntax.returncode == 2 and len(syntax.stderr.splitlines()) <= 4, syntax.stderr
    assert f"{bad}:3:2: YAML syntax error" in syntax.stderr
    assert done.returncode == 2
    assert (
        f"step_00000009 does not exist; the checkpoints under {trained / 'checkpoints'} are step_00000001, "
        "step_00000002" in done.stderr
    ), done.stderr
    assert snapshot(trained) == before


def test_plan_of_a_tiny_model_prints_real_numbers(trained, tiny_model, tmp_path):
    done = zcpo("plan", write_config(tmp_path, tiny_model))
    assert done.returncode == 0, done.stderr
    assert "0.000B" not in done.stdout and " 0 s" not in done.stdout
    assert "K parameters, TP2 PP1" in done.stdout and "K parameters on the GPU; fits" in done.stdout
    step = done.stdout.split("predicted step ")[1].split(" (")[0]
    # a tiny model's step is the push's fixed cost (planning/transitions.py) plus milliseconds of work
    assert step.endswith((" s", " ms", " us")) and float(step.split()[0]) > 0, step


def test_every_example_plans_as_shipped():
    examples = sorted(EXAMPLES.glob("*/config.yaml"))
    for done in zcpo_all(*(("plan", example) for example in examples)):
        assert done.returncode == 0, (done.args, done.stderr)
        assert "B parameters on the GPU; fits." in done.stdout and "predicted step" in done.stdout
