"""What the SGLang rollout client is configured with: server addresses, timeouts, retries, the weight push."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import List, Optional

from megatron_zcpo.rollout.sglang.api import ROUTER_DEFAULT_REQUEST_TIMEOUT_S
from megatron_zcpo.rollout.sglang.partial import PAUSE_MODES

WEIGHT_SYNC_METHODS = ("distributed", "disk", "tensor")
API_KEY_ENV = "ZCPO_SGLANG_API_KEY"  # where rollout.sglang.client.api_key comes from when unset


@dataclass
class SGLangEngineConfig:
    """Where the SGLang servers are and how to talk to them.

    ``server_urls``: every server (one per inference TP group); weight pushes, cache flushes and
    version checks go to each. ``router_url``: generate through the sglang router when given,
    else round-robin over the servers. Requests: at most ``max_concurrency`` in flight, each
    with ``request_timeout_s``; connection errors, timeouts and 5xx answers are retried
    ``max_retries`` times with exponential backoff from ``backoff_s`` up to ``backoff_max_s``.
    Weight push: ``weight_sync`` "distributed" (NCCL broadcast in buckets of ``bucket_bytes``
    through a weight-update group named ``group_name``; the servers reach this host at
    ``master_address``, by default the local address of the route to the first server, see
    :func:`megatron_zcpo.utils.network.master_address_for`) or "disk" (safetensors under ``weight_dir``, a directory the servers
    can read) or "tensor" (colocated placement: flattened buckets of ``bucket_bytes`` handed over in
    place as CUDA IPC handles through ``/update_weights_from_tensor``, to the servers of this node). ``quantization`` "fp8" pushes modelopt FP8 weights (servers launched with
    modelopt FP8 quantisation; turn the trainer's importance-sampling correction on).
    ``flattened_buckets``: broadcast each bucket as one flat byte buffer (SGLang's
    ``flattened_bucket`` load format, from SGLang 0.5.6; refused at start-up against older
    servers) instead of tensor by tensor.
    ``sampling_seeds``: forward ``SamplingParams.seed`` as SGLang's per-request ``sampling_seed``
    (SGLang 0.5.3.post3 uses it only on servers launched with ``--enable-deterministic-inference``:
    checked at start-up, and the launchers pass the flag), else seeds are not sent and SGLang
    sampling is not reproducible.
    ``api_key``: sent as ``Authorization: Bearer`` with every request (servers and router launched
    with ``--api-key``); None: the environment variable ``ZCPO_SGLANG_API_KEY``, else none.
    ``router_timeout_s``: the router's ``--request-timeout-secs`` (sglang-router 0.2.0's default
    1,800 s; the launchers start the router with this value): it must exceed ``request_timeout_s``,
    so the client, which aborts and retries, gives up on a request first.
    ``return_routed_experts``: ask each /generate for the experts every token was routed to
    (mixture-of-experts routing replay; SGLang >= 0.5.7 launched with ``--enable-return-routed-experts``):
    those requests go to the servers directly, never through ``router_url`` (sglang-router 0.2.0 and
    0.3.2 drop the field from the bodies they forward).
    ``keep_weight_update_groups``: keep the weight-update group (an NCCL communicator on every
    server GPU, outside SGLang's static pool) between pushes; false: leave it after every push and
    form it again at the next (a rendezvous per push; under pipeline / expert parallelism each
    share's group, so a server GPU holds one at a time instead of one per share; every SGLang
    release has ``/destroy_weights_update_group``). The launchers count what the groups hold
    (:func:`~megatron_zcpo.rollout.sglang.server.weight_update_reserve_bytes`).
    Server loss: a server whose request fails its retries leaves the rotation (see
    :class:`~megatron_zcpo.rollout.sglang.server_pool.ServerPool`) and its requests go to the others; with
    a router, a failed request has the servers health-checked instead. Below ``min_healthy``
    servers the call fails naming the lost ones, unless lost servers answer their health check
    again and the transport can re-sync them at once (disk). Otherwise a lost server that is
    healthy again rejoins at the next weight push, which includes it. Bounded time: each request
    ``request_timeout_s`` (x (1 + ``max_retries``)), each :meth:`SGLangEngine.generate` call
    ``rollout_timeout_s``, the start-up health wait ``startup_timeout_s``; a request that still
    fails costs its prompt's group (a rejected sample), not the call.
    Answers are checked (:mod:`megatron_zcpo.rollout.output_checks`, token ids against
    ``vocab_size``, the trainer's vocabulary): a bad one is rejected (its group is dropped) and
    counted in ``rejected_samples``; when more than ``max_rejected_fraction`` of one
    :meth:`SGLangEngine.generate` call is rejected, it raises ``RolloutError`` with the messages.
    ``pause_mode``: how the servers hold requests in flight across a weight push (asynchronous
    rollouts, :mod:`megatron_zcpo.rollout.sglang.partial`): "retract" (SGLang 0.5.23: the server keeps
    them and continues them with the new weights), "abort" (every release: they come back with their
    tokens and the client continues them), "auto" (retract where every server runs 0.5.23 or newer).
    """

    server_urls: List[str]
    router_url: Optional[str] = None
    max_concurrency: int = 256
    request_timeout_s: float = 900.0
    connect_timeout_s: float = 30.0
    rollout_timeout_s: float = 7200.0
    startup_timeout_s: float = 1800.0
    min_healthy: int = 1
    max_retries: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    weight_sync: str = "distributed"
    bucket_bytes: int = 512 * 2**20
    group_name: str = "zcpo_weights"
    group_backend: str = "nccl"
    group_timeout_s: float = 1800.0
    master_address: Optional[str] = None
    master_port: Optional[int] = None
    weight_dir: Optional[str] = None
    update_timeout_s: float = 1800.0
    quantization: Optional[str] = None
    sampling_seeds: bool = False
    flattened_buckets: bool = False
    vocab_size: Optional[int] = None
    max_rejected_fraction: float = 0.05
    api_key: Optional[str] = None
    router_timeout_s: float = float(ROUTER_DEFAULT_REQUEST_TIMEOUT_S)
    return_routed_experts: bool = False
    keep_weight_update_groups: bool = True
    pause_mode: str = "auto"

    def __post_init__(self) -> None:
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None

    def validate(self, prefix: str = "rollout.sglang") -> None:
        """Raise ``ValueError`` naming the offending key."""
        if not self.server_urls:
            raise ValueError(f"{prefix}.server_urls is empty")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"{prefix}.pause_mode={self.pause_mode!r}: choose from {PAUSE_MODES}")
        if self.weight_sync not in WEIGHT_SYNC_METHODS:
            raise ValueError(f"{prefix}.weight_sync={self.weight_sync!r}: choose from {WEIGHT_SYNC_METHODS}")
        if self.weight_sync == "disk" and not self.weight_dir:
            raise ValueError(
                f"{prefix}.weight_dir must be set (a directory the servers can read) for weight_sync='disk'"
            )
        if self.quantization not in (None, "fp8"):
            raise ValueError(f"{prefix}.quantization must be null or 'fp8', got {self.quantization!r}")
        for key in (
            "max_concurrency",
            "request_timeout_s",
            "bucket_bytes",
            "update_timeout_s",
            "rollout_timeout_s",
            "startup_timeout_s",
            "min_healthy",
            "router_timeout_s",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.max_retries < 0:
            raise ValueError(f"{prefix}.max_retries must be >= 0, got {self.max_retries}")
        if not 0.0 <= self.max_rejected_fraction <= 1.0:
            raise ValueError(f"{prefix}.max_rejected_fraction must be in [0, 1], got {self.max_rejected_fraction}")
        if self.router_url and self.router_timeout_s <= self.request_timeout_s:
            raise ValueError(
                f"{prefix}.client.router_timeout_s={self.router_timeout_s:g} must exceed "
                f"{prefix}.client.request_timeout_s={self.request_timeout_s:g}: the router would cut "
                "requests the client still waits for (and retry them without aborting the first); "
                "raise router_timeout_s (the router's --request-timeout-secs)"
            )
