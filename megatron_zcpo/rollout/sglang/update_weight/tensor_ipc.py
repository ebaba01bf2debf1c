"""Weight push in place through ``/update_weights_from_tensor``: flattened buckets handed over as CUDA IPC handles, per GPU.

Colocated placement puts every TP rank of every server on one of the trainer's GPUs. Each bucket of
same-dtype tensors (``bucket_bytes``: 512 MiB to 2 GiB; much smaller buckets have corrupted
weights in the field) is flattened into one tensor and posted as a ForkingPickler dump (base64 of
a pickle holding a CUDA IPC handle, not the bytes: what SGLang's ``MultiprocessingSerializer``
reads) with ``load_format: "flattened_bucket"``, one blob per TP rank in
``serialized_named_tensors``: TP rank k opens blob k (0.5.23 ``managers/tp_worker.py:194``
``deserialize_own_rank``; 0.5.3.post3 ``managers/tp_worker.py:383``).

Per GPU, as slime does: a TP rank sees only its server's GPUs (``CUDA_VISIBLE_DEVICES``), and SGLang
rebuilds a handle on the visible device whose UUID the handle names, raising ``Invalid
device_uuid`` for any other (``utils/patch_torch.py``: 0.5.23 :89-97, 0.5.3.post3 :66-74), uncaught, which
kills its scheduler. So blob k of a server is serialised on the GPU of its TP rank k: every trainer
rank holds the bucket on its own GPU and serialises it there, and rank 0 gathers the blobs and posts
to each server its TP ranks' blobs (:func:`push_from_every_gpu`). GPU slots: trainer global rank r
is slot r; server i's TP rank k is slot i * tp_size + k, the layout the launchers give the servers
(:func:`~megatron_zcpo.rollout.sglang.server.server_specs`: consecutive GPUs, node after node) on
the GPUs the trainer's ranks take in the same order.

No SGLang in the trainer's Python: the handles are torch's own reductions
(:func:`reduce_tensor_by_device_uuid`) with the device index replaced by the device's UUID. The
pickle names ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` (0.5.23's unpickler allow-list
admits it, ``utils/common.py:3329``), which SGLang's scheduler has patched to map a UUID back to
its own index before it unpickles (``monkey_patch_torch_reductions`` at 0.5.23 ``tp_worker.py:198``,
0.5.3.post3 ``tp_worker.py:381``). A post answers once every TP rank loaded the bucket (the
scheduler's TP barrier), so each rank frees its copy only then (``ipc_collect`` + ``empty_cache``).
The last bucket carries ``flush_cache`` and ``weight_version``. SGLang >= 0.5.21 takes buckets only
inside a begin/end weight-update session. Without CUDA the same bodies carry shared-memory handles
of CPU tensors (the real CPU server and the mock server take those). IPC handles open only on the
sender's node: each server's blobs come from the trainer ranks on its node.
"""

from __future__ import annotations

import base64
import contextlib
import io
import types
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from megatron_zcpo.convert.deepseek import sglang_load_partner
from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.update_weight.session import session_members, weight_update_session
from megatron_zcpo.utils.devices import cuda_device_uuid, has_cuda, slot_device

# The storage device's position among torch's rebuild_cuda_tensor arguments (torch 2.10 .. 2.14.1
# multiprocessing/reductions.py), SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX (patch_torch.py).
DEVICE_ARG = 6
Bucket = Tuple[torch.Tensor, List[types.SimpleNamespace]]


def flattened_buckets(stream: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, device) -> Iterator[Bucket]:
    """(flat tensor [numel] on ``device``, metadata) per bucket of consecutive same-dtype tensors up to
    ``bucket_bytes`` (a larger tensor is a bucket of its own; a bucket awaiting a tensor SGLang must
    load with one of its own, :func:`~megatron_zcpo.convert.deepseek.sglang_load_partner`, grows
    past it); metadata as SGLang's ``FlattenedTensorMetadata`` reads it (name, shape, dtype,
    start_idx, end_idx, numel), in stdlib objects so the server unpickles them without our package."""
    pending: List[Tuple[str, torch.Tensor]] = []
    size, awaited = 0, set()

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
        if pending and (tensor.dtype != pending[0][1].dtype or (size + nbytes > bucket_bytes and not awaited)):
            yield flush()
            pending, size = [], 0
        pending.append((name, tensor))
        size += nbytes
        awaited.discard(name)
        partner = sglang_load_partner(name)
        if partner is not None:
            awaited.add(partner)
    if pending:
        yield flush()


def buckets_with_last(
    stream: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int, device
) -> Iterator[Tuple[torch.Tensor, List[types.SimpleNamespace], bool]]:
    """:func:`flattened_buckets` with whether each is the last (the next one is built first)."""
    buckets = flattened_buckets(stream, bucket_bytes, device)
    bucket = next(buckets, None)
    while bucket is not None:
        following = next(buckets, None)
        yield bucket[0], bucket[1], following is None
        bucket = following


def reduce_tensor_by_device_uuid(tensor: torch.Tensor):
    """torch's reduction of ``tensor`` for another process (``reductions.reduce_tensor``); a CUDA
    tensor's device index replaced by the device's UUID, which SGLang maps to the index its process
    sees (``patch_torch._device_from_maybe_uuid``). A CPU tensor keeps torch's shared-memory reduction."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if rebuild is reductions.rebuild_cuda_tensor and isinstance(args[DEVICE_ARG], int):
        args = (*args[:DEVICE_ARG], cuda_device_uuid(args[DEVICE_ARG]), *args[DEVICE_ARG + 1 :])
    return rebuild, args


def serialize_for_server(obj, reduce_tensor: Callable = reduce_tensor_by_device_uuid) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` makes (base64 of a
    ForkingPickler dump), its tensors reduced by ``reduce_tensor`` (default: handles naming devices by
    UUID, as SGLang's patched reductions would)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # registers torch's storage reductions with ForkingPickler

    if not has_cuda():  # host tensors as shared-memory files any process opens (torch's fd passing needs a link back)
        torch.multiprocessing.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table = {**pickler.dispatch_table, torch.Tensor: reduce_tensor, torch.nn.Parameter: reduce_tensor}
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def bucket_payload(flat: torch.Tensor, metadata) -> dict:
    """What a TP rank unpickles from its blob (SGLang's flattened-bucket dict)."""
    return {"flattened_tensor": flat, "metadata": metadata}


def release_ipc_blocks() -> None:
    """After the servers answered: drop the CUDA IPC references they closed and hand the freed block back."""
    if has_cuda():
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()


class TensorIPCWeightUpdate:
    """Rank 0's side of the push: every server in rotation gets, per bucket, its TP ranks' blobs.

    ``tp_size`` and the servers' GPU slots (:meth:`server_slots`) are read from ``/get_server_info``
    on first use; every server runs at the same TP size (the launchers start them so).
    """

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (bucket_bytes, update_timeout_s)."""
        self.http, self.config = http, config
        self.pushed = {"bytes": 0, "tensors": 0, "buckets": 0}
        self.tp_size: Optional[int] = None
        self.session_members: List[str] = []  # servers that need a weight-update session (SGLang >= 0.5.21)
        self._session: Optional[contextlib.ExitStack] = None

    def server_slots(self) -> Dict[str, List[int]]:
        """{server url: the GPU slot of each of its TP ranks}, for every configured server (a lost server
        keeps its GPUs)."""
        if self.tp_size is None:
            from megatron_zcpo.rollout.sglang.api import SERVER_INFO_PATHS

            urls = self.http.pool.in_rotation()
            infos = self.http.run(self.http.get_from_all_servers(SERVER_INFO_PATHS))
            sizes = {int(info.get("tp_size", 1)) for info in infos}
            if len(sizes) != 1:
                raise RolloutError(
                    f"weight_sync='tensor' needs every server at one TP size (their GPUs are laid out in order); "
                    f"the servers report {dict(zip(urls, (info.get('tp_size') for info in infos)))}"
                )
            self.tp_size = sizes.pop()
            self.session_members = session_members(urls, infos)
        tp = self.tp_size
        return {url: list(range(i * tp, (i + 1) * tp)) for i, url in enumerate(self.http.pool.urls)}

    def begin(self) -> List[int]:
        """Open a push: the weight-update sessions where the release needs one; returns the GPU slots whose
        blobs the servers in rotation need."""
        slots = self.server_slots()
        self._session = contextlib.ExitStack()
        self._session.enter_context(
            weight_update_session(self.http, self.session_members, self.config.update_timeout_s)
        )
        return sorted(slot for url in self.http.pool.in_rotation() for slot in slots[url])

    def post(self, blobs: Mapping[int, str], version: Optional[int], nbytes: int = 0, tensors: int = 0) -> None:
        """Post one bucket: each server in rotation gets the blobs of its TP ranks' slots, in TP order;
        ``version`` (the last bucket) makes them flush their caches and serve it."""
        slots = self.server_slots()
        missing = sorted(
            {slot for url in self.http.pool.in_rotation() for slot in slots[url] if blobs.get(slot) is None}
        )
        if missing:
            raise RolloutError(
                f"weight_sync='tensor': no bucket serialised on GPU slots {missing} (a server's TP rank k opens "
                f"only the handle made on its own GPU: trainer rank r is slot r, server i's TP rank k slot "
                f"i * tp_size + k; each server's GPUs need a trainer rank)"
            )
        payload_of = {
            url: {
                "serialized_named_tensors": [blobs[slot] for slot in slots[url]],
                "load_format": "flattened_bucket",
                "flush_cache": version is not None,
                **({"weight_version": str(int(version))} if version is not None else {}),
            }
            for url in self.http.pool.in_rotation()
        }
        self.http.run(self._post_all(payload_of))
        self.pushed["bytes"] += nbytes
        self.pushed["tensors"] += tensors
        self.pushed["buckets"] += 1

    def end(self, ok: bool = True) -> None:
        """Close the push's sessions (after a failure too, as far as the servers answer)."""
        session, self._session = self._session, None
        if session is None:
            return
        if ok:
            session.close()
        else:
            with contextlib.suppress(RolloutError):
                session.__exit__(RolloutError, RolloutError("the push failed"), None)

    def push(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """The whole push from this one process: each bucket copied to every GPU slot a server needs (this
        process must see those GPUs; on a CPU the slots share the host tensor); the last bucket carries ``version``."""
        needed = self.begin()
        try:
            for flat, metadata, last in buckets_with_last(stream, self.config.bucket_bytes, slot_device(0)):
                blobs = {
                    slot: serialize_for_server(bucket_payload(flat.to(slot_device(slot)), metadata)) for slot in needed
                }
                self.post(blobs, version if last else None, flat.numel() * flat.element_size(), len(metadata))
                del flat, blobs
                release_ipc_blocks()
        except BaseException:
            self.end(ok=False)
            raise
        self.end()

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
            "weight_sync='tensor' pushes the whole model from every GPU (colocated placement); per-stage "
            "pushes need weight_sync 'distributed' or 'disk'"
        )

    def commit(self, version: int, weight_maps: Sequence[Optional[Dict[str, str]]] = ()) -> None:
        """Nothing to commit: the last bucket carried the version."""

    async def resync(self, url: str) -> bool:
        """A returning server cannot be re-synced mid-rollout (the tensors are gone): it waits for the next push."""
        return False

    def close(self) -> None:
        """Nothing to leave."""


def _agreed(broadcast: Callable, step: Optional[Callable]):
    """``step()`` on rank 0 (the rank that passes one), its result or failure on every rank: a failure
    raises there too (rank 0 its own error, the others a RolloutError naming it)."""
    outcome, error = None, None
    if step is not None:
        try:
            outcome = ("ok", step())
        except Exception as err:  # every rank must learn it, or they would wait in the next collective
            outcome, error = ("error", f"{type(err).__name__}: {err}"), err
    kind, value = broadcast(outcome)
    if kind == "error":
        if error is not None:
            raise error
        raise RolloutError(f"the weight push failed on rank 0: {value}")
    return value


def push_from_every_gpu(
    stream: Iterable[Tuple[str, torch.Tensor]],
    version: int,
    *,
    engine,
    slot: int,
    gather: Callable,
    broadcast: Callable,
    bucket_bytes: int,
    device,
    reduce_tensor: Callable = reduce_tensor_by_device_uuid,
) -> None:
    """The per-GPU push, collective over every rank: each rank walks the same ``stream`` (the whole model)
    into the same buckets on its own ``device`` (GPU slot ``slot``), serialises each bucket there when a
    server's TP rank shares that GPU, and ``gather`` (rank 0: the list of every rank's value) hands the
    blobs to rank 0, whose ``engine`` (an SGLangEngine; None elsewhere) posts them; ``broadcast``
    (rank 0's value on every rank) tells everyone how it went, and each rank frees its copy once the
    servers answered. The last bucket carries ``version``."""
    needed = set(_agreed(broadcast, engine.begin_tensor_push if engine is not None else None))
    try:
        for flat, metadata, last in buckets_with_last(stream, bucket_bytes, device):
            blob = None
            if slot in needed:
                try:
                    blob = serialize_for_server(bucket_payload(flat, metadata), reduce_tensor)
                except Exception as err:  # rank 0 names it and every rank stops
                    blob = RolloutError(f"the rank on GPU slot {slot} could not serialise its bucket: {err}")
            blobs = gather((slot, blob))

            def post(blobs=blobs, flat=flat, metadata=metadata, last=last):
                failed = [value for _, value in blobs if isinstance(value, Exception)]
                if failed:
                    raise failed[0]
                nbytes = flat.numel() * flat.element_size()
                engine.post_tensor_bucket(dict(blobs), version if last else None, nbytes, len(metadata))

            _agreed(broadcast, post if engine is not None else None)
            del flat, post
            release_ipc_blocks()
    except BaseException:
        if engine is not None:
            engine.abort_tensor_push()
        raise
    _agreed(broadcast, (lambda: engine.finish_tensor_push(version)) if engine is not None else None)
