"""Overlapped rollouts (rollout.overlap): the prefetch thread, bounded staleness, exact resume, and
with overlap off the loop is the plain sequential one, bit for bit."""

import json
import threading
import time

import pytest

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.overlap import RolloutPrefetch, in_flight_state, staleness_metrics
from megatron_zcpo.testing import run_distributed
from tests.cli.test_train import _train, tiny_model, write_config  # noqa: F401 - tiny_model is a fixture


def test_prefetch_collects_in_the_background_and_reports_waits():
    running = threading.Event()

    def collect(step):
        running.set()
        time.sleep(0.3)
        return [step], {"step": float(step)}

    prefetch = RolloutPrefetch(collect)
    (samples, metrics), waited = prefetch.take(0)  # nothing in flight: collected now
    assert samples == [0] and waited >= 0.25
    prefetch.launch(1)
    assert running.wait(5) and prefetch.pending_step == 1
    time.sleep(0.35)  # "training" while step 1 is generated
    (samples, _), waited = prefetch.take(1)
    assert samples == [1] and waited < 0.1  # it was ready
    time.sleep(0.05)
    prefetch.launch(2)
    assert prefetch.engine_wait_s >= 0.05
    with pytest.raises(RuntimeError, match="step 2 is still pending"):
        prefetch.launch(3)
    assert in_flight_state(prefetch) == {"step": 2, "samples": [2], "metrics": {"step": 2.0}}
    restored = RolloutPrefetch(collect)
    restored.restore(2, ([2], {"step": 2.0}))
    assert restored.take(2)[0] == ([2], {"step": 2.0})
    prefetch.close()


def test_prefetch_raises_the_collectors_error_in_the_caller():
    def collect(step):
        raise RolloutError(f"server gone at step {step}")

    prefetch = RolloutPrefetch(collect)
    prefetch.launch(4)
    with pytest.raises(RolloutError, match="server gone at step 4"):
        prefetch.take(4)
    assert prefetch.pending_step is None


def test_staleness_is_measured_and_bounded():
    assert staleness_metrics([3, 3, 2], trainer_version=4, max_staleness=2) == {
        "rollout/staleness_mean": 4 / 3,
        "rollout/staleness_max": 2.0,
    }
    with pytest.raises(RolloutError, match=r"versions \[1, 3\].*max_staleness=1"):
        staleness_metrics([3, 1], trainer_version=3, max_staleness=1)
    with pytest.raises(RolloutError, match="weight_version"):
        staleness_metrics([None], trainer_version=0, max_staleness=1)


def _metrics_by_step(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in records if "rollout/reward_mean" in r}


def _deterministic_keys(metrics):
    """The metrics that depend on the data and the weights, not on the clock."""
    return [
        k
        for k, v in metrics.items()
        if isinstance(v, float) and k not in ("time", "step") and not k.startswith(("time/", "train/tokens_per_s"))
    ]


def _run_training(rank, world, path):
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training

    run_training(load_run_config(str(path)))


def _plain_sequential_loop(rank, world, path):
    """The on-policy recipe written out: collect, train, push; nothing else."""
    from megatron_zcpo.diagnostics import build_diagnostics
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.inputs import load_tokenizer, resolve_model
    from megatron_zcpo.recipe.rollout import Rollout, broadcast_samples
    from megatron_zcpo.recipe.weight_push import push_weights
    from megatron_zcpo.training.trainer import PolicyTrainer

    config = load_run_config(str(path))
    setup_megatron(tensor_parallel=1, pipeline_parallel=1, context_parallel=1, seed=config.train.seed)
    tokenizer = load_tokenizer(config)
    model_config, initial = resolve_model(config.model.path)
    trainer = PolicyTrainer(
        model_config,
        config.algorithm,
        config.train,
        config.parallel,
        initial_weights=initial,
        temperature=config.rollout.temperature,
        diagnostics=build_diagnostics(config.diagnostics, config.algorithm),
    )
    rollout = Rollout(config, model_config, tokenizer)
    push_weights(trainer, rollout.engine, 0)
    steps = {}
    for step in range(config.train.steps):
        samples, stats = rollout.collect(step)
        metrics = trainer.train_step(broadcast_samples(samples))
        push_weights(trainer, rollout.engine, trainer.step)
        steps[trainer.step] = {**metrics, **stats}
    rollout.close()
    return steps


def test_overlap_off_is_the_sequential_loop_bit_for_bit(tmp_path, tiny_model):
    path = write_config(
        tmp_path, tiny_model, parallel={"tensor": 1}, eval={"at_start": False, "at_end": False}, checkpoint={"every": 0}
    )
    run_distributed(_run_training, 1, path, timeout=600)
    [reference] = run_distributed(_plain_sequential_loop, 1, path, timeout=600)
    logged = _metrics_by_step(tmp_path / "run")
    assert sorted(logged) == sorted(reference) == [1, 2]
    for step, metrics in reference.items():
        keys = [k for k in _deterministic_keys(metrics) if k in logged[step]]
        assert {"rollout/reward_mean", "experience/kl", "update/grad_norm"} <= set(keys)
        for key in keys:
            assert logged[step][key] == metrics[key] or metrics[key] != metrics[key], (step, key)  # exact (NaN aside)
        assert "rollout/staleness_max" not in logged[step]


def _overlapped_run(root, model_dir, steps, *overrides):
    """`zcpo train` with rollout.overlap=true in ``root`` (TP1, no evaluation); its stdout."""
    root.mkdir(exist_ok=True)
    path = write_config(
        root,
        model_dir,
        parallel={"tensor": 1},
        rollout={"overlap": True},
        train={"steps": steps},
        eval={"at_start": False, "at_end": False},
    )
    done = _train(path, *overrides)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_overlapped_run_is_one_step_off_policy_and_resumes_exactly(tmp_path, tiny_model):
    whole = tmp_path / "whole"
    _overlapped_run(whole, tiny_model, 3)
    uninterrupted = _metrics_by_step(whole / "run")
    assert [uninterrupted[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all("time/wait_for_data" in m and "time/engine_wait_for_weights" in m for m in uninterrupted.values())
    dumped = (whole / "run" / "config.yaml").read_text()
    assert "mode: overlap" in dumped and "importance_sampling:\n    enabled: true" in dumped  # on by default here

    split = tmp_path / "split"
    _overlapped_run(split, tiny_model, 2)
    assert "at step 2" in _overlapped_run(split, tiny_model, 2, "train.steps=3")
    interrupted = _metrics_by_step(split / "run")
    keys = _deterministic_keys(uninterrupted[3])
    assert {"rollout/reward_mean", "experience/kl", "update/grad_norm", "rollout/staleness_max"} <= set(keys)
    for key in keys:  # step 3 trains on the rollout the step-2 checkpoint recorded in flight
        assert interrupted[3][key] == uninterrupted[3][key] or uninterrupted[3][key] != uninterrupted[3][key], key


def test_overlapped_sglang_run_pushes_per_stage_at_pp2(tmp_path, tiny_model):
    """`zcpo train` at PP2 against a mock SGLang server, overlap on: each stage's lead joins its own
    weight-update group and pushes its share, and the rollouts are one version behind."""
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from megatron_zcpo.utils.runtime import free_port

    backend = EmbeddedEngine(model_config_from_hf(read_hf_config(tiny_model)), seed=7)
    with MockSGLangServer(backend, port=free_port()) as server:
        client = {"group_backend": "gloo", "master_address": "127.0.0.1", "max_concurrency": 4}
        path = write_config(
            tmp_path,
            tiny_model,
            parallel={"tensor": 1, "pipeline": 2},
            rollout={"overlap": True, "engine": "sglang", "sglang": {"server_urls": [server.url], "client": client}},
            train={"steps": 2},
            eval={"at_start": False, "at_end": False},
        )
        done = _train(path)
        assert done.returncode == 0, done.stderr[-3000:]
        events = [path for path, _ in server.events]
    assert events.count("/init_weights_update_group") == 2  # one group per pipeline stage
    # start-up (version 0), then version 1 before generating step 2's rollout; version 2 stays in
    # the checkpoint (nothing generates after the last step, no evaluation asked)
    assert server.served_version == "1"
    logged = _metrics_by_step(tmp_path / "run")
    assert [logged[s]["rollout/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
