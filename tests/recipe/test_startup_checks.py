"""`zcpo train` reports broken files, directories and reward functions before launching anything."""

import time

import pytest

from megatron_zcpo.cli.main import main
from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.recipe.preflight import check_reward_function
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - the fixture is used by name


def test_every_problem_is_named_before_any_process_starts(tmp_path, tiny_model, capsys, monkeypatch):
    monkeypatch.delenv("ZCPO_STARTUP_CHECKED", raising=False)
    blocked = tmp_path / "not_a_dir"
    blocked.write_text("")
    path = write_config(
        tmp_path,
        tiny_model,
        data={"train_files": [str(tmp_path / "missing.jsonl")]},
        reward={"function": "megatron_zcpo.rewards.no_such_module:score"},
        checkpoint={"dir": str(blocked / "ckpt")},
    )
    started = time.monotonic()
    assert main(["train", str(path)]) == 2
    err = capsys.readouterr().err
    assert time.monotonic() - started < 60  # nothing was launched
    assert "start-up checks failed" in err
    assert "data.train_files: DataError: " in err and "missing.jsonl" in err
    assert f"checkpoint.dir: CheckpointWriteError: checkpoint directory {blocked}/ckpt is not writable" in err
    # The reward function is checked on the first record, so with bad data it waits for good data:
    path = write_config(tmp_path, tiny_model, reward={"function": "megatron_zcpo.rewards.no_such_module:score"})
    assert main(["train", str(path)]) == 2
    assert (
        "reward.function: RewardFunctionLoadError: cannot import module 'megatron_zcpo.rewards.no_such_module'"
        in capsys.readouterr().err
    )


def test_reward_function_is_called_once_with_the_scorers_signature():
    record = PromptRecord(uid="a:1", messages=[], answer="7", data_source="a")
    with pytest.raises(TypeError, match=r"calling math:sqrt\(response, ground_truth, metadata\) failed"):
        check_reward_function("math:sqrt", record)
    with pytest.raises(TypeError, match="builtins:print returned None for the first training record"):
        check_reward_function("builtins:print", record)
    assert check_reward_function("megatron_zcpo.rewards.math:dapo_math_reward", record) in (-1.0, 1.0)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"data": {"train_files": ["/no/such/train.jsonl"]}}, "data.train_files: DataError: "),
        (
            {"reward": {"function": "megatron_zcpo.rewards.no_such_module:score"}},
            "reward.function: RewardFunctionLoadError: cannot import module",
        ),
        ({"parallel": {"tensor": 1, "expert": 2}}, "parallel.expert=2, parallel.expert_tensor=None: the qwen2 model"),
        (
            {"rollout": {"max_new_tokens": 120}, "reward": {"max_response_length": 120}},
            "data.max_prompt_length=64 + rollout.max_new_tokens (or eval.max_new_tokens) 120 = 184 tokens is "
            "longer than the model's max_position_embeddings=128",
        ),
    ],
    ids=["missing-data", "reward-import", "experts-on-dense", "too-long"],
)
def test_dry_run_refuses_what_the_start_refuses_and_neither_writes_anything(
    changes,
    message,
    tmp_path,
    tiny_model,
    capsys,
    monkeypatch,
):
    monkeypatch.delenv("ZCPO_STARTUP_CHECKED", raising=False)
    path = write_config(tmp_path, tiny_model, **changes)
    for dry_run in (["--dry-run"], []):
        assert main(["train", str(path), *dry_run]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run").exists()  # neither the run directory nor its checkpoints/


def test_dry_run_in_a_one_task_slurm_step_checks_the_world_nproc_names(tmp_path, tiny_model):
    """A job's check step (srun --ntasks=1) has SLURM_NTASKS=1; --nproc names the training step's world."""
    import os
    import subprocess
    import sys

    path = write_config(tmp_path, tiny_model)  # TP2
    step = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"}
    env = {key: value for key, value in os.environ.items() if not key.startswith(("SLURM_", "RANK", "WORLD_SIZE"))}
    command = [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(path), "--dry-run"]
    alone, named = (
        subprocess.run(command + extra, env={**env, **step}, capture_output=True, text=True, timeout=300)
        for extra in ([], ["--nproc", "4"])
    )
    assert alone.returncode == 2 and "TP*PP*CP = 2*1*1 = 2 must divide the 1 processes" in alone.stderr
    assert named.returncode == 0, named.stderr
    assert "valid on 4 processes: TP2 PP1 CP1 EP1 DP2" in named.stderr


def test_a_code_tool_without_its_sandbox_is_refused_by_dry_run_and_start(tmp_path, tiny_model, capsys, monkeypatch):
    """No silent fallback: without bubblewrap the run does not start, and the message says how to get it."""
    monkeypatch.delenv("ZCPO_STARTUP_CHECKED", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on it
    tools = {"enabled": True, "max_turns": 2, "registry": {"python": {"kind": "code"}}}
    path = write_config(tmp_path, tiny_model, tools=tools)
    for dry_run in (["--dry-run"], []):
        assert main(["train", str(path), *dry_run]) == 2
        err = capsys.readouterr().err
        assert "tools.registry.python: isolation bwrap: bubblewrap ('bwrap') is not installed" in err, err
        assert "apt-get install bubblewrap" in err
        assert not (tmp_path / "run").exists()
