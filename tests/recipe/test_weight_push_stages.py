"""Per-share weight push (PP2, TP2xPP2, EP2 of an MoE model; gloo) to a mock SGLang server: every tensor
arrives once, bit-identical to the converter's output, and global rank 0 forwards none of another share's bytes."""

import threading
import types

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.engine import RolloutEngine
from megatron_zcpo.rollout.mock_server import MockSGLangServer
from megatron_zcpo.testing import run_distributed

MODEL = ModelConfig(family="qwen2", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
MOE = ModelConfig(family="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


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

    from megatron_zcpo.recipe.weight_push import StageWeightPush, push_weights, share_name
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
    from megatron_zcpo.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

    setup_megatron(tensor_parallel=tp, pipeline_parallel=pp, seed=5, expert_parallel=ep)
    model = build_gpt_model(model_config, transformer_config(model_config, tensor_parallel=tp, pipeline_parallel=pp,
                                                             expert_parallel=ep))
    full = gather_full_state_dict(model)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    own = {n for n, _ in named_global_parameters(model)
           if (is_stage_lead() and not is_expert_tensor(n)) or (is_expert_shard_lead(model) and is_expert_tensor(n))}
    if pp_rank > 0:
        own.discard("embedding.word_embeddings.weight")  # the first stage sends the tied weight
    stage_bytes = sum(t.numel() * t.element_size() for n in own for _, t in megatron_to_hf_tensors(n, full[n], model_config))

    def engine(group):
        return SGLangEngine(SGLangEngineConfig(server_urls=[url], group_name=group, group_backend="gloo",
                                               master_address="127.0.0.1", group_timeout_s=120, **client_options))

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
    return {"pushed": pushed, "stage_bytes": stage_bytes, "received_p2p": received, "served": served,
            "expected": expected if rank == 0 else None, "share": share, "lead": bool(share)}


@pytest.mark.parametrize("tp,pp,ep,options,shares", [
    (1, 2, 1, {"flattened_buckets": True, "bucket_bytes": 60_000}, ["pp0", "pp1"]),
    (2, 2, 1, {"bucket_bytes": 60_000}, ["pp0", "pp1"]),
    (1, 2, 1, {"weight_sync": "disk"}, ["pp0", "pp1"]),
    # the second expert-parallel rank (data-parallel rank 1) sends its own experts: no expert gather
    (1, 1, 2, {"bucket_bytes": 60_000}, ["pp0", "pp0-ep1"]),
], ids=["pp2-flat", "tp2pp2-per-tensor", "pp2-disk", "ep2-moe"])
def test_each_stage_pushes_its_own_tensors(tp, pp, ep, options, shares, tmp_path):
    from megatron_zcpo.megatron.initialize import free_port

    if options.get("weight_sync") == "disk":
        options = dict(options, weight_dir=str(tmp_path))
    from megatron_zcpo.rollout.sglang_api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE

    backend = RecordingBackend()
    release = NEWEST_CHECKED_RELEASE if options.get("flattened_buckets") else PINNED_RELEASE  # load_format
    with MockSGLangServer(backend, port=free_port(), release=release) as server:
        results = run_distributed(_push_by_stage, tp * pp * ep, tp, pp, server.url, options, MOE if ep > 1 else MODEL,
                                  ep, timeout=300)
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

    tensors = [torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(4, dtype=torch.int64).view(2, 2)[:, :1]]
    with pytest.raises(ValueError, match="byte 74"):
        flatten_tensors(tensors)  # the int64 would start after 60 + 14 bytes: not viewable in place
    aligned = [tensors[2], tensors[0], tensors[1]]
    flat = flatten_tensors(aligned)
    back = unflatten_tensors(flat, [(tuple(t.shape), t.dtype) for t in aligned])
    for got, want in zip(back, aligned):
        assert got.dtype == want.dtype and torch.equal(got, want)
