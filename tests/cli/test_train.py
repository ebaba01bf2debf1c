"""`zcpo train` end to end: config errors named, a TP=2 run over torchrun, checkpoints and resume=auto."""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from megatron_zcpo.cli.main import main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Qwen2 with a trained BPE tokenizer and prompt files (no warm-up)."""
    import dataclasses

    import torch
    from transformers import Qwen2ForCausalLM

    from megatron_zcpo.recipe.demo_assets import DemoSpec, _hf_config, demo_records, train_tokenizer

    spec = dataclasses.replace(DemoSpec(), size=300, vocab_size=300)
    root = tmp_path_factory.mktemp("tiny")
    train, held_out = demo_records(spec, "train"), demo_records(spec, "eval")
    tokenizer = train_tokenizer(spec, train + held_out)
    torch.manual_seed(0)
    Qwen2ForCausalLM(_hf_config(spec, tokenizer)).save_pretrained(root)
    tokenizer.save_pretrained(root)
    for split, records in (("train", train), ("eval", held_out)):
        with open(root / f"{split}.jsonl", "w") as handle:
            for record in records:
                handle.write(json.dumps({"prompt": record.messages[0]["content"], "answer": record.answer}) + "\n")
    return root


def write_config(tmp_path, model_dir, **changes):
    config = {
        "model": {"path": str(model_dir)},
        "parallel": {"tensor": 2},
        "train": {
            "steps": 2,
            "mini_batches": 2,
            "micro_batch_tokens": 256,
            "optimizer": {"lr": 1e-4, "warmup_steps": 0},
        },
        "algorithm": {"name": "zcpo", "beta": 1.0},
        "rollout": {
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "max_new_tokens": 6,
            "dynamic_sampling": {"drop_tied_groups": False},
        },
        "data": {"train_files": [str(model_dir / "train.jsonl")], "max_prompt_length": 64},  # 128 positions
        "eval": {"data": {"train_files": [str(model_dir / "eval.jsonl")]}, "num_prompts": 4, "k": 2},
        "reward": {"num_workers": 1},
        "checkpoint": {"every": 1, "keep_last": 1},
        "logging": {"run_dir": str(tmp_path / "run"), "console": "plain", "tensorboard": False},
    }
    for key, value in changes.items():
        config[key] = {**config.get(key, {}), **value}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_config_errors_name_the_key(tmp_path, tiny_model, capsys):
    path = write_config(tmp_path, tiny_model)
    assert main(["train", str(path), "train.lrr=1"]) == 2
    assert "unknown config key 'train.lrr' (did you mean 'train.lr'" not in capsys.readouterr().err  # lr lives deeper
    assert main(["train", str(path), "train.optimizer.lrr=1"]) == 2
    assert "unknown config key 'train.optimizer.lrr' (did you mean 'lr'?)" in capsys.readouterr().err
    assert main(["train", str(path), "rollout.samples_per_prompt=1"]) == 2
    assert "rollout.samples_per_prompt must be >= 2" in capsys.readouterr().err
    assert main(["train", str(path), "algorithm.kl_loss=k3"]) == 2
    assert "algorithm.kl_loss" in capsys.readouterr().err
    # Context parallelism is checked at start-up, before any process is launched.
    assert main(["train", str(path), "parallel.context=2", "algorithm.agg=seq-mean-token-mean"]) == 2
    assert "algorithm.agg='seq-mean-token-mean'" in capsys.readouterr().err
    assert main(["train", str(path), "parallel.context=2", "train.packing=padded"]) == 2
    assert "parallel.context > 1 needs train.packing = 'thd'" in capsys.readouterr().err


def _train(path, *overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(path), *overrides],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_train_checkpoints_and_resumes(tmp_path, tiny_model):
    path = write_config(tmp_path, tiny_model)
    first = _train(path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = tmp_path / "run"
    assert (run / "checkpoints" / "latest").read_text() == "step_00000002"
    resumed = _train(path, "train.steps=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [r["step"] for r in records if "rollout/reward_mean" in r]
    assert trained == [1, 2, 3]
    # A random model ties most groups (all wrong, gated out), so gradients may be zero; the
    # step still ran experience, calibration and update.
    assert all(
        r["experience/kl"] >= 0 and r["update/grad_norm"] >= 0 and "coef/active_group_fraction" in r
        for r in records
        if "rollout/reward_mean" in r
    )
    evals = sorted(p.name for p in (run / "eval").iterdir())
    assert evals == ["step_000000.json", "step_000002.json", "step_000003.json"]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000003"
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["steps"] == 3


def test_eval_and_plan_on_the_trained_checkpoint(tmp_path, tiny_model, capsys):
    path = write_config(tmp_path, tiny_model, train={"steps": 1}, checkpoint={"every": 1})
    assert _train(path).returncode == 0
    step = tmp_path / "run" / "checkpoints" / "step_00000001"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_zcpo.cli.main",
            "eval",
            str(path),
            "--checkpoint",
            str(step),
            "--output",
            str(tmp_path / "eval.json"),
            "eval.k=3",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["num_problems"] == 4 and saved["num_samples"] == 12
    assert 0.0 <= saved["avg@3"] <= saved["pass@3"] <= 1.0
    assert main(["plan", str(path), "--gpus", "4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["fits"] and plan["suggested"]["fits"]


def _broadcast(rank, world):
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.recipe.rollout import broadcast_samples
    from megatron_zcpo.training.batch import RolloutSample, collate_packed

    setup_megatron()
    samples = [
        RolloutSample([1, 2], [3, 4, 5], 7, 1.0, True, [-0.5, -0.25, -0.1], {"uid": "a"}),
        RolloutSample([9], [8], 8, -1.0, False, None, {}),
        RolloutSample([70000, 6], [5, 4], 9, 0.5, True, [-1.0 / 3, -2.0], {"uid": "c"}),
    ]
    samples[0].routed_experts = torch.arange(16, dtype=torch.int32).reshape(4, 4) % 7  # MoE routing (R3)
    samples[2].routed_experts = torch.full((3, 4), 127, dtype=torch.int32)
    received = broadcast_samples(samples if rank == 0 else None)
    storages = {t.untyped_storage().data_ptr() for s in received for t in (s.prompt_ids, s.response_ids)}
    return {
        "samples": received,
        "token_storages": len(storages),
        "batch": collate_packed(received, [0, 1, 2], 0, 1).tokens,
    }


def test_rollout_broadcast_keeps_tokens_in_tensors_and_round_trips_exactly():
    from megatron_zcpo.testing import run_distributed

    results = run_distributed(_broadcast, 2)
    for result in results:  # the sender rebuilds from the same tensors as the receiver
        received = result["samples"]
        for sample in received:
            for tensor in (sample.prompt_ids, sample.response_ids):
                assert isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int32 and tensor.dim() == 1
        assert result["token_storages"] == 1  # views of one flat token tensor, no per-token objects
        assert [
            (s.prompt_ids.tolist(), s.response_ids.tolist(), s.group_id, s.reward, s.trainable, s.info)
            for s in received
        ] == [
            ([1, 2], [3, 4, 5], 7, 1.0, True, {"uid": "a"}),
            ([9], [8], 8, -1.0, False, {}),
            ([70000, 6], [5, 4], 9, 0.5, True, {"uid": "c"}),
        ]
        assert received[1].rollout_logprobs is None and received[1].routed_experts is None
        assert torch.equal(received[0].routed_experts.int(), torch.arange(16, dtype=torch.int32).reshape(4, 4) % 7)
        assert torch.equal(received[2].routed_experts.int(), torch.full((3, 4), 127, dtype=torch.int32))
        for sample, expected in zip((received[0], received[2]), ([-0.5, -0.25, -0.1], [-1.0 / 3, -2.0])):
            assert sample.rollout_logprobs.dtype == torch.float32
            assert torch.equal(sample.rollout_logprobs, torch.tensor(expected, dtype=torch.float32))
    assert torch.equal(results[0]["batch"], results[1]["batch"])
    assert results[0]["batch"].tolist() == [[1, 2, 3, 4, 9, 70000, 6, 5]]
