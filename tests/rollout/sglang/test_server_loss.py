"""Rollout server loss on the mock SGLang server: a server killed mid-rollout, restarted, behind a router; bounded time."""

import threading
import time

import pytest

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config, _expected_output, _named_tensors

PROMPTS = [[p] for p in range(1, 13)]


class SlowEngine(ScriptedEngine):
    """ScriptedEngine taking ``delay`` seconds per request: a rollout lasts long enough to kill a server in."""

    def __init__(self, delay=0.05):
        super().__init__()
        self.delay = delay

    def generate(self, prompts, params, n=1):
        time.sleep(self.delay)
        return super().generate(prompts, params, n)


def _generated_on(server):
    return sum(1 for path, action in server.events if path == "/generate" and action == "ok")


def _kill_after(server, requests):
    """Stop ``server`` once it has answered ``requests`` generate requests (from another thread)."""

    def watch():
        while _generated_on(server) < requests:
            time.sleep(0.005)
        server.stop()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _two_servers_on_disk_weights(tmp_path):
    """Two started mock servers and an engine over them that pushed weight version 1 from disk."""
    a, b = MockSGLangServer(SlowEngine()), MockSGLangServer(SlowEngine())
    a.start(), b.start()
    config = _config(
        a.url,
        server_urls=[a.url, b.url],
        weight_sync="disk",
        weight_dir=str(tmp_path),
        max_retries=1,
        request_timeout_s=5.0,
        max_concurrency=4,
    )
    engine = SGLangEngine(config)
    engine.update_weights(_named_tensors(0), version=1)
    return a, b, engine


def test_server_killed_mid_rollout_then_restarted_rejoins_at_the_current_version(tmp_path):
    a, b, engine = _two_servers_on_disk_weights(tmp_path)
    with engine:
        killer = _kill_after(a, 3)
        groups = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3), n=2)
        killer.join()
        # Every sample is present and right, the later ones served by b alone.
        assert [[c.output_ids for c in group] for group in groups] == [[_expected_output(p, 3)] * 2 for p in PROMPTS]
        assert list(engine._http.pool.lost) == [a.url] and _generated_on(b) >= 2 * len(PROMPTS) - 3 - 4
        # The next push goes to b only and succeeds.
        engine.update_weights(_named_tensors(1), version=2)
        assert engine.served_weight_versions() == {b.url: 2}
        # a comes back (fresh, serving its start-up weights): no request reaches it before the next push ...
        restarted = MockSGLangServer(SlowEngine(delay=0.0), port=a.port)
        restarted.start()
        engine.generate(PROMPTS[:4], SamplingParams(max_new_tokens=2), n=2)
        assert _generated_on(restarted) == 0
        # ... which health-checks it, includes it and brings it back at the current version.
        engine.update_weights(_named_tensors(2), version=3)
        assert engine.served_weight_versions() == {a.url: 3, b.url: 3} and restarted.backend.version == 3
        completions = [c for group in engine.generate(PROMPTS, SamplingParams(max_new_tokens=2), n=2) for c in group]
        assert _generated_on(restarted) > 0 and {c.weight_version for c in completions} == {3}
    restarted.stop(), b.stop()


def test_below_min_healthy_the_rollout_stops_naming_the_lost_server():
    a, b = MockSGLangServer(SlowEngine()), MockSGLangServer(SlowEngine())
    a.start(), b.start()
    config = _config(a.url, server_urls=[a.url, b.url], min_healthy=2, max_retries=1, max_concurrency=4)
    with SGLangEngine(config) as engine:
        killer = _kill_after(a, 2)
        with pytest.raises(
            RolloutError,
            match=f"only 1 of 2 SGLang servers remain, fewer than rollout.sglang.client."
            f"min_healthy = 2; lost: {a.url} ",
        ):
            engine.generate(PROMPTS, SamplingParams(max_new_tokens=2), n=2)
        killer.join()
    b.stop()


def test_with_a_router_failed_requests_health_check_the_servers():
    """The router fails a request (it was routed to the dead server): the servers are checked, the dead one
    leaves the rotation (no pushes, flushes or version checks go to it) and the request goes through the router again."""
    a, b = MockSGLangServer(ScriptedEngine()), MockSGLangServer(ScriptedEngine())
    router = MockSGLangServer(ScriptedEngine(), faults={"/generate": ["503", "503"]})
    for server in (a, b, router):
        server.start()
    a.stop()
    config = _config(b.url, server_urls=[a.url, b.url], router_url=router.url, max_retries=1)
    with SGLangEngine(config) as engine:
        [[completion]] = engine.generate([[4]], SamplingParams(max_new_tokens=2))
        assert completion.output_ids == _expected_output([4], 2)
        assert list(engine._http.pool.lost) == [a.url]
        engine.flush_cache()
        assert engine.served_weight_versions() == {b.url: -1}
    config = _config(b.url, server_urls=[a.url, b.url], router_url=router.url, max_retries=1, min_healthy=2)
    router.faults["/generate"] = ["503", "503"]
    with SGLangEngine(config) as engine:
        with pytest.raises(RolloutError, match=f"min_healthy = 2; lost: {a.url} \\(unhealthy after"):
            engine.generate([[4]], SamplingParams(max_new_tokens=2))
    b.stop(), router.stop()


def test_a_rollout_has_an_overall_deadline():
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/generate": ["hang"]}) as server,
        SGLangEngine(_config(server.url, request_timeout_s=60.0, rollout_timeout_s=0.5)) as engine,
    ):
        started = time.monotonic()
        with pytest.raises(
            RolloutError, match=r"did not finish within rollout.sglang.client.rollout_timeout_s = 0.5 s"
        ):
            engine.generate([[1], [2]], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - started < 5


def test_startup_health_wait_has_its_own_timeout():
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/health_generate": ["503"] * 100}) as server,
        SGLangEngine(_config(server.url, startup_timeout_s=0.3, connect_timeout_s=5.0)) as engine,
    ):
        started = time.monotonic()
        with pytest.raises(RolloutError, match="not healthy after 0s"):
            engine.wait_until_healthy(poll_s=0.05)
        assert time.monotonic() - started < 3


def test_flush_refused_while_a_lost_request_runs_is_retried_after_an_abort():
    with MockSGLangServer(ScriptedEngine()) as server, SGLangEngine(_config(server.url)) as engine:
        server.running_rids.add("lost-abort")  # a request whose abort never arrived: /flush_cache answers 400
        engine.flush_cache()
        assert "*" in server.aborted_rids and not server.running_rids
        assert [e[0] for e in server.events if e[0] in ("/flush_cache", "/abort_request")] == [
            "/flush_cache",
            "/abort_request",
            "/flush_cache",
        ]


def test_default_request_timeout_is_minutes():
    from megatron_zcpo.rollout.sglang.client import SGLangEngineConfig

    config = SGLangEngineConfig(server_urls=["http://x"])
    assert 60 <= config.request_timeout_s <= 1800 and config.startup_timeout_s > config.connect_timeout_s


def test_last_server_lost_mid_rollout_a_returned_one_is_resynced_from_disk_at_once(tmp_path):
    """a dies and comes back; then b dies mid-rollout: rather than stopping, the client re-loads the
    current weights into a (disk transport) and finishes the rollout there, at the current version."""
    a, b, engine = _two_servers_on_disk_weights(tmp_path)
    with engine:
        killer = _kill_after(a, 2)
        engine.generate(PROMPTS[:6], SamplingParams(max_new_tokens=2), n=2)
        killer.join()
        restarted = MockSGLangServer(SlowEngine(), port=a.port)
        restarted.start()
        killer = _kill_after(b, _generated_on(b) + 2)
        groups = engine.generate(PROMPTS, SamplingParams(max_new_tokens=3), n=2)
        killer.join()
        assert [[c.output_ids for c in group] for group in groups] == [[_expected_output(p, 3)] * 2 for p in PROMPTS]
        assert list(engine._http.pool.lost) == [b.url] and restarted.backend.version == 1
        assert {c.weight_version for group in groups for c in group} == {1}
    restarted.stop()


def test_shares_follow_rank_0s_rotation_and_healthy_servers_rejoin_it():
    """Under PP/EP each share's lead has its own client: it pushes to rank 0's rotation (without the
    servers rank 0 took out), and rank 0 brings healthy lost servers back before a push by shares."""
    with MockSGLangServer(ScriptedEngine()) as first, MockSGLangServer(ScriptedEngine()) as second:
        urls = [first.url, second.url]
        with (
            SGLangEngine(_config(first.url, server_urls=urls)) as rank0,
            SGLangEngine(_config(first.url, server_urls=urls)) as lead,
        ):
            rank0._http.pool.take_out(second.url, "its /generate failed its retries")
            second.faults["/health_generate"] = ["503"]  # still down at the first push
            lead.follow_rotation(rank0.rotation_for_push())
            assert lead._http.pool.in_rotation() == [first.url] and second.url in lead._http.pool.lost
            lead.follow_rotation(rank0.rotation_for_push())  # healthy again: back for the next push
            assert rank0._http.pool.in_rotation() == lead._http.pool.in_rotation() == urls


def _refused_bucket(rank, world, ports):
    """Rank 0 pushes to two servers; the one on rank 2 refuses the first bucket (503) and never joins
    its broadcast. Rank 1's server joined it: returns how long its update waited."""
    import torch

    from megatron_zcpo.rollout.sglang.client import SGLangEngineConfig

    urls = [f"http://127.0.0.1:{port}" for port in ports]
    if rank == 0:
        config = SGLangEngineConfig(server_urls=urls, group_backend="gloo", group_timeout_s=600, max_retries=0)
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
            with pytest.raises(RolloutError, match="refused"):
                engine.update_weights([("w", torch.ones(4, 4))], version=1)
        return None
    faults = {"/update_weights_from_distributed": ["503"]} if rank == 2 else {}
    with MockSGLangServer(ScriptedEngine(), port=ports[rank - 1], faults=faults) as server:
        deadline = time.monotonic() + 300
        while ("/destroy_weights_update_group", "ok") not in server.events and time.monotonic() < deadline:
            time.sleep(0.05)
        started = [time.monotonic() for kind, path, _ in server.weight_updates if kind == "start"]
        return {"events": list(server.events), "ended": time.monotonic() < deadline, "started": len(started)}


def test_a_refused_bucket_releases_the_servers_that_joined_its_broadcast():
    """The trainer leaves the broadcast's group at once: the server that joined it stops waiting (its
    update fails) and drops the group, instead of waiting in the broadcast until its group timeout
    (torch's default 30 min in SGLang; the run used to hang there)."""
    from megatron_zcpo.testing import run_distributed
    from megatron_zcpo.utils.runtime import free_port

    _, joined, refusing = run_distributed(_refused_bucket, 3, [free_port(), free_port()], timeout=240)
    assert joined["ended"] and refusing["ended"]
    assert ("/update_weights_from_distributed", "503") in refusing["events"]
    assert ("/destroy_weights_update_group", "ok") in joined["events"]
