"""Weight push by NCCL broadcast: the trainer-to-SGLang weight-update group and its lifecycle.

The trainer joins, as rank 0, a process group with every server's TP ranks
(``/init_weights_update_group``, on first push); each bucket's metadata goes to
``/update_weights_from_distributed`` while the tensors are broadcast; the last bucket carries
the new version; :meth:`DistributedWeightUpdate.close` destroys the group on both sides. Under
pipeline parallelism every stage's lead has its own group and pushes its share with
:meth:`DistributedWeightUpdate.push_part`, its last bucket carrying the new version (generation
never runs during a push, so no request sees a server between two stages' shares). Servers of
SGLang 0.5.21 or newer (the version each reports in ``/get_server_info``) take the buckets only
inside a weight-update session: every push (and every share) opens one with
``/begin_weight_update`` and closes it with ``/end_weight_update`` (which also finalises quantised
weights) on those servers; older ones get neither request (they have no such endpoints).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import threading
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from megatron_zcpo.convert.deepseek import sglang_load_partner
from megatron_zcpo.megatron.weights import bucket_tensors, flatten_tensors
from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.api import SERVER_INFO_PATHS
from megatron_zcpo.rollout.sglang.update_weight.session import session_members, weight_update_session
from megatron_zcpo.rollout.weight_sync import dtype_name, init_custom_process_group, start_broadcast
from megatron_zcpo.utils.network import master_address_for
from megatron_zcpo.utils.runtime import free_port


def push_buckets(
    stream: Iterable[Tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[List[Tuple[str, torch.Tensor]]]:
    """The broadcast's buckets of ``stream``: at most ``bucket_bytes`` each, except that a tensor SGLang
    must load in one call with a later one (DeepSeek-V3's ``q_a_proj`` and ``kv_a_proj_with_mqa``,
    :func:`~megatron_zcpo.convert.deepseek.sglang_load_partner`) keeps its bucket open until it came."""
    return bucket_tensors(stream, bucket_bytes, sglang_load_partner)


class DistributedWeightUpdate:
    """NCCL (or gloo, ``group_backend``) broadcast of bucketed weights to every server."""

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (bucket_bytes, group_*, master_*)."""
        self.http = http
        self.config = config
        self._group = None
        self.pushed = {"bytes": 0, "tensors": 0, "buckets": 0}  # totals over this transport's pushes
        self._members: List[str] = []  # the servers in the group, in rank order
        self._session_members: List[str] = []  # those that need a weight-update session (SGLang >= 0.5.21)

    def push(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast ``stream`` (HF name, tensor) in buckets of ``bucket_bytes``; the servers serve ``version`` after."""
        self._broadcast(stream, version)
        self._leave_unless_kept()

    def push_part(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int, file_prefix: str) -> None:
        """Broadcast one stage's share; its last bucket carries ``version``."""
        self._broadcast(stream, version)
        self._leave_unless_kept()

    def _leave_unless_kept(self) -> None:
        """Leave the group after a push unless ``keep_weight_update_groups``: its communicator then
        holds no server GPU memory between pushes."""
        if not self.config.keep_weight_update_groups:
            self.close()

    def commit(self, version: int, weight_maps: Sequence[Optional[dict]] = ()) -> None:
        """Nothing left to do: every share's last bucket carried ``version``."""

    def _broadcast(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast ``stream`` in buckets; the last bucket's request carries ``version``.

        The group holds the servers in rotation: when they changed (a server was lost, or came
        back), the old group is left and a new one formed first.
        """
        if self._group is not None and self._members != self.http.pool.in_rotation():
            self.close()
        if self._group is None:
            self._join_group()
        with weight_update_session(self.http, self._session_members, self.config.update_timeout_s):
            self._send_buckets(stream, version)

    def _send_buckets(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Broadcast ``stream`` in buckets through the joined group; the last carries ``version``."""
        buckets = push_buckets(stream, self.config.bucket_bytes)
        bucket = next(buckets, None)
        if bucket is None:
            raise ValueError("update_weights got an empty weight stream")
        while bucket is not None:
            following = next(buckets, None)  # look ahead: the last bucket carries the new version
            request = {
                "names": [name for name, _ in bucket],
                "dtypes": [dtype_name(tensor.dtype) for _, tensor in bucket],
                "shapes": [list(tensor.shape) for _, tensor in bucket],
                "group_name": self.config.group_name,
                "flush_cache": False,
                "weight_version": None if following is not None else str(int(version)),
            }
            flat = self._flat_or_none(bucket)
            if flat is not None:
                request["load_format"] = "flattened_bucket"
            answer = self.http.submit(
                self.http.on_all_servers(
                    "POST",
                    "/update_weights_from_distributed",
                    request,
                    retry=False,
                    timeout=self.config.update_timeout_s,
                )
            )
            self._wait_alongside(
                start_broadcast(bucket, self._group, flat=flat), answer, f"bucket {request['names'][:3]}..."
            )
            self.pushed["buckets"] += 1
            self.pushed["tensors"] += len(bucket)
            self.pushed["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
            bucket = following

    def _flat_or_none(self, bucket) -> Optional[torch.Tensor]:
        """The bucket as one byte buffer when configured and its dtypes align, else None (per tensor)."""
        if not self.config.flattened_buckets:
            return None
        try:
            return flatten_tensors([tensor for _, tensor in bucket])
        except ValueError:  # e.g. 1-byte FP8 weights before a 4-byte scale: send tensor by tensor
            return None

    async def resync(self, url: str) -> bool:
        """A returning server cannot be re-synced between pushes (the weights stream from the
        trainer's ranks): it rejoins at the next push. Always False."""
        return False

    def _wait_alongside(self, works, answer: concurrent.futures.Future, what: str) -> None:
        """Wait for collective ``works`` while the servers' HTTP ``answer`` is pending.

        A server that refuses the request never joins the collective: raise at once instead of
        blocking until the group's timeout, and abandon the group (:meth:`_abandon_group`) so that
        the servers that joined stop waiting too.
        """
        while not all(work.is_completed() for work in works):
            if answer.done() and answer.exception() is not None:
                break
            time.sleep(0.001)
        else:
            for work in works:
                work.wait()
            if answer.exception() is None:
                return
        error = answer.exception()
        self._abandon_group(answer)
        raise RolloutError(f"weight update of {what} refused: {error}") from error

    def _abandon_group(self, answer: concurrent.futures.Future) -> None:
        """Leave a group whose collective cannot complete. Closing this end makes the members that
        joined it fail their receive at once (gloo; NCCL over network transports) instead of waiting
        in it for their own group timeout (torch's default, 30 min, in SGLang); once their answers
        are in (``answer``), they drop the group too (best effort), and the next push forms a new one."""
        import torch.distributed as dist

        group, self._group, self._members = self._group, None, []
        dist.destroy_process_group(group)
        with contextlib.suppress(Exception):
            answer.exception(timeout=self.config.update_timeout_s)
        with contextlib.suppress(RolloutError):
            self.http.run(
                self.http.on_servers_in_rotation(
                    "POST",
                    "/destroy_weights_update_group",
                    {"group_name": self.config.group_name},
                    retry=False,
                    timeout=30.0,
                )
            )

    def _join_group(self) -> None:
        """Create the weight-update group: the servers join over HTTP while this process joins as rank 0."""
        try:  # before any request: an address the servers cannot reach would stall them for the group timeout
            address = master_address_for(self.config.server_urls, self.config.master_address)
        except ValueError as error:
            raise RolloutError(f"weight-update group: {error}") from None
        members = self.http.pool.in_rotation()
        infos = self.http.run(self.http.get_from_all_servers(SERVER_INFO_PATHS))
        tp_sizes = [int(info.get("tp_size", 1)) for info in infos]
        world_size = 1 + sum(tp_sizes)
        port = self.config.master_port or free_port()
        requests = [
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1 + sum(tp_sizes[:i]),
                "world_size": world_size,
                "group_name": self.config.group_name,
                "backend": self.config.group_backend,
            }
            for i in range(len(tp_sizes))
        ]
        answer = self.http.submit(
            self.http.on_all_servers(
                "POST",
                "/init_weights_update_group",
                payloads=requests,
                retry=False,
                timeout=self.config.group_timeout_s,
            )
        )
        joined: Dict[str, Any] = {}

        def join():
            try:
                joined["group"] = init_custom_process_group(
                    self.config.group_backend,
                    address,
                    port,
                    0,
                    world_size,
                    self.config.group_name,
                    timeout=datetime.timedelta(seconds=self.config.group_timeout_s),
                )
            except BaseException as err:
                joined["error"] = err

        thread = threading.Thread(target=join, name="weight-update-group", daemon=True)
        thread.start()
        while thread.is_alive():
            if answer.done() and answer.exception() is not None:
                raise RolloutError(
                    f"servers refused the weight-update group: {answer.exception()}"
                ) from answer.exception()
            thread.join(timeout=0.01)
        if "error" in joined:
            raise RolloutError(f"joining the weight-update group at {address}:{port} failed: {joined['error']!r}")
        answer.result()
        self._group, self._members = joined["group"], members
        self._session_members = session_members(members, infos)

    def close(self) -> None:
        """Leave the weight-update group on the servers still in rotation and here (a no-op when never joined).

        Best effort on the servers: a lost member cannot answer, and the group is left here anyway.
        """
        if self._group is None:
            return
        import torch.distributed as dist

        try:
            self.http.run(
                self.http.on_servers_in_rotation(
                    "POST",
                    "/destroy_weights_update_group",
                    {"group_name": self.config.group_name},
                    retry=False,
                    timeout=30.0,
                )
            )
        finally:
            dist.destroy_process_group(self._group)
            self._group, self._members = None, []
