"""Per-share weight push (PP2, TP2xPP2, EP2 of an MoE model; gloo) to a mock SGLang server: every tensor
arrives once, bit-identical to the converter's output, and global rank 0 forwards none of another share's bytes."""

import threading
import types

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.engine import RolloutEngine
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.mock_server import MockSGLangServer

MODEL = ModelConfig(
    family="qwen2",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
MOE = ModelConfig(
    family="qwen3_moe",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=False,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


class RecordingBackend(RolloutEngine):
    """Keeps every pushed (name, tensor) in arrival order."""

    def __init__(self):
        self.arrivals, self.version, self.lock = [], -1, threading.Lock()

    def generate(self, prompts, params, n=1):
        raise NotImplementedError

    def update_weights(self, named_hf_tensors, version):
        with self.lock:
            self.arrivals.extend((name, tensor.clone()) for name, tensor in named_hf_tensors)
            self.version = version

    def weight_version(self):
        return self.version

    def shutdown(self):
        pass


def _count_p2p_receives(counter):
    """Wrap torch.distributed's point-to-point receives to add the received bytes to ``counter``."""
    import torch.distributed as dist

    for name in ("recv", "irecv"):
        original = getattr(dist, name)

        def counted(tensor, *args, _original=original, **kwargs):
            counter["bytes"] += tensor.numel() * tensor.element_size()
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, counted)
    original_objects = dist.recv_object_list

    def counted_objects(objects, *args, **kwargs):
        counter["objects"] += 1
        return original_objects(objects, *args, **kwargs)

    dist.recv_object_list = counted_objects


def _push_by_stage(rank, world, tp, pp, url, client_options, model_config, ep=1):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_zcpo.convert.mapping import megatron_to_hf_tensors
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import (
        gather_full_state_dict,
        is_expert_shard_lead,
        is_expert_tensor,
        is_stage_lead,
        named_global_parameters,
    )
    from megatron_zcpo.recipe.weight_push import StageWeightPush, push_weights, share_name
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    setup_megatron(tensor_parallel=tp, pipeline_parallel=pp, seed=5, expert_parallel=ep)
    model = build_gpt_model(
        model_config, transformer_config(model_config, tensor_parallel=tp, pipeline_parallel=pp, expert_parallel=ep)
    )
    full = gather_full_state_dict(model)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    own = {
        n
        for n, _ in named_global_parameters(model)
        if (is_stage_lead() and not is_expert_tensor(n)) or (is_expert_shard_lead(model) and is_expert_tensor(n))
    }
    if pp_rank > 0:
        own.discard("embedding.word_embeddings.weight")  # the first stage sends the tied weight
    stage_bytes = sum(
        t.numel() * t.element_size() for n in own for _, t in megatron_to_hf_tensors(n, full[n], model_config)
    )

    def engine(group):
        return SGLangEngine(
            SGLangEngineConfig(
                server_urls=[url],
                group_name=group,
                group_backend="gloo",
                master_address="127.0.0.1",
                group_timeout_s=120,
                **client_options,
            )
        )

    share = share_name(model)
    stages = StageWeightPush(engine(f"zcpo_weights-{share}") if share else None)
    rollout = types.SimpleNamespace(engine=engine("unused")) if rank == 0 else types.SimpleNamespace(engine=None)
    trainer = types.SimpleNamespace(policy=model, model_config=model_config)
    received = {"bytes": 0, "objects": 0}
    _count_p2p_receives(received)
    push_weights(trainer, rollout.engine, 3, stages)
    pushed = dict(stages.engine.pushed) if stages.engine is not None else None
    served = rollout.engine.weight_version() if rank == 0 else None
    dist.barrier()
    for engine_ in (stages.engine, rollout.engine):
        if engine_ is not None:
            engine_.shutdown()
    expected = {h: t for n, w in full.items() for h, t in megatron_to_hf_tensors(n, w, model_config)}
    return {
        "pushed": pushed,
        "stage_bytes": stage_bytes,
        "received_p2p": received,
        "served": served,
        "expected": expected if rank == 0 else None,
        "share": share,
        "lead": bool(share),
    }


@pytest.mark.parametrize(
    "tp,pp,ep,options,shares",
    [
        (1, 2, 1, {"flattened_buckets": True, "bucket_bytes": 60_000}, ["pp0", "pp1"]),
        (2, 2, 1, {"bucket_bytes": 60_000}, ["pp0", "pp1"]),
        (1, 2, 1, {"weight_sync": "disk"}, ["pp0", "pp1"]),
        # the second expert-parallel rank (data-parallel rank 1) sends its own experts: no expert gather
        (1, 1, 2, {"bucket_bytes": 60_000}, ["pp0", "pp0-ep1"]),
    ],
    ids=["pp2-flat", "tp2pp2-per-tensor", "pp2-disk", "ep2-moe"],
)
def test_each_stage_pushes_its_own_tensors(tp, pp, ep, options, shares, tmp_path):
    from megatron_zcpo.megatron.initialize import free_port

    if options.get("weight_sync") == "disk":
        options = dict(options, weight_dir=str(tmp_path))
    from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE

    backend = RecordingBackend()
    release = NEWEST_CHECKED_RELEASE if options.get("flattened_buckets") else PINNED_RELEASE  # load_format
    with MockSGLangServer(backend, port=free_port(), release=release) as server:
        results = run_distributed(
            _push_by_stage, tp * pp * ep, tp, pp, server.url, options, MOE if ep > 1 else MODEL, ep, timeout=300
        )
        served = server.served_version
    expected = results[0]["expected"]
    names = [name for name, _ in backend.arrivals]
    assert len(names) == len(set(names)) and set(names) == set(expected)  # every tensor, once
    for name, tensor in backend.arrivals:
        assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert served == "3" and results[0]["served"] == 3
    leads = [r for r in results if r["lead"]]
    assert sorted(r["share"] for r in leads) == shares
    for result in leads:  # each lead sent exactly its own stage's bytes
        assert result["pushed"]["bytes"] == result["stage_bytes"] > 0
    assert sum(r["stage_bytes"] for r in leads) == sum(t.numel() * t.element_size() for t in expected.values())
    assert all(r["pushed"] is None for r in results if not r["lead"])
    assert results[0]["received_p2p"] == {"bytes": 0, "objects": 0}  # rank 0 forwards nothing
    if options.get("weight_sync") != "disk":
        flat = [e for e in server.events if e[0] == "/update_weights_from_distributed"]
        assert len(flat) > pp  # the small buckets split each stage


def test_flat_bucket_round_trip_mixed_dtypes():
    from megatron_zcpo.megatron.weights import flatten_tensors, unflatten_tensors

    tensors = [
        torch.randn(3, 5),
        torch.randn(7).to(torch.bfloat16),
        torch.arange(4, dtype=torch.int64).view(2, 2)[:, :1],
    ]
    with pytest.raises(ValueError, match="byte 74"):
        flatten_tensors(tensors)  # the int64 would start after 60 + 14 bytes: not viewable in place
    aligned = [tensors[2], tensors[0], tensors[1]]
    flat = flatten_tensors(aligned)
    back = unflatten_tensors(flat, [(tuple(t.shape), t.dtype) for t in aligned])
    for got, want in zip(back, aligned):
        assert got.dtype == want.dtype and torch.equal(got, want)


TWO_LAYERS = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)


def _push_stages_to_two_servers(rank, world, urls, api_key, model_config, lost_url):
    """PP2: each stage's lead pushes through its own group to both servers (one weight update at a
    time each, in separate processes as real servers are); rank 0's engine commits and checks.
    ``lost_url``: a third server, dead, that rank 0 took out of rotation (in the rollout): no lead may
    push to it."""
    from megatron.core import parallel_state as ps

    from megatron_zcpo.convert.mapping import megatron_to_hf_tensors
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict, is_stage_lead
    from megatron_zcpo.recipe.rank0_wait import Rank0Wait
    from megatron_zcpo.recipe.weight_push import StageWeightPush, push_weights
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    setup_megatron(pipeline_parallel=2, seed=5)
    model = build_gpt_model(model_config, transformer_config(model_config, pipeline_parallel=2))
    full = gather_full_state_dict(model)

    def engine(group):
        return SGLangEngine(
            SGLangEngineConfig(
                server_urls=[*urls, lost_url],
                group_name=group,
                group_backend="gloo",
                master_address="127.0.0.1",
                group_timeout_s=60,
                bucket_bytes=8_000,
                connect_timeout_s=2.0,
                api_key=api_key,
                sampling_seeds=True,
            )
        )

    stage = ps.get_pipeline_model_parallel_rank()
    stages = StageWeightPush(engine(f"zcpo_weights-pp{stage}") if is_stage_lead() else None)
    rank0 = engine("unused") if rank == 0 else None
    if rank == 0:
        rank0._http.pool.take_out(lost_url, "its /generate failed its retries")
    push_weights(types.SimpleNamespace(policy=model, model_config=model_config), rank0, 3, stages, Rank0Wait(120))
    served = rank0.served_weight_versions() if rank == 0 else None
    for engine_ in (stages.engine, rank0):
        if engine_ is not None:
            engine_.shutdown()
    expected = {h: t for n, w in full.items() for h, t in megatron_to_hf_tensors(n, w, model_config)}
    return {"served": served, "expected": expected if rank == 0 else None}


def test_stages_push_one_after_another_to_two_servers(tmp_path):
    """Two servers, two stages: pushed at once, the servers could take the stages' groups in opposite
    orders and wait for each other (SGLang serves one update at a time); one after the other, no server
    ever sees a second group's request while one is in flight, and both serve exactly the pushed weights.
    A third server rank 0 had taken out of rotation gets no share (the leads used to push to it, and fail)."""
    import json
    import os

    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
    from megatron_zcpo.rollout.sglang.server import SGLangLauncher, SGLangServerConfig
    from megatron_zcpo.utils.runtime import free_port
    from tests.rollout.sglang.test_sglang_server import write_tiny_checkpoint

    records = tmp_path / "records"
    records.mkdir()
    config = SGLangServerConfig(
        model_path=write_tiny_checkpoint(str(tmp_path / "hf"), TWO_LAYERS),
        nodes=["127.0.0.1"],
        gpus_per_node=2,
        base_port=free_port(2),
        port_stride=1,
        router=False,
        log_dir=str(tmp_path / "logs"),
        server_module="megatron_zcpo.testing.mock_server",
        enable_deterministic_inference=True,
        extra_args=["--record-dir", str(records)],
        startup_timeout_s=180,
    )
    launcher = SGLangLauncher(config, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    launcher.start()
    try:
        client = SGLangEngine(
            SGLangEngineConfig(server_urls=launcher.server_urls, api_key=launcher.api_key, sampling_seeds=True)
        )
        client.wait_until_healthy(timeout_s=180, poll_s=0.2, is_alive=launcher.alive)
        lost = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        results = run_distributed(
            _push_stages_to_two_servers, 2, launcher.server_urls, launcher.api_key, TWO_LAYERS, lost, timeout=300
        )
        assert results[0]["served"] == {url: 3 for url in launcher.server_urls}
        reference = EmbeddedEngine(TWO_LAYERS)
        reference.update_weights(results[0]["expected"].items(), version=3)
        prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=5, seed=11)
        served = client.generate(prompts, params)  # request i is sampled with seed 11 + i, on either server
        for index, (prompt, [completion]) in enumerate(zip(prompts, served)):
            [[expected]] = reference.generate([prompt], SamplingParams(max_new_tokens=5, seed=11 + index))
            assert completion.output_ids == expected.output_ids and completion.weight_version == 3
        client.shutdown()
    finally:
        launcher.stop()
    paths = sorted(records.iterdir())
    assert [path.name for path in paths] == sorted(f"{url.rsplit(':', 1)[1]}.json" for url in launcher.server_urls)
    for path in paths:
        record = json.loads(path.read_text())
        assert record["update_overlaps"] == []
        groups = [
            group
            for event, request, group in record["weight_updates"]
            if event == "start" and request != "/destroy_weights_update_group"
        ]
        assert groups == sorted(groups) and set(groups) == {"zcpo_weights-pp0", "zcpo_weights-pp1"}
