"""rollout.mode=async through the recipe: the keys, a run on the embedded engine whose every token is at most
k versions stale and whose producer resumes from its checkpoint without repeating or skipping a prompt, and a
run against SGLang doubles paused across every push."""

import json

import pytest

from megatron_zcpo.recipe.config import RolloutConfig, build_run_config, read_rollout_mode
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.utils.config_loader import ConfigError, from_dict, validate_tree
from tests.cli.test_train import tiny_model, write_config  # noqa: F401 - tiny_model is a fixture


def test_the_mode_keys_and_their_refusals(tmp_path):
    assert read_rollout_mode({"rollout": {"overlap": True}})["rollout"] == {"mode": "overlap"}
    assert read_rollout_mode({"rollout": {"overlap": False, "mode": "async"}})["rollout"] == {"mode": "async"}
    with pytest.raises(ConfigError, match="rollout.overlap=true and rollout.mode=async disagree"):
        read_rollout_mode({"rollout": {"overlap": True, "mode": "async"}})
    for rollout, message in (
        ({"mode": "streaming"}, "rollout.mode must be one of"),
        ({"mode": "async", "max_staleness": 0}, "rollout.max_staleness must be >= 1 with rollout.mode=async"),
        ({"mode": "async", "on_stale": "keep"}, "rollout.on_stale must be one of"),
    ):
        with pytest.raises(ValueError, match=message):
            validate_tree(from_dict(RolloutConfig, rollout, prefix="rollout"))
    tiny = {
        "model": {"architecture": {"family": "qwen2"}, "tokenizer": str(tmp_path)},
        "logging": {"run_dir": str(tmp_path)},
    }
    config = build_run_config({**tiny, "rollout": {"mode": "async"}})
    assert config.train.importance_sampling.enabled  # on by default off-policy
    with pytest.raises(ValueError, match="does not support tools.enabled .multi-turn. or train.routing_replay"):
        build_run_config({**tiny, "rollout": {"mode": "async"}, "train": {"routing_replay": "experience"}})
    sglang = {"server_urls": ["http://127.0.0.1:1"], "client": {"weight_dir": str(tmp_path)}}
    with pytest.raises(ValueError, match="rollout.mode=async takes model.lora.push=merged"):
        build_run_config(
            {
                **tiny,
                "model": {**tiny["model"], "lora": {"push": "adapter"}},
                "rollout": {"mode": "async", "engine": "sglang", "sglang": sglang},
            }
        )


def test_the_async_push_asks_lost_servers_back_before_it_pauses(monkeypatch):
    """SGLang's /health_generate waits out 20 s while generation is paused: lost servers are asked before the
    pause (the push then brings the healthy ones back and re-syncs them), never during it."""
    from megatron_zcpo.recipe import weight_push
    from megatron_zcpo.recipe.async_mode import AsynchronousRollouts

    calls = []

    class Engine:
        def check_returning_servers(self):
            calls.append("check")

        def pause_generation(self):
            calls.append("pause")

        def continue_generation(self):
            calls.append("continue")

    class Producer:
        def on_push(self, version):
            calls.append(f"on_push {version}")

    monkeypatch.setattr(weight_push, "push_weights", lambda trainer, engine, version, *rest: calls.append("push"))
    rollouts = AsynchronousRollouts(None, None, None, Engine(), None, {})
    rollouts.producer = Producer()
    rollouts.push(3)
    assert calls == ["check", "pause", "push", "continue", "on_push 3"]


def _records(run_dir):
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in lines if "rollout/reward_mean" in r}


def _accounted(record):
    """Every prompt the producer drew is trained, dropped (counted) or still outstanding."""
    dropped = sum(record[f"async/dropped_{why}_total"] for why in ("tied", "invalid", "stale"))
    outstanding = record["async/groups_in_flight"] + record["async/groups_ready"]
    return record["async/admitted_total"] == record["async/taken_total"] + dropped + outstanding


def _three_runs(rank, world, embedded, sglang, model_dir):
    """In one process (the runs' start-up is what costs): an asynchronous run of 3 steps preempted (SIGUSR1)
    during step 2, its resume, and a 2-step run against a mock SGLang 0.5.23 server with continuous
    batching. Returns the modes the server was paused in and its /generate count."""
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from megatron_zcpo.training.preemption import Preempted, PreemptionGuard

    class PreemptedInStep2(PreemptionGuard):
        """A SIGUSR1 (Slurm's time-limit warning) arriving during step 2's update (the third check: start,
        1, 2; the rollout saw no stop request)."""

        checks = 0

        def should_stop(self):
            self.checks += 1
            return "SIGUSR1" if self.checks == 3 else None

    try:
        run_training(load_run_config(str(embedded)), PreemptedInStep2())
        raise AssertionError("the run was not preempted")
    except Preempted as stop:
        assert stop.step == 2
    run_training(load_run_config(str(embedded)))  # resumed at step 2 (checkpoint.resume=auto)
    backend = EmbeddedEngine(model_config_from_hf(read_hf_config(model_dir)), seed=7)
    with MockSGLangServer(backend, release="0.5.23", continuous=True) as server:
        run_training(load_run_config(str(sglang), [f"rollout.sglang.server_urls=[{server.url}]"]))
        return server.pause_modes, sum(path == "/generate" for path, _ in server.events)


def test_async_runs_bound_staleness_resume_their_producer_and_pause_sglang(tmp_path, tiny_model):
    """Embedded: responses up to 24 tokens, the producer a step ahead; staleness <= 1 on every token; a
    preemption during step 2 checkpoints after it the producer's groups and data position, and the resumed
    step 3 goes on from them (its counters continue). SGLang (0.5.23 double): every push pauses the server
    in "retract" mode, and the run trains within the same bound."""
    rollout = {"mode": "async", "max_new_tokens": 24, "prompts_per_step": 3}
    common = dict(parallel={"tensor": 1}, train={"steps": 2}, eval={"at_start": False, "at_end": False})
    embedded_train = {"steps": 3}
    (tmp_path / "embedded").mkdir()
    (tmp_path / "sglang").mkdir()
    # evaluations after steps 1 and 2 score beside the producer (the reward pool serves one thread at a time)
    embedded = write_config(
        tmp_path / "embedded",
        tiny_model,
        rollout=rollout,
        checkpoint={"keep_last": 3},
        **{**common, "train": embedded_train, "eval": {"every": 1, "at_start": False, "at_end": False}},
    )
    # weights through the disk: the server double lives in the trainer's process (no second process group)
    client = {"weight_sync": "disk", "weight_dir": str(tmp_path / "weights"), "max_concurrency": 8}
    sglang = write_config(
        tmp_path / "sglang",
        tiny_model,
        rollout={**rollout, "engine": "sglang", "sglang": {"server_urls": ["http://unset"], "client": client}},
        **common,
    )
    [(pause_modes, generated)] = run_distributed(_three_runs, 1, embedded, sglang, tiny_model, timeout=900)
    from megatron_zcpo.checkpoint.io import read_checkpoint_file

    saved = read_checkpoint_file(tmp_path / "embedded" / "run" / "checkpoints" / "step_00000002", "trainer_state.pt")
    saved = saved["loop"]
    assert "data" not in saved and saved["async"]["version"] == 2  # the producer owns the data position
    counts = saved["async"]["counts"]
    outstanding = len(saved["async"]["ready"]) + len(saved["async"]["in_flight"])
    assert counts["admitted"] == counts["taken"] + outstanding + sum(
        counts[f"dropped_{why}"] for why in ("tied", "invalid", "stale")
    )
    assert (tmp_path / "embedded" / "run" / "eval" / "step_000001.json").exists()
    records = _records(tmp_path / "embedded" / "run")
    assert sorted(records) == [1, 2, 3]
    for step, record in records.items():
        assert record["rollout/staleness_max"] <= 1 and _accounted(record), (step, record)
        assert record["async/taken_total"] == 3 * step
    assert records[3]["async/admitted_total"] >= counts["admitted"]
    assert pause_modes == ["retract"] * 2 and generated >= 2 * 2 * 3  # a pause per step's push (not start-up's)
    for step, record in _records(tmp_path / "sglang" / "run").items():
        assert record["rollout/staleness_max"] <= 1 and _accounted(record), (step, record)
