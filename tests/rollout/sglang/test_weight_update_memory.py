"""What the weight pushes hold on every SGLang GPU outside its static pool, counted by the server launch."""

import time

import pytest
import torch

from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
from megatron_zcpo.rollout.sglang.server import (
    NCCL_COMMUNICATOR_MIB,
    server_config_for_run,
    weight_update_groups,
    weight_update_reserve_bytes,
)
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.utils.runtime import free_port
from tests.rollout.sglang.test_sglang_client import ScriptedEngine

GIB = 2**30


def _client(**options):
    return SGLangEngineConfig(server_urls=["unset"], bucket_bytes=GIB, **options)


def test_qwen3_235b_expert_shares_kept_open_are_counted_in_the_launch():
    """EP 64: 64 groups of world 65 stay open on every server GPU beside the 1 GiB bucket (they were
    counted nowhere: --mem-fraction-static stayed 0.85)."""
    kept = _client()
    groups = weight_update_groups(1, 64, kept)
    assert groups == 64
    reserve = weight_update_reserve_bytes(groups, GIB)
    assert reserve == GIB + 64 * int(NCCL_COMMUNICATOR_MIB * 2**20)
    launch = server_config_for_run({"model_path": "/m", "mem_fraction_static": 0.85}, kept, 1024, 8192, groups)
    assert launch.mem_fraction_static == pytest.approx(0.85 - reserve / (80 * GIB), abs=1e-4)
    one_at_a_time = _client(keep_weight_update_groups=False)
    assert weight_update_groups(1, 64, one_at_a_time) == 1
    light = server_config_for_run({"model_path": "/m"}, one_at_a_time, 1024, 8192, 1)
    assert light.mem_fraction_static == pytest.approx(
        0.85 - (GIB + NCCL_COMMUNICATOR_MIB * 2**20) / (80 * GIB), abs=1e-4
    )
    assert weight_update_groups(4, 8, _client(weight_sync="disk", weight_dir="/w")) == 0
    with pytest.raises(ValueError, match="keep_weight_update_groups=false"):
        server_config_for_run({"model_path": "/m", "gpu_memory_gib": 24}, kept, 1024, 8192, groups)


def test_the_235b_example_launches_its_servers_with_one_group_at_a_time():
    from pathlib import Path

    import yaml

    run = yaml.safe_load((Path(__file__).parents[3] / "examples/qwen3-235b-a22b-zcpo/config.yaml").read_text())
    client = SGLangEngineConfig(server_urls=["unset"], **run["rollout"]["sglang"]["client"])
    parallel = run["parallel"]
    assert parallel["expert"] == 64 and weight_update_groups(parallel["pipeline"], parallel["expert"], client) == 1


def _push_twice(rank, world, port, keep):
    url = f"http://127.0.0.1:{port}"
    if rank == 0:
        config = SGLangEngineConfig(
            server_urls=[url], group_backend="gloo", group_timeout_s=60, keep_weight_update_groups=keep
        )
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
            for version in (1, 2):
                engine.update_weights([("w", torch.full((3,), float(version)))], version=version)
            return engine.weight_version()
    with MockSGLangServer(ScriptedEngine(), port=port) as server:
        deadline = time.monotonic() + 90
        while server.events.count(("/destroy_weights_update_group", "ok")) < (1 if keep else 2):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        time.sleep(0.2)
        return [path for path, detail in server.events if detail == "ok" and "weights_update_group" in path]


def test_groups_not_kept_are_left_after_every_push():
    served, groups = run_distributed(_push_twice, 2, free_port(), False, timeout=180)
    assert served == 2
    assert groups == ["/init_weights_update_group", "/destroy_weights_update_group"] * 2
