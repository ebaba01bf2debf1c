"""The CUDA IPC weight push of colocated servers, emulated on a CPU: handles that name their GPU by UUID,
written without SGLang and opened by both releases' own code; every GPU feeding the server ranks beside it."""

import sys
import types

import pytest
import torch

from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE
from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import (
    bucket_payload,
    flattened_buckets,
    serialize_for_server,
)
from megatron_zcpo.testing.fake_cuda_ipc import HandleError, emulate_gpu, fake_device_uuid, load_blob
from megatron_zcpo.testing.real_sglang import PackageUnavailable, open_blobs_with_wheel

NAMED = [("a.weight", torch.arange(6.0).reshape(2, 3)), ("b.weight", torch.full((4,), 0.5))]


def _bucket():
    [(flat, metadata)] = list(flattened_buckets(iter(NAMED), 1 << 20, "cpu"))
    return flat, metadata


def _blob(slot=None):
    """(blob, the bucket: keep it alive until the receiver opened the blob, as the sender does)."""
    flat, metadata = _bucket()
    if slot is None:
        return serialize_for_server(bucket_payload(flat, metadata)), flat
    with emulate_gpu(slot):
        return serialize_for_server(bucket_payload(flat, metadata)), flat


@pytest.mark.parametrize("release", [PINNED_RELEASE, NEWEST_CHECKED_RELEASE])
def test_each_release_opens_our_handles_on_the_gpu_they_name_and_refuses_a_gpu_it_cannot_see(release):
    """The blob of a bucket on GPU slot 2, as the trainer writes it (torch's reductions, the device's UUID in
    place of its index), opened by the release's own patch_torch + MultiprocessingSerializer (0.5.23's
    SafeUnpickler allow-list included): a TP rank that sees slots [3, 2] opens it on its device 1; one that
    sees [0, 1] raises SGLang's "Invalid device_uuid"; a CPU blob opens anywhere. The test double agrees."""
    (gpu_blob, _gpu_flat), (cpu_blob, _cpu_flat) = _blob(slot=2), _blob()  # the buckets live on
    values, names = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 0.5, 0.5, 0.5, 0.5], ["a.weight", "b.weight"]
    sees_2, blind = [fake_device_uuid(3), fake_device_uuid(2)], [fake_device_uuid(0), fake_device_uuid(1)]
    try:
        opened, refused, host = open_blobs_with_wheel(release, [(gpu_blob, sees_2), (gpu_blob, blind), (cpu_blob, [])])
    except PackageUnavailable as error:
        pytest.skip(f"the sglang {release} wheel could not be downloaded: {error}")
    assert opened == {"device": 1, "values": values, "names": names}
    assert refused == {"error": f"Exception: Invalid device_uuid={fake_device_uuid(2)}"}
    assert host == {"device": None, "values": values, "names": names}
    assert load_blob(gpu_blob, sees_2)["flattened_tensor"].fake_device == 1  # the double, held against the release
    with pytest.raises(HandleError, match=refused["error"].removeprefix("Exception: ")):
        load_blob(gpu_blob, blind)


def test_the_trainer_writes_the_handles_without_sglang(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # the trainer's Python has no SGLang: importing it fails
    blob, flat = _blob(slot=1)
    assert load_blob(blob, [fake_device_uuid(1)])["flattened_tensor"].equal(flat)


def _push_from_every_gpu(rank, world, urls, model_config, bucket_bytes):
    """TP2 x DP2: every rank walks its replica's whole model (its TP group's gathers), serialises each
    bucket on its own (emulated) GPU, rank 0 posts each server its TP ranks' blobs."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_tensors
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict
    from megatron_zcpo.recipe.rank0_wait import Rank0Wait
    from megatron_zcpo.recipe.weight_push import GPUWeightPush, push_weights
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    setup_megatron(tensor_parallel=2, seed=5)
    model = build_gpt_model(model_config, transformer_config(model_config, tensor_parallel=2))
    full = gather_full_state_dict(model)
    engine = None
    if rank == 0:
        engine = SGLangEngine(SGLangEngineConfig(server_urls=urls, weight_sync="tensor", connect_timeout_s=5.0))
    with emulate_gpu(rank):  # global rank r is GPU slot r
        trainer = types.SimpleNamespace(policy=model, model_config=model_config)
        push_weights(trainer, engine, 4, GPUWeightPush(bucket_bytes), Rank0Wait(120))
    pushed = dict(engine.pushed) if engine is not None else None
    if engine is not None:
        engine.shutdown()
    expected = {h: t for n, w in full.items() for h, t in megatron_to_hf_tensors(n, w, model_config)}
    return {"expected": expected if rank == 0 else None, "pushed": pushed}


def test_every_gpu_feeds_the_server_ranks_beside_it():
    """Two servers at TP2 on GPUs (0, 1) and (2, 3) of a trainer at TP2 x DP2: each TP rank opens the handle
    made on its own GPU (the servers see only theirs: a handle of another GPU would kill them, as SGLang's
    Invalid device_uuid does), and both serve exactly the converter's tensors in several buckets."""
    from megatron_zcpo.testing import run_distributed
    from megatron_zcpo.testing.mock_server import MockSGLangServer
    from megatron_zcpo.utils.runtime import free_port
    from tests.recipe.test_weight_push_stages import MODEL, RecordingBackend

    backends = [RecordingBackend(), RecordingBackend()]
    with (
        MockSGLangServer(backends[0], port=free_port(), memory_saver=True, tp_size=2, gpus=(0, 1)) as first,
        MockSGLangServer(
            backends[1], port=free_port(), memory_saver=True, tp_size=2, gpus=(2, 3), release="0.5.23"
        ) as second,
    ):
        results = run_distributed(_push_from_every_gpu, 4, [first.url, second.url], MODEL, 60_000, timeout=300)
        servers = [
            (first.crashed, first.foreign_opens, first.served_version),
            (second.crashed, second.foreign_opens, second.served_version),
        ]
        updates = [sum(path == "/update_weights_from_tensor" for path, _ in s.events) for s in (first, second)]
    assert servers == [(None, [], "4"), (None, [], "4")]
    expected = results[0]["expected"]
    for backend in backends:
        names = [name for name, _ in backend.arrivals]
        assert sorted(names) == sorted(expected) and len(names) == len(set(names))
        for name, tensor in backend.arrivals:
            assert tensor.dtype == expected[name].dtype and torch.equal(tensor, expected[name]), name
    assert updates[0] == updates[1] == results[0]["pushed"]["buckets"] > 1
    assert results[0]["pushed"]["bytes"] == sum(t.numel() * t.element_size() for t in expected.values())
