"""`zcpo train` through the real SGLang servers (each release directly and through the real sglang-router
0.3.2), with overlap on; and colocated placement's phase machine against a real server's endpoints."""

import json

import pytest

from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.placement import ColocatedPhases, release_for_training
from megatron_zcpo.rollout.sglang.api import PINNED_RELEASE, memory_tags
from megatron_zcpo.testing.real_sglang import PackageUnavailable, RealRouter, router_package
from megatron_zcpo.utils.runtime import free_port
from tests.cli.test_train import _train, write_config
from tests.rollout.sglang.real.test_weights import other_weights


@pytest.mark.parametrize("route", ["direct", "router"])
def test_zcpo_train_two_steps_with_overlap(real_server, release, route, model_dir, tmp_path):
    """Each release straight to its server and through sglang-router 0.3.2. 0.5.3.post3: the disk push (its
    gloo group cannot form on the CPU venv's torch, test_weights.py); 0.5.23: the gloo push in flattened buckets."""
    client = {"api_key": real_server.api_key, "max_concurrency": 4, "request_timeout_s": 300, "router_timeout_s": 600}
    if release == PINNED_RELEASE:
        client.update(weight_sync="disk", weight_dir=str(tmp_path / "weights"))
    else:
        client.update(group_backend="gloo", master_address="127.0.0.1", flattened_buckets=True)
    sglang = {"server_urls": [real_server.url], "client": client}
    rollout = {"engine": "sglang", "overlap": True, "max_new_tokens": 6, "sglang": sglang}
    path = write_config(
        tmp_path,
        model_dir,
        parallel={"tensor": 1},
        rollout=rollout,
        eval={"at_start": False, "at_end": False},
        checkpoint={"every": 0},  # one save, at the end
    )
    if route == "direct":
        done = _train(path)
    else:
        try:
            router_package("0.3.2")
        except PackageUnavailable as error:
            pytest.skip(f"sglang-router 0.3.2 could not be installed: {error}")
        with RealRouter("0.3.2", [real_server.url], free_port(), api_key=real_server.api_key) as router:
            done = _train(path, f"rollout.sglang.router_url={router.url}")
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "rollout/reward_mean" in r}
    assert sorted(steps) == [1, 2] and all("update/grad_norm" in r for r in steps.values())
    assert [steps[s]["rollout/staleness_max"] for s in (1, 2)] == [0.0, 1.0]  # step 2 trained on v0's rollout
    assert "rejected" not in done.stderr
    with real_server.engine() as engine:  # version 1 came before step 2's rollout; nothing generates after step 2
        assert engine.weight_version() == 1


class HostTrainer:
    """The trainer side of the phase machine with nothing on a device (CPU): which parts are offloaded."""

    def __init__(self):
        self.offloaded = set()

    def nbytes(self, parts):
        return 0

    def onload(self, parts):
        self.offloaded -= set(parts)

    def offload(self, parts):
        self.offloaded |= set(parts)


def test_colocated_phases_against_the_real_endpoints(real_server, release, model_dir, monkeypatch):
    """What this checks: the real server takes the phase machine's requests in its order (release all,
    resume weights, pause, a tensor push, continue, resume the rest), none of them refused or fatal (a
    resume of a tag not released, or a release while a request runs, kills it), and generates with each
    pushed version afterwards. What it does not: that memory is freed or comes back (a CPU server runs
    without --enable-memory-saver, CUDA only: its releases and resumes only move SGLang's bookkeeping and
    the weights' static state), CUDA IPC handles, the cuda_graph tag's graphs, a release that frees late."""
    with real_server.engine(weight_sync="tensor", max_concurrency=1) as engine:
        monkeypatch.setattr(engine, "memory_tags", lambda: memory_tags(release))  # what --enable-memory-saver reports
        release_for_training(engine)
        trainer = HostTrainer()
        phases = ColocatedPhases(trainer, engine)
        outputs = []
        for step in (1, 2):
            phases.to_update()
            engine.update_weights(other_weights(model_dir, seed=10 + step).items(), step)
            phases.to_generate()
            [[completion]] = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=6))
            assert completion.weight_version == step and completion.finish_reason in ("length", "stop")
            outputs.append(completion.output_ids)
            phases.to_train()
        assert phases.history == ["train"] + ["update", "generate", "train"] * 2 and not trainer.offloaded
        phases.to_update()  # the server ends with its memory resumed (other tests share it)
        phases.to_generate()
    assert real_server.alive() and outputs[0] != outputs[1]
