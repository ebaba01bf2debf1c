"""`zcpo train` with rollout.placement=colocated on a CPU: against the mock SGLang server's memory saver and
with the embedded engine, the same losses as disaggregated, exact resume, the refusals."""

import os
import subprocess
import sys

import pytest

from megatron_zcpo.recipe.config import RolloutConfig, _derived_defaults, build_run_config
from megatron_zcpo.utils.config_loader import from_dict, validate_tree
from tests.cli.test_train import _train, tiny_model, write_config  # noqa: F401 - tiny_model is a fixture
from tests.recipe.test_overlap import _deterministic_keys, _metrics_by_step


def _mock(model_dir):
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from megatron_zcpo.utils.runtime import free_port

    backend = EmbeddedEngine(model_config_from_hf(read_hf_config(model_dir)), seed=7)
    # per-request seeds: the rollout does not depend on the order the requests arrive in
    return MockSGLangServer(backend, port=free_port(), deterministic_inference=True, memory_saver=True)


def _config(root, model_dir, rollout, steps=2, pipeline=1):
    root.mkdir(exist_ok=True)
    return write_config(
        root,
        model_dir,
        parallel={"tensor": 1, "pipeline": pipeline},
        rollout=rollout,
        train={"steps": steps},
        eval={"at_start": False, "at_end": False},
    )


def _losses(run_dir):
    logged = _metrics_by_step(run_dir)
    return {step: {k: metrics[k] for k in _deterministic_keys(metrics)} for step, metrics in logged.items()}


def test_colocated_sglang_run_follows_the_memory_saver_phases_and_matches_disaggregated(tmp_path, tiny_model):
    """At PP2: disaggregated, each stage pushes its share over its own group; colocated, the stages stream
    to rank 0, which pushes through the disk between the phases. Same rollouts, same losses."""
    client = {"group_backend": "gloo", "master_address": "127.0.0.1", "max_concurrency": 4, "sampling_seeds": True}
    runs = {}
    for placement in ("disaggregated", "colocated"):
        with _mock(tiny_model) as server:
            path = _config(
                tmp_path / placement,
                tiny_model,
                {"engine": "sglang", "sglang": {"server_urls": [server.url], "client": client}},
                pipeline=2,
            )
            done = _train(path, f"rollout.placement={placement}")
            assert done.returncode == 0, done.stderr[-3000:]
            runs[placement] = _losses(tmp_path / placement / "run")
            events = [
                (path, detail)
                for path, detail in server.events
                if path not in ("/health_generate", "/get_server_info", "/get_model_info")
            ]
        if placement == "colocated":
            assert all(detail == "ok" for _, detail in events), events  # no request out of phase
            memory = [path for path, _ in events if "memory" in path or "update_weights" in path or path == "/generate"]
            # start-up: release, resume weights, push, resume the KV cache; then per step generate,
            # release, resume weights, push, resume KV (and a checkpoint's release, push and resume)
            assert memory[:4] == [
                "/release_memory_occupation",
                "/resume_memory_occupation",
                "/update_weights_from_disk",
                "/resume_memory_occupation",
            ]
            assert "/generate" in memory and server.memory.released == set()
            assert server.served_version == "2"
    assert sorted(runs["colocated"]) == sorted(runs["disaggregated"]) == [1, 2]
    for step, metrics in runs["disaggregated"].items():
        assert {"rollout/reward_mean", "experience/kl", "update/grad_norm"} <= set(metrics)
        assert runs["colocated"][step] == metrics, step


def test_colocated_embedded_run_is_preempted_with_a_checkpoint_and_resumes_exactly(tmp_path, tiny_model):
    from megatron_zcpo.testing import run_distributed
    from tests.cases.colocation_cases import preempted_run

    whole = _config(tmp_path / "whole", tiny_model, {"placement": "colocated"}, steps=2)
    done = _train(whole)
    assert done.returncode == 0, done.stderr[-3000:]
    # stopped (SIGUSR1) after step 1 with no periodic checkpoint: the preemption's own save, colocated
    split = _config(tmp_path / "split", tiny_model, {"placement": "colocated"}, steps=2)
    split.write_text(split.read_text().replace("every: 1", "every: 0"))
    assert run_distributed(preempted_run, 1, split, timeout=600) == [1]
    resumed = _train(split)
    assert resumed.returncode == 0 and "at step 1" in resumed.stdout, resumed.stderr[-3000:]
    assert _losses(tmp_path / "split" / "run")[2] == _losses(tmp_path / "whole" / "run")[2]


@pytest.mark.parametrize(
    ("rollout", "message"),
    [
        ({"placement": "shared"}, "rollout.placement must be one of"),
        ({"placement": "colocated", "mode": "overlap"}, "set rollout.mode=sync"),
        ({"placement": "colocated", "mode": "async"}, "rollout.mode=async generates while the trainer trains"),
        (
            {
                "placement": "colocated",
                "engine": "sglang",
                "sglang": {"server_urls": ["http://x"], "client": {"weight_sync": "distributed"}},
            },
            "use 'tensor'",
        ),
        (
            {
                "placement": "colocated",
                "engine": "sglang",
                "sglang": {"launch": {"model_path": "m", "enable_memory_saver": False}},
            },
            "enable_memory_saver=false",
        ),
    ],
)
def test_colocated_refusals_name_the_key(rollout, message):
    with pytest.raises(ValueError, match=message):
        validate_tree(from_dict(RolloutConfig, rollout, prefix="rollout"))


def test_colocated_offloads_the_reference_and_refuses_keeping_it_resident(tmp_path):
    assert _derived_defaults({"rollout": {"placement": "colocated"}})["train"]["reference_offload"] is True
    assert "reference_offload" not in _derived_defaults({}).get("train", {})
    told = {"rollout": {"placement": "colocated"}, "train": {"reference_offload": False}}
    tiny = {
        "model": {"architecture": {"family": "qwen2"}, "tokenizer": str(tmp_path)},
        "logging": {"run_dir": str(tmp_path)},
    }
    with pytest.raises(ValueError, match="train.reference_offload=false with rollout.placement=colocated"):
        build_run_config({**tiny, **told})


def test_a_colocated_tensor_push_comes_from_every_rank_and_the_run_ends_cleanly(tmp_path, tiny_model):
    """`zcpo train` at TP2 beside a server at TP2 with weight_sync=tensor (the GPU default, forced on a CPU):
    both ranks walk the whole model and hand the server rank on their GPU a handle of their own bucket
    (the two blobs of every post must hold the same bucket), and the run closes its share engines cleanly."""
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from megatron_zcpo.utils.runtime import free_port

    backend = EmbeddedEngine(model_config_from_hf(read_hf_config(tiny_model)), seed=7)
    client = {"weight_sync": "tensor", "bucket_bytes": 50_000, "max_concurrency": 4}
    with MockSGLangServer(backend, port=free_port(), memory_saver=True, tp_size=2) as server:
        path = write_config(
            tmp_path,
            tiny_model,
            rollout={
                "engine": "sglang",
                "placement": "colocated",
                "sglang": {"server_urls": [server.url], "client": client},
            },
            train={"steps": 1},
            eval={"at_start": False, "at_end": False},
        )
        # output to a file, not a pipe: torch's shared-memory manager, started by the ranks for the CPU handles,
        # inherits the run's stdout and lives while this process (the mock) holds handles it served
        log = tmp_path / "train.log"
        with open(log, "w") as out:
            env = {**{k: v for k, v in os.environ.items() if k != "RANK"}, "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(path)]
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600)
        assert done.returncode == 0, log.read_text()[-3000:]
        posts = [detail for path_, detail in server.events if path_ == "/update_weights_from_tensor"]
        assert len(posts) > 2 and set(posts) == {"ok"}  # several buckets per push, each taken
        assert server.crashed is None and server.served_version == "1" and not server.memory.released


def test_a_colocated_tensor_push_comes_from_every_gpu_and_needs_the_whole_model_on_each_rank(tmp_path):
    from megatron_zcpo.recipe.weight_push import GPUWeightPush, stage_weight_push

    tiny = {
        "model": {"architecture": {"family": "qwen2"}, "tokenizer": str(tmp_path)},
        "logging": {"run_dir": str(tmp_path)},
    }
    client = {"weight_sync": "tensor", "bucket_bytes": 1000}
    rollout = {
        "rollout": {"placement": "colocated", "engine": "sglang", "sglang": {"server_urls": ["u"], "client": client}}
    }
    assert stage_weight_push(build_run_config({**tiny, **rollout}), None, None) == GPUWeightPush(1000, None)
    with pytest.raises(ValueError, match="with parallel.pipeline > 1 or parallel.expert > 1 no rank holds it"):
        build_run_config({**tiny, **rollout, "parallel": {"pipeline": 2}})
