"""Weight push in place through ``/update_weights_from_tensor``: flattened buckets handed over as CUDA IPC handles.

Colocated placement (the servers on the trainer's GPUs) needs no copy through the network or the
disk: the sender flattens each bucket of same-dtype tensors (``bucket_bytes``: 512 MiB to 2 GiB;
much smaller buckets have corrupted weights in the field) into one tensor on its GPU and posts its
ForkingPickler dump (SGLang's ``MultiprocessingSerializer``: base64 of a pickle holding CUDA IPC
handles, not the bytes), one blob per TP rank of the server, with ``load_format:
"flattened_bucket"``; every TP rank of every server opens the handle and copies what it needs.
SGLang answers once its TP ranks loaded the bucket (the scheduler's barrier after
``update_weights_from_tensor``), so the bucket is freed only then: ``ipc_collect`` releases the
handles the servers closed and ``empty_cache`` hands the block back before the next bucket. The
last bucket carries ``flush_cache`` and ``weight_version``. The device UUID replaces the device
index in every handle (SGLang's ``monkey_patch_torch_reductions``, used when SGLang imports here),
as the servers see other CUDA_VISIBLE_DEVICES. IPC handles are only valid on the sender's node:
servers elsewhere need the disk transport. Without CUDA the same bodies carry CPU tensors in shared-memory
files (SGLang on a CPU, the mock server). SGLang >= 0.5.21 takes the buckets only inside a
begin/end weight-update session, like the distributed transport's.
"""

from __future__ import annotations

import base64
import io
import types
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.update_weight.session import session_members, weight_update_session
from megatron_zcpo.utils.devices import compute_device, has_cuda


def flattened_buckets(
    stream: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, device
) -> Iterator[Tuple[torch.Tensor, List[types.SimpleNamespace]]]:
    """(flat tensor [numel] on ``device``, metadata) per bucket of consecutive same-dtype tensors up to
    ``bucket_bytes`` (a larger tensor is a bucket of its own); metadata as SGLang's
    ``FlattenedTensorMetadata`` reads it (name, shape, dtype, start_idx, end_idx, numel), in stdlib
    objects so the server unpickles them without our package."""
    pending: List[Tuple[str, torch.Tensor]] = []
    size = 0

    def flush():
        metadata, start = [], 0
        for name, tensor in pending:
            numel = tensor.numel()
            metadata.append(
                types.SimpleNamespace(
                    name=name,
                    shape=tensor.shape,
                    dtype=tensor.dtype,
                    start_idx=start,
                    end_idx=start + numel,
                    numel=numel,
                )
            )
            start += numel
        flat = torch.cat([tensor.detach().reshape(-1).to(device) for _, tensor in pending])
        return flat, metadata

    for name, tensor in stream:
        nbytes = tensor.numel() * tensor.element_size()
        if pending and (tensor.dtype != pending[0][1].dtype or size + nbytes > bucket_bytes):
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield flush()


def serialize_for_server(obj) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)``: base64 of a ForkingPickler dump.

    CPU tensors go as files in shared memory (torch's "file_system" sharing strategy, for this dump only):
    under the default "file_descriptor" strategy the receiver must fetch a descriptor from this process
    over a socket guarded by this process family's key, which an SGLang server's scheduler does not hold:
    it raises, and the whole server dies (0.5.3.post3 and 0.5.23 on a CPU; docs/SGLANG.md).
    """
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's tensor reductions with ForkingPickler

    buffer = io.BytesIO()
    strategy = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        ForkingPickler(buffer).dump(obj)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _device_uuid_handles() -> None:
    """Put device UUIDs into CUDA IPC handles (SGLang's patch; the servers map them to their own index)."""
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError as err:
        raise RolloutError(
            "rollout.sglang.client.weight_sync='tensor' on GPUs needs SGLang importable in the trainer "
            "(its CUDA IPC handles name devices by UUID): install the sglang the servers run"
        ) from err
    monkey_patch_torch_reductions()


class TensorIPCWeightUpdate:
    """Pushes buckets to every server in rotation through ``/update_weights_from_tensor``.

    ``tp_sizes``: {server url: its TP size} (one blob per TP rank), read from ``/get_server_info``
    on first use.
    """

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (bucket_bytes, update_timeout_s)."""
        self.http, self.config = http, config
        self.pushed = {"bytes": 0, "tensors": 0, "buckets": 0}
        self.tp_sizes: Optional[Dict[str, int]] = None
        self.session_members: List[str] = []  # servers that need a weight-update session (SGLang >= 0.5.21)
        self.device = compute_device()

    def _server_tp_sizes(self) -> Dict[str, int]:
        if self.tp_sizes is None:
            from megatron_zcpo.rollout.sglang.api import SERVER_INFO_PATHS

            urls = self.http.pool.in_rotation()
            infos = self.http.run(self.http.get_from_all_servers(SERVER_INFO_PATHS))
            self.tp_sizes = {url: int(info.get("tp_size", 1)) for url, info in zip(urls, infos)}
            self.session_members = session_members(urls, infos)
        return self.tp_sizes

    def push(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Hand ``stream`` (HF name, tensor) over bucket by bucket; the last bucket makes the servers serve ``version``."""
        if has_cuda():
            _device_uuid_handles()
        tp_sizes = self._server_tp_sizes()
        with weight_update_session(self.http, self.session_members, self.config.update_timeout_s):
            self._push_buckets(stream, tp_sizes, version)

    def _push_buckets(self, stream: Iterable[Tuple[str, torch.Tensor]], tp_sizes: Dict[str, int], version: int) -> None:
        """Flatten, post and free the buckets one by one; the last bucket carries ``version``."""
        buckets = flattened_buckets(stream, self.config.bucket_bytes, self.device)
        bucket = next(buckets, None)
        while bucket is not None:
            following = next(buckets, None)  # the next bucket is built first: is this one the last?
            flat, metadata = bucket
            last = following is None
            self._post(flat, metadata, tp_sizes, version if last else None)
            self.pushed["bytes"] += flat.numel() * flat.element_size()
            self.pushed["tensors"] += len(metadata)
            self.pushed["buckets"] += 1
            del flat, bucket
            if has_cuda():
                torch.cuda.ipc_collect()  # the servers closed their handles: the block can go
                torch.cuda.empty_cache()
            bucket = following

    def _post(self, flat: torch.Tensor, metadata, tp_sizes: Dict[str, int], version: Optional[int]) -> None:
        payload_of = {
            url: {
                # a dump per TP rank: a handle is opened once per receiving process
                "serialized_named_tensors": [
                    serialize_for_server({"flattened_tensor": flat, "metadata": metadata})
                    for _ in range(tp_sizes.get(url, 1))
                ],
                "load_format": "flattened_bucket",
                "flush_cache": version is not None,
                **({"weight_version": str(int(version))} if version is not None else {}),
            }
            for url in self.http.pool.in_rotation()
        }
        self.http.run(self._post_all(payload_of))

    async def _post_all(self, payload_of: Dict[str, dict]) -> None:
        """Every server its payload; one that fails after its retries (died mid-update) leaves the rotation
        (it serves stale weights), a 4xx refusal fails the push."""
        import asyncio

        from megatron_zcpo.rollout.sglang.http import SGLangHTTPError

        async def post(url, body):
            return await self.http.request(
                "POST", url + "/update_weights_from_tensor", body, timeout=self.config.update_timeout_s
            )

        urls = list(payload_of)
        answers = await asyncio.gather(*(post(url, payload_of[url]) for url in urls), return_exceptions=True)
        for url, answer in zip(urls, answers):
            if isinstance(answer, SGLangHTTPError) or not isinstance(answer, BaseException):
                continue
            if isinstance(answer, RolloutError):
                self.http.pool.take_out(url, f"/update_weights_from_tensor failed: {answer}")
        for answer in answers:
            if isinstance(answer, SGLangHTTPError):
                raise answer

    def push_part(self, stream, version: int, file_prefix: str = "model"):
        """One stage's share, as its own buckets (serving ``version`` waits for :meth:`commit`)."""
        raise RolloutError(
            "weight_sync='tensor' pushes the whole model from one sender (colocated placement streams every "
            "stage to global rank 0); per-stage pushes need weight_sync 'distributed' or 'disk'"
        )

    def commit(self, version: int, weight_maps: Sequence[Optional[Dict[str, str]]] = ()) -> None:
        """Nothing to commit: the last bucket carried the version."""

    async def resync(self, url: str) -> bool:
        """A returning server cannot be re-synced mid-rollout (the tensors are gone): it waits for the next push."""
        return False

    def close(self) -> None:
        """Nothing to leave."""
