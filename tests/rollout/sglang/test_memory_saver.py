"""Colocated placement against the mock server's memory saver: the protocol, its ledger, the faults, the
tensor transport and the phase machine (rollout/placement.py)."""

import time

import pytest
import torch

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.memory import MemoryLedger, MemoryPhaseError
from megatron_zcpo.rollout.placement import ColocatedPhases, release_for_training
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.rollout.sglang.http import SGLangHTTPError
from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import flattened_buckets
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

PARAMS = SamplingParams(max_new_tokens=3)
TENSORS = [
    ("a.weight", torch.arange(6.0).reshape(2, 3)),
    ("b.weight", torch.ones(4)),
    ("c.bias", torch.tensor([7], dtype=torch.int64)),
]


def _engine(server, **overrides):
    return SGLangEngine(_config(server.url, weight_sync="tensor", max_rejected_fraction=0.0, **overrides))


def _post(server, path, body):
    import json
    import urllib.error
    import urllib.request

    request = urllib.request.Request(server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


def test_phases_in_order_work_and_out_of_order_requests_fail():
    with MockSGLangServer(ScriptedEngine(), memory_saver=True) as server, _engine(server) as engine:
        assert engine.memory_tags() == ("weights", "kv_cache")  # 0.5.3.post3: no cuda_graph tag
        engine.generate([[5]], PARAMS)
        engine.release_memory(["weights", "kv_cache"])
        with pytest.raises(RolloutError, match="released"):
            engine.generate([[5]], PARAMS)  # generating into freed memory
        with pytest.raises(SGLangHTTPError, match="released"):
            engine.update_weights(iter(TENSORS), 1)  # loading weights into freed memory
        with pytest.raises(SGLangHTTPError, match="resumed but not released"):
            engine.resume_memory(["kv_cache"]), engine.resume_memory(["kv_cache"])
        engine.release_memory(["kv_cache"])
        engine.resume_memory(["weights"])
        engine.pause_generation()
        engine.update_weights(iter(TENSORS), 1)
        with pytest.raises(SGLangHTTPError, match=r"continue_generation while \['kv_cache'\] released"):
            engine.continue_generation()  # the parked and the next requests would run on the freed KV cache
        engine.resume_memory(["kv_cache"])
        engine.continue_generation()
        assert engine.generate([[5]], PARAMS)[0][0].weight_version == 1
        assert {name: t.tolist() for name, t in server.backend.received.items()} == {
            name: t.tolist() for name, t in TENSORS
        }


def test_the_newest_release_has_the_cuda_graph_tag_and_refuses_a_release_while_requests_run():
    with MockSGLangServer(ScriptedEngine(), memory_saver=True, release="0.5.23") as server, _engine(server) as engine:
        assert engine.memory_tags() == ("weights", "kv_cache", "cuda_graph")
        server.running_rids.add("straggler")
        assert _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]}) == 400
        engine.release_memory(None)  # the client flushes first: the lost request is aborted, then released
        assert server.memory.released == {"weights", "kv_cache", "cuda_graph"}
        engine.resume_memory(["weights"])
        engine.pause_generation()  # 0.5.23 wants a body here (its mode), 0.5.3.post3 none
        assert server.paused and engine.paused
        engine.resume_memory(["kv_cache", "cuda_graph"])
        engine.continue_generation()
        assert server.memory.released == set() and not server.paused and not engine.paused


def test_a_resume_answered_with_502_is_retried():
    with MockSGLangServer(ScriptedEngine(), memory_saver=True, faults={"/resume_memory_occupation": ["502"]}) as server:
        with _engine(server) as engine:
            engine.release_memory(None)
            engine.resume_memory(None)
        assert [d for p, d in server.events if p == "/resume_memory_occupation"] == ["502", "ok"]
        assert not server.memory.released


def test_a_server_dying_mid_update_leaves_the_rotation_and_the_others_serve_the_version():
    faults = {"/update_weights_from_tensor": ["die"]}
    with (
        MockSGLangServer(ScriptedEngine(), memory_saver=True, faults=faults) as dying,
        MockSGLangServer(ScriptedEngine(), memory_saver=True) as alive,
    ):
        config = _config(dying.url, weight_sync="tensor", max_retries=1, bucket_bytes=16)
        config.server_urls = [dying.url, alive.url]
        with SGLangEngine(config) as engine:
            engine.release_memory(None)
            engine.resume_memory(["weights"])
            engine.update_weights(iter(TENSORS), 3)
            engine.resume_memory(["kv_cache"])
            assert engine.served_weight_versions() == {alive.url: 3}
        assert dying.dead and alive.backend.version == 3


def test_tensor_buckets_are_flattened_per_dtype_and_size():
    buckets = list(flattened_buckets(iter(TENSORS), bucket_bytes=24, device="cpu"))
    assert [[m.name for m in meta] for _, meta in buckets] == [["a.weight"], ["b.weight"], ["c.bias"]]
    buckets = list(flattened_buckets(iter(TENSORS), bucket_bytes=1024, device="cpu"))
    assert [[m.name for m in meta] for _, meta in buckets] == [["a.weight", "b.weight"], ["c.bias"]]
    flat, meta = buckets[0]
    assert flat[meta[1].start_idx : meta[1].end_idx].tolist() == [1.0] * 4 and meta[0].shape == (2, 3)


class LedgerTrainer:
    """A trainer's state that books its bytes in the GPU ledger the mock server books in (the device's memory)."""

    def __init__(self, ledger, sizes):
        self.ledger, self.sizes, self.offloaded = ledger, sizes, set(sizes)

    def nbytes(self, parts):
        return sum(self.sizes[p] for p in parts)

    def onload(self, parts):
        for part in parts:
            if part in self.offloaded:
                self.ledger.book(0, "trainer", part, self.sizes[part])
                self.offloaded.discard(part)

    def offload(self, parts):
        for part in parts:
            if part not in self.offloaded:
                self.ledger.free(0, "trainer", part)
                self.offloaded.add(part)


def _colocated(ledger, **server):
    sizes = {"weights": 30, "kv_cache": 50}  # the engine: 80 of the GPU's 100 bytes
    return MockSGLangServer(ScriptedEngine(), memory_saver=True, ledger=ledger, memory_sizes=sizes, **server)


def _start(ledger, engine, **options):
    """A colocated start-up: the engine releases, the trainer builds (books its state), the machine starts."""
    trainer = LedgerTrainer(ledger, {"params": 20, "grads": 20, "optimizer": 40})
    release_for_training(engine)
    trainer.onload(["params", "grads", "optimizer"])
    return trainer, ColocatedPhases(trainer, engine, free_bytes=lambda: ledger.free_bytes(0), poll_s=0.01, **options)


def test_the_phase_machine_steps_through_the_memory_of_one_gpu():
    ledger = MemoryLedger(1, capacity_bytes=100)
    with _colocated(ledger) as server, _engine(server) as engine:
        trainer, phases = _start(ledger, engine)
        for step in range(2):
            assert ledger.holders(0) == {"trainer/params": 20, "trainer/grads": 20, "trainer/optimizer": 40}
            phases.to_update()
            engine.update_weights(iter(TENSORS), step + 1)
            assert sorted(holder.split("/")[1] for holder in ledger.holders(0)) == ["params", "weights"]
            phases.to_generate()
            assert sorted(holder.split("/")[1] for holder in ledger.holders(0)) == ["kv_cache", "weights"]
            engine.generate([[5]], PARAMS)
            phases.to_train()
        assert phases.history == ["train"] + ["update", "generate", "train"] * 2
        with pytest.raises(MemoryPhaseError, match="cannot follow"):
            phases.to_generate()


def _to_generate(phases, engine):
    phases.to_update()
    engine.update_weights(iter(TENSORS), 1)
    phases.to_generate()


def test_a_release_that_answers_early_is_waited_out_before_the_trainer_onloads():
    ledger = MemoryLedger(1, capacity_bytes=100)
    with _colocated(ledger, release_lag_s=0.3) as server, _engine(server) as engine:
        trainer, phases = _start(ledger, engine)
        _to_generate(phases, engine)
        server.faults["/release_memory_occupation"] = ["late_release"]
        started = time.monotonic()
        phases.to_train()  # without the wait the trainer's booking would exceed the GPU (next test)
        assert time.monotonic() - started >= 0.25
        assert server.memory.pending == [] and ("/release_memory_occupation", "late_release") in server.events


def test_without_the_wait_a_late_release_books_the_gpu_twice():
    ledger = MemoryLedger(1, capacity_bytes=100)
    with _colocated(ledger, release_lag_s=5.0) as server, _engine(server) as engine:
        trainer, phases = _start(ledger, engine)
        phases.free_bytes = None  # what the machine would do without its wait
        _to_generate(phases, engine)
        server.faults["/release_memory_occupation"] = ["late_release"]
        with pytest.raises(MemoryPhaseError, match="exceeds"):
            phases.to_train()
        server.memory.free_pending()


def test_an_engine_without_memory_saver_cannot_be_colocated():
    with MockSGLangServer(ScriptedEngine(), memory_saver=False) as server, _engine(server) as engine:
        engine.release_memory(["weights"])  # SGLang without --enable-memory-saver answers 200 and frees nothing
        assert server.memory.released == set()
        with pytest.raises(MemoryPhaseError, match="--enable-memory-saver"):
            release_for_training(engine)


@pytest.mark.parametrize("release", ["0.5.3.post3", "0.5.23"])
def test_the_tensor_push_opens_a_weight_update_session_where_the_release_needs_one(release):
    with MockSGLangServer(ScriptedEngine(), memory_saver=True, release=release) as server, _engine(server) as engine:
        assert _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}) == 400 or (
            release == "0.5.3.post3"
        )
        engine.update_weights(iter(TENSORS), 1)
        sessions = [path for kind, path, _ in server.weight_updates if kind == "session"]
        assert sessions == ([] if release == "0.5.3.post3" else ["/begin_weight_update", "/end_weight_update"])
        assert not server.session_open and server.backend.version == 1


def test_a_health_check_generates_and_dies_on_released_memory_and_waits_out_a_pause():
    """The double of SGLang's /health and /health_generate (a token each): 503 while paused, death on
    released memory (an illegal memory access on the server)."""
    import urllib.error
    import urllib.request

    with MockSGLangServer(ScriptedEngine(), memory_saver=True) as server, _engine(server) as engine:
        engine.release_memory(None)
        engine.resume_memory(["weights"])
        engine.pause_generation()
        with pytest.raises(urllib.error.HTTPError, match="503"):
            urllib.request.urlopen(server.url + "/health_generate", timeout=5)
        server.paused = False  # what an unpaused, released server meets
        with pytest.raises(OSError):
            urllib.request.urlopen(server.url + "/health", timeout=5)
        assert "generated a token while ['kv_cache'] released" in server.crashed


def test_a_lost_server_follows_the_memory_phases_and_rejoins_after_the_generate_phase():
    """Server B leaves the rotation while generating. Its memory still sits on the trainer's GPUs, so it is
    released and resumed with the others; it is health-checked only where it can generate (after the
    generate phase resumed it), never in the paused update phase, and the next push brings it back."""
    with (
        MockSGLangServer(ScriptedEngine(), memory_saver=True) as first,
        MockSGLangServer(ScriptedEngine(), memory_saver=True) as second,
    ):
        config = _config(first.url, weight_sync="tensor", max_retries=1)
        config.server_urls = [first.url, second.url]
        with SGLangEngine(config) as engine:
            trainer = LedgerTrainer(MemoryLedger(1), {"params": 0, "grads": 0, "optimizer": 0})
            release_for_training(engine)
            trainer.onload(["params", "grads", "optimizer"])
            phases = ColocatedPhases(trainer, engine)
            _to_generate(phases, engine)
            engine._http.pool.take_out(second.url, "its /generate failed its retries")
            phases.to_train()
            assert second.memory.released == {"weights", "kv_cache"}  # its memory left the trainer's GPUs
            phases.to_update()
            engine.update_weights(iter(TENSORS), 2)  # paused: no /health_generate (it would wait 20 s, 503)
            assert second.url in engine._http.pool.lost and second.crashed is None
            phases.to_generate()  # everything resumed: B generates again, and rejoins at the next push
            assert engine._returning == {second.url} and not second.memory.released
            phases.to_train()
            phases.to_update()
            engine.update_weights(iter(TENSORS), 3)
            phases.to_generate()
            assert engine.served_weight_versions() == {first.url: 3, second.url: 3}
        checks = [p for p, _ in second.events if p in ("/health", "/health_generate")]
        assert checks == ["/health_generate"] and second.crashed is None


@pytest.mark.parametrize("backup", [True, False], ids=["cpu-backup", "no-backup"])
def test_fp8_activation_scales_survive_a_release_only_with_the_weights_cpu_backup(backup):
    """FP8 rollouts push each linear's FP8 weight and weight_scale; its activation scale (input_scale, a
    parameter) comes from the server's checkpoint. A release keeps only buffers, so without
    --enable-weights-cpu-backup the first release erases it (the double then refuses to generate): the
    launcher adds the flag to quantised memory-saver servers and the start-up check refuses one without."""
    from megatron_zcpo.rollout.sglang.server import ServerSpec, server_command, server_config_for_run

    input_scale = {"model.layers.0.self_attn.q_proj.input_scale": torch.tensor([0.0125])}
    # what an FP8 push carries besides the FP8 weights (rollout/quantization.py): the weight scales
    pushed = [
        ("model.layers.0.self_attn.q_proj.weight_scale", torch.tensor(0.01)),
        ("model.norm.weight", torch.ones(4)),
    ]
    server = MockSGLangServer(ScriptedEngine(), memory_saver=True, weights_cpu_backup=backup, static_scales=input_scale)
    with server, _engine(server) as engine, _engine(server, quantization="fp8") as fp8_client:
        if not backup:
            with pytest.raises(RolloutError, match="without --enable-weights-cpu-backup"):
                fp8_client.check_servers(8, 4)
        engine.release_memory(None)
        engine.resume_memory(["weights"])
        engine.pause_generation()
        engine.update_weights(iter(pushed), 1)
        engine.resume_memory(["kv_cache"])
        engine.continue_generation()
        if backup:
            fp8_client.check_servers(8, 4)
            assert engine.generate([[5]], PARAMS)[0][0].weight_version == 1
            assert torch.equal(
                server.static_scales["model.layers.0.self_attn.q_proj.input_scale"], torch.tensor([0.0125])
            )
        else:
            with pytest.raises(RolloutError, match=r"input_scale'\] lost at a release"):
                engine.generate([[5]], PARAMS)
    launch = {"model_path": "/m", "enable_memory_saver": True, "quantization": "modelopt_fp8"}
    config = server_config_for_run(launch, _config("http://x", quantization="fp8"), 8, 8)
    assert "--enable-weights-cpu-backup" in server_command(ServerSpec("n", 1, ("0",)), config)
    plain = server_config_for_run({"model_path": "/m", "enable_memory_saver": True}, _config("http://x"), 8, 8)
    assert "--enable-weights-cpu-backup" not in server_command(ServerSpec("n", 1, ("0",)), plain)
