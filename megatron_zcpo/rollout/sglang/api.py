"""SGLang's native HTTP API as this package uses it: every endpoint, request field and answer, per release.

Read from SGLang's own sources (python/sglang/srt/entrypoints/http_server.py, managers/io_struct.py,
sampling/sampling_params.py) of the release the Dockerfile pins, 0.5.3.post3, and of the newest
release at the time of the check, 0.5.23 (2026-12). The client (:mod:`sglang_client`) and the
mock server (:mod:`mock_server`, which validates every request against this table) use it.

| endpoint | 0.5.3.post3 | 0.5.23 | we send / read |
| --- | --- | --- | --- |
| POST /generate | yes | yes (+ return_routed_experts, since 0.5.7) | rid, input_ids, sampling_params, return_logprob, stream, return_routed_experts (MoE routing replay) / output_ids, meta_info.{id, finish_reason.type, output_token_logprobs, weight_version, cached_tokens, routed_experts} |
| GET /health_generate | yes | yes | 200 once generating |
| GET /get_model_info | yes | yes (deprecated alias of /model_info) | weight_version |
| GET /model_info | no (404) | yes | weight_version (fallback when /get_model_info is gone) |
| GET /get_weight_version | yes | no (404): not used | |
| GET /get_server_info | yes | yes (deprecated alias of /server_info) | tp_size |
| GET /server_info | no (404) | yes | tp_size (fallback) |
| POST /flush_cache | yes | yes | 200, or 400 while requests run |
| POST /abort_request | yes | yes | rid or abort_all / 200 |
| POST /update_weights_from_disk | yes | yes | model_path, weight_version / {success, message, num_paused_requests} |
| POST /init_weights_update_group | yes | yes | master_address, master_port, rank_offset, world_size, group_name, backend / {success, message} |
| POST /update_weights_from_distributed | yes | yes (+ load_format "flattened_bucket") | names, dtypes, shapes, group_name, flush_cache, weight_version, load_format (with `flattened_buckets`) / {success, message} |
| POST /destroy_weights_update_group | yes | yes | group_name / {success, message} |
| POST /release_memory_occupation | yes | yes | tags (see :data:`MEMORY_TAGS_BY_RELEASE`) / 200 once released |
| POST /resume_memory_occupation | yes | yes | tags / 200 once resumed |
| POST /update_weights_from_tensor | yes | yes (+ selector, torch_empty_cache) | serialized_named_tensors (one per TP rank), load_format "flattened_bucket", flush_cache, weight_version / {success, message} |
| POST /pause_generation, /continue_generation | yes (no body) | yes (mode; torch_empty_cache) | nothing / 200 |
| POST /begin_weight_update | no (404) | yes (from 0.5.21) | {} / {success, message}: opens the weight-update session |
| POST /end_weight_update | no (404) | yes (from 0.5.21) | {} / {success, message}: closes it, finalises quantised weights |
| POST /load_lora_adapter | yes | yes | lora_name, lora_path (a PEFT folder the server reads) / {success, error_message, loaded_adapters: {name: path}} |
| POST /unload_lora_adapter | yes | yes | lora_name / {success, error_message, loaded_adapters} |
| POST /load_lora_adapter_from_tensors | no (404) | yes | not used (one ForkingPickler blob of CUDA IPC handles per TP rank: same-node servers only) |

Weight-update sessions (:data:`WEIGHT_UPDATE_SESSIONS_SINCE`, read from 0.5.21's and 0.5.23's
``managers/scheduler_components/weight_updater.py``): ``/update_weights_from_distributed`` outside a
session answers 400 "update_weights_from_distributed must run between begin_weight_update() and
end_weight_update()"; a second ``begin`` while one is open, or an ``end`` without one, answers 400.
``/update_weights_from_disk`` needs none. 0.5.20 has no such endpoints. The transport reads every
server's version (``/get_server_info``) and opens a session around each push on those that need one.

LoRA serving (``model.lora.push: adapter``; read from both releases' ``http_server.py``,
``io_struct.py``, ``managers/tokenizer_*_mixin.py``, ``lora/lora_manager.py`` and ``lora_registry.py``):
servers launched with ``--enable-lora --max-lora-rank R --lora-target-modules q_proj ...`` load a PEFT
folder by name (``/load_lora_adapter``) and a ``/generate`` naming it in ``lora_path`` runs with it (no
``lora_path``: the base). Refused with 400 and ``success`` false: loading a name that is loaded ("Failed
to load LoRA adapter NAME because it is already loaded"), an adapter of a rank above ``--max-lora-rank``
or of modules outside ``--lora-target-modules`` ("... is incompatible with the current LoRA memory
pool configuration ..."), any LoRA request to a server without ``--enable-lora`` ("LoRA is not
enabled. Please set `--enable-lora` to enable LoRA."), unloading a name that is not loaded ("LoRA with
name NAME does not exist. Loaded LoRAs: ..."), and a ``/generate`` naming an adapter that is not
loaded (0.5.3.post3: "The following requested LoRA adapters are not loaded: NAME"; 0.5.23 first
reloads an adapter it had loaded and unloaded, from its path, and refuses one it never had: "Got LoRA
adapter that has never been loaded: NAME"). An unload waits for the requests using the adapter.
Under ``--enable-lora`` every adapted projection's weights are renamed (``base_layer``): a full
weight push into such a server skips them without an error (``load_weights``: names not in the
model are passed over), so a merged push never goes to a LoRA-enabled server (checked at start-up).

Seeds: 0.5.3.post3 packs the batch's ``sampling_seed`` values into an int32 tensor
(``sampling/sampling_batch_info.py``): a seed of 2**31 or more crashes its scheduler (the server
dies); 0.5.23 packs int64. The client keeps every request's seed below :data:`SEED_LIMIT`.

Launch (:mod:`sglang_server`): ``python -m sglang.launch_server`` with ``--model-path --host --port
--tp-size --mem-fraction-static --dtype --random-seed`` and optionally ``--context-length``,
``--quantization modelopt_fp8`` and, for mixture-of-experts models, ``--ep-size`` (experts split over
the server's TP ranks; 1 or the TP size) and ``--enable-return-routed-experts``: ServerArgs fields in
both releases (0.5.23 derives its flags from the field names), except the last, which needs 0.5.7 or
newer (checked: absent from 0.5.6.post2's sources, present in 0.5.7's).

Routed experts (0.5.7+): ``meta_info.routed_experts`` is base64 of int32 [prompt + output - 1,
num_hidden_layers, num_experts_per_tok]: the top-k experts of every token the server ran through
the model, zeros in the slots of dense layers.

Status codes (both releases): an unknown path is 404 and a known path with another method 405
(FastAPI); a body that does not validate is 400 (SGLang turns FastAPI's 422 into 400); weight
updates answer 200 with success true or 400 with success false and the reason. SGLang ignores
unknown body fields; :func:`check_request` rejects them, so a misspelt optional field fails a test
instead of silently doing nothing on a cluster (a ``load_format`` sent to 0.5.3.post3 would be
ignored and the flat broadcast would never be received: the push hangs).

Behaviour of 0.5.3.post3 a run depends on (the mock server follows it, the client checks it at
start-up):

- ``--api-key KEY``: every request but those to paths starting with ``/health`` or ``/metrics``
  needs ``Authorization: Bearer KEY``, else 401 ({"error": "Unauthorized"}) (:func:`needs_api_key`).
- Context length: a request with ``len(input_ids) + max_new_tokens >= context_length`` is refused
  with 400; the scheduler then cuts ``max_new_tokens`` to ``max_req_len - len(input_ids) - 1``
  with ``max_req_len = min(context_length - 1, KV pool tokens - 1)`` and aborts a prompt of
  ``max_req_input_len = max_req_len - 5`` tokens or more. ``/get_server_info`` reports the
  server's arguments (``context_length`` is null unless ``--context-length`` was given) with the
  scheduler's ``max_total_num_tokens`` and ``max_req_input_len`` (:func:`served_tokens`). A
  prompt of P tokens gets its N new tokens in full only with ``--context-length`` >= P + N + 2
  (:func:`required_context_length`). ``/get_model_info`` carries no context length (nor does
  0.5.23's ``/model_info``).
- ``sampling_seed`` (default 42; null is refused with 400) is used only by servers launched with
  ``--enable-deterministic-inference``, which also needs an ``--attention-backend`` among
  :data:`DETERMINISTIC_ATTENTION_BACKENDS`; ``/get_server_info`` reports
  ``enable_deterministic_inference``.
- Weight updates (``/init_weights_update_group``, ``/update_weights_from_distributed``,
  ``/update_weights_from_disk``, ``/destroy_weights_update_group``) are served one at a time
  (the scheduler handles one control request at a time; updates also take the model's writer
  lock). A group's first collective blocks until all its members joined, so two servers taking
  two groups' requests in opposite orders wait for each other until the group timeout.
- ``load_format`` "flattened_bucket" in ``/update_weights_from_distributed``: from 0.5.6
  (:data:`FLATTENED_BUCKETS_SINCE`; 0.5.5.post3 lacks it).

sglang-router 0.2.0 and 0.3.2 (run here on a CPU, :mod:`megatron_zcpo.testing.real_sglang`):
``/health_generate`` answers 0.2.0's own 503 "No routers with healthy workers available" without
asking any worker (0.3.2: 200), so the router's readiness is :data:`ROUTER_READY_PATH` (200 with
``{"status": "ready", "healthy_workers": N}`` in both). 0.3.2 has no ``/list_workers`` (404); both
guard ``GET /workers`` with their key (:data:`ROUTER_KEY_CHECK_PATH`). Both rebuild the
``/generate`` body from the fields they know: ``return_routed_experts`` is dropped, and
:data:`ROUTER_GENERATE_FIELDS` are added (``model``: 0.3.2; SGLang ignores unknown top-level
fields, 0.5.23's contract too).

sglang-router 0.2.0 (``python -m sglang_router.launch_router``): ``--request-timeout-secs``
(default :data:`ROUTER_DEFAULT_REQUEST_TIMEOUT_S`) bounds each request it forwards; one cut there
answers 500 and the router retries it (retryable: 408, 429, 500, 502, 503, 504) up to 5 attempts
in all, without aborting the first on the worker. ``--api-key`` guards ``/generate`` and the admin
routes (``/list_workers`` -> {"urls": [...]}, ``/flush_cache``, ...), not :data:`ROUTER_PUBLIC_PATHS`,
and is sent to the workers as their key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

PINNED_RELEASE = "0.5.3.post3"  # the oldest supported release (docs/SGLANG.md; the Docker image pins the newest)
FLATTENED_BUCKETS_SINCE = "0.5.6"  # the first release whose /update_weights_from_distributed takes load_format
ROUTER_DEFAULT_REQUEST_TIMEOUT_S = 1800  # sglang-router 0.2.0's --request-timeout-secs
ROUTER_RETRYABLE_STATUSES = (408, 429, 500, 502, 503, 504)
ROUTER_MAX_ATTEMPTS = 5
ROUTER_PUBLIC_PATHS = (
    "/liveness",
    "/readiness",
    "/health",
    "/health_generate",
    "/v1/models",
    "/get_model_info",
    "/get_server_info",
)
AUTH_EXEMPT_PREFIXES = ("/health", "/metrics")
DETERMINISTIC_ATTENTION_BACKENDS = ("flashinfer", "fa3", "triton")
NEWEST_CHECKED_RELEASE = "0.5.23"
WEIGHT_UPDATE_SESSIONS_SINCE = "0.5.21"  # /begin_weight_update and /end_weight_update around distributed updates
SEED_LIMIT = 2**31  # 0.5.3.post3 packs sampling seeds as int32: seeds stay in [0, SEED_LIMIT)
ROUTER_READY_PATH = "/readiness"  # 200 once the router has healthy workers (0.2.0 and 0.3.2)
ROUTER_KEY_CHECK_PATH = "/workers"  # GET, behind the router's --api-key (0.2.0 and 0.3.2)
# What the router's periodic worker checks ask (its --health-check-endpoint; default "/health", which
# generates a token in both releases, http_server.py: on a colocated server's released memory during
# training, or blocked behind a push's writer lock). /get_model_info reads the tokenizer manager's
# fields only (0.5.3.post3 http_server.py:468, 0.5.23 :802): a liveness check that never generates.
# Both router releases send their --api-key with it (tests/rollout/sglang/test_real_router.py).
ROUTER_HEALTH_CHECK_PATH = "/get_model_info"
ROUTER_HEALTH_CHECK_INTERVAL_S = 60  # sglang-router 0.2.0's and 0.3.2's --health-check-interval-secs
# Fields sglang-router 0.2.0 / 0.3.2 add to every /generate body it forwards (read off the wire).
ROUTER_GENERATE_FIELDS = (
    "log_metrics",
    "return_hidden_states",
    "background",
    "no_logs",
    "return_bytes",
    "return_entropy",
    "model",
)
ROUTED_EXPERTS_RELEASE = "0.5.7"  # the first release that returns routed experts (train.routing_replay=rollout)
RELEASES = (PINNED_RELEASE, NEWEST_CHECKED_RELEASE)  # the tested range's ends (setup.py's extra admits it)
ROUTER_RELEASES = ("0.2.0", "0.3.2")  # sglang-router: the oldest supported and the newest (run in CI)
# Renamed endpoints, the pinned release's name first (both releases still answer it).
MODEL_INFO_PATHS = ("/get_model_info", "/model_info")
SERVER_INFO_PATHS = ("/get_server_info", "/server_info")


def _is(kind) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))


def _optional(check) -> Callable[[Any], bool]:
    return lambda value: value is None or check(value)


def _list_of(check) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, list) and all(check(item) for item in value)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


_STR, _INT, _BOOL = _is(str), _is(int), _is(bool)
_INT_LIST = _list_of(_INT)
_RID = _optional(lambda value: _STR(value) or _list_of(_STR)(value))

# SGLang's SamplingParams keywords a request may carry (those we send, and their neighbours).
SAMPLING_FIELDS: Dict[str, Callable[[Any], bool]] = {
    "temperature": _number,
    "top_p": _number,
    "top_k": _INT,
    "min_p": _number,
    "max_new_tokens": _optional(_INT),
    "min_new_tokens": _INT,
    "stop": _optional(lambda v: _STR(v) or _list_of(_STR)(v)),
    "stop_token_ids": _optional(_INT_LIST),
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "sampling_seed": _INT,
    "frequency_penalty": _number,
    "presence_penalty": _number,
    "repetition_penalty": _number,
    "n": _INT,
}


@dataclass(frozen=True)
class SGLangEndpoint:
    """One endpoint: its methods, body fields (required / optional, each with a type check), releases."""

    path: str
    methods: Tuple[str, ...]
    required: Dict[str, Callable[[Any], bool]] = field(default_factory=dict)
    optional: Dict[str, Callable[[Any], bool]] = field(default_factory=dict)
    releases: Tuple[str, ...] = RELEASES


_GROUP = {"group_name": _STR}
_WEIGHT_UPDATE = {"flush_cache": _BOOL, "abort_all_requests": _BOOL, "weight_version": _optional(_STR)}
_DISTRIBUTED_BUCKET = {"names": _list_of(_STR), "dtypes": _list_of(_STR), "shapes": _list_of(_INT_LIST)}

_GENERATE = {
    "rid": _RID,
    "input_ids": lambda v: _INT_LIST(v) or _list_of(_INT_LIST)(v),
    "text": _optional(_STR),
    "sampling_params": _optional(lambda v: isinstance(v, dict)),
    "return_logprob": _optional(_BOOL),
    "stream": _BOOL,
    "logprob_start_len": _optional(_INT),
    "top_logprobs_num": _optional(_INT),
    "return_text_in_logprobs": _BOOL,
    # added by the routers (GenerateReqInput fields but "model", which SGLang ignores)
    **{name: _optional(_BOOL) for name in ROUTER_GENERATE_FIELDS if name != "model"},
    "model": _optional(_STR),
    "lora_path": _optional(lambda v: _STR(v) or _list_of(_optional(_STR))(v)),  # a loaded adapter's name
}
_SESSION = {"selector": _STR}
_LORA_NAME = {"lora_name": _STR}
_LORA_OPTIONAL = {"rid": _RID, "lora_id": _optional(_STR)}

ENDPOINTS: Tuple[SGLangEndpoint, ...] = (
    SGLangEndpoint("/generate", ("POST", "PUT"), optional=_GENERATE, releases=(PINNED_RELEASE,)),
    # return_routed_experts (sgl-project/sglang#12162, first released in 0.5.7): meta_info.routed_experts
    SGLangEndpoint(
        "/generate",
        ("POST", "PUT"),
        optional={**_GENERATE, "return_routed_experts": _BOOL},
        releases=(NEWEST_CHECKED_RELEASE,),
    ),
    SGLangEndpoint("/health", ("GET",)),
    SGLangEndpoint("/health_generate", ("GET",)),
    SGLangEndpoint("/get_model_info", ("GET",)),
    SGLangEndpoint("/model_info", ("GET",), releases=(NEWEST_CHECKED_RELEASE,)),
    SGLangEndpoint("/get_weight_version", ("GET",), releases=(PINNED_RELEASE,)),
    SGLangEndpoint("/get_server_info", ("GET",)),
    SGLangEndpoint("/server_info", ("GET",), releases=(NEWEST_CHECKED_RELEASE,)),
    SGLangEndpoint("/flush_cache", ("GET", "POST")),
    SGLangEndpoint("/abort_request", ("POST",), optional={"rid": _RID, "abort_all": _BOOL}),
    SGLangEndpoint(
        "/update_weights_from_disk",
        ("POST",),
        required={"model_path": _STR},
        optional={
            "rid": _RID,
            "load_format": _optional(_STR),
            "abort_all_requests": _BOOL,
            "weight_version": _optional(_STR),
            "is_async": _BOOL,
            "torch_empty_cache": _BOOL,
            "keep_pause": _BOOL,
            "token_step": _INT,
        },
    ),
    SGLangEndpoint(
        "/init_weights_update_group",
        ("POST",),
        required={"master_address": _STR, "master_port": _INT, "rank_offset": _INT, "world_size": _INT},
        optional={"rid": _RID, "backend": _STR, **_GROUP},
    ),
    SGLangEndpoint(
        "/update_weights_from_distributed",
        ("POST",),
        required=_DISTRIBUTED_BUCKET,
        optional={"rid": _RID, **_GROUP, **_WEIGHT_UPDATE},
        releases=(PINNED_RELEASE,),
    ),
    # load_format "flattened_bucket": the bucket as one uint8 broadcast (sgl-project/sglang#13824, 2025-11)
    SGLangEndpoint(
        "/update_weights_from_distributed",
        ("POST",),
        required=_DISTRIBUTED_BUCKET,
        optional={"rid": _RID, **_GROUP, **_WEIGHT_UPDATE, "load_format": _optional(_STR)},
        releases=(NEWEST_CHECKED_RELEASE,),
    ),
    SGLangEndpoint("/destroy_weights_update_group", ("POST",), optional={"rid": _RID, **_GROUP}),
    SGLangEndpoint("/begin_weight_update", ("POST",), optional=_SESSION, releases=(NEWEST_CHECKED_RELEASE,)),
    SGLangEndpoint("/end_weight_update", ("POST",), optional={}, releases=(NEWEST_CHECKED_RELEASE,)),
    SGLangEndpoint(
        "/load_lora_adapter",
        ("POST",),
        required={**_LORA_NAME, "lora_path": _STR},
        optional={**_LORA_OPTIONAL, "pinned": _BOOL},
    ),
    SGLangEndpoint("/unload_lora_adapter", ("POST",), required=_LORA_NAME, optional=_LORA_OPTIONAL),
    SGLangEndpoint(
        "/load_lora_adapter_from_tensors",
        ("POST",),
        required={
            **_LORA_NAME,
            "config_dict": lambda v: isinstance(v, dict),
            "serialized_named_tensors": _list_of(_STR),
        },
        optional={
            **_LORA_OPTIONAL,
            "pinned": _BOOL,
            "added_tokens_config": _optional(lambda v: isinstance(v, dict)),
            "load_format": _optional(_STR),
            "expected_checksums": _optional(lambda v: isinstance(v, dict)),
        },
        releases=(NEWEST_CHECKED_RELEASE,),
    ),
)


# Colocated placement (``rollout.placement=colocated``; servers launched with --enable-memory-saver).
# Memory tags (sglang/srt/constants.py): "weights" and "kv_cache" in 0.5.3.post3, "cuda_graph" too in
# 0.5.23 (releases in between unchecked: treated as without it, so it is never left released). Both
# releases: no tags = every tag the release has; a release runs only while the server is idle (0.5.23
# asserts it; 0.5.3.post3 would free the KV pool of running requests); resuming a tag that is not
# released fails (``offload_tags.remove``); both answer 200 with a null body once the scheduler is done.
MEMORY_TAGS_BY_RELEASE = {
    PINNED_RELEASE: ("weights", "kv_cache"),
    NEWEST_CHECKED_RELEASE: ("weights", "kv_cache", "cuda_graph"),
}
CUDA_GRAPH_TAG_SINCE = NEWEST_CHECKED_RELEASE
_TAGS = {"rid": _RID, "tags": _optional(_list_of(_STR))}
# /update_weights_from_tensor: one MultiprocessingSerializer blob (base64 of a ForkingPickler dump:
# CUDA IPC handles, not bytes) per TP rank of the server, indexed by its tp_rank; load_format
# "flattened_bucket" takes {"flattened_tensor", "metadata": [objects with name, shape, dtype,
# start_idx, end_idx, numel]} (0.5.3.post3 has it: model_runner._update_weights_from_flattened_bucket).
# 0.5.23 (weight_updater.py) answers success false outside a begin_weight_update / end_weight_update
# session, as for /update_weights_from_distributed (/update_weights_from_disk needs none).
_TENSOR_UPDATE = {"rid": _RID, "load_format": _optional(_STR), **_WEIGHT_UPDATE}
MEMORY_SAVER_ENDPOINTS: Tuple[SGLangEndpoint, ...] = (
    SGLangEndpoint("/release_memory_occupation", ("GET", "POST"), optional=_TAGS),
    SGLangEndpoint("/resume_memory_occupation", ("GET", "POST"), optional=_TAGS),
    SGLangEndpoint(
        "/update_weights_from_tensor",
        ("POST",),
        required={"serialized_named_tensors": _list_of(_STR)},
        optional=_TENSOR_UPDATE,
        releases=(PINNED_RELEASE,),
    ),
    SGLangEndpoint(
        "/update_weights_from_tensor",
        ("POST",),
        required={"serialized_named_tensors": _list_of(_STR)},
        optional={**_TENSOR_UPDATE, "selector": _STR, "torch_empty_cache": _BOOL},
        releases=(NEWEST_CHECKED_RELEASE,),
    ),
    # 0.5.3.post3: no body (abort and wait); 0.5.23: {mode: "abort" | "retract" | "in_place"}.
    SGLangEndpoint("/pause_generation", ("POST",), releases=(PINNED_RELEASE,)),
    SGLangEndpoint(
        "/pause_generation", ("POST",), optional={"rid": _RID, "mode": _STR}, releases=(NEWEST_CHECKED_RELEASE,)
    ),
    SGLangEndpoint("/continue_generation", ("POST",), releases=(PINNED_RELEASE,)),
    SGLangEndpoint(
        "/continue_generation",
        ("POST",),
        optional={"rid": _RID, "torch_empty_cache": _BOOL},
        releases=(NEWEST_CHECKED_RELEASE,),
    ),
)


def memory_tags(version: str) -> Tuple[str, ...]:
    """The memory-saver tags SGLang ``version`` (as ``/get_server_info`` reports it) knows."""
    return MEMORY_TAGS_BY_RELEASE[
        NEWEST_CHECKED_RELEASE if release_at_least(version, CUDA_GRAPH_TAG_SINCE) else PINNED_RELEASE
    ]


def endpoint(path: str, release: str = PINNED_RELEASE) -> Optional[SGLangEndpoint]:
    """The endpoint at ``path`` in ``release``, or None where that release has none (a 404)."""
    for candidate in ENDPOINTS + MEMORY_SAVER_ENDPOINTS:
        if candidate.path == path and release in candidate.releases:
            return candidate
    return None


def check_request(method: str, path: str, body: Any, release: str = PINNED_RELEASE) -> Optional[Tuple[int, str]]:
    """``(status, reason)`` SGLang ``release`` would refuse this request with (stricter on unknown
    fields, see the module docstring), or None when it is well-formed. ``body``: the parsed JSON, or
    None without one."""
    found = endpoint(path, release)
    if found is None:
        return 404, f"Not Found: SGLang {release} has no {path}"
    if method not in found.methods:
        return 405, f"Method Not Allowed: {method} {path} (allowed: {', '.join(found.methods)})"
    if not found.required and not found.optional:
        return None
    if not isinstance(body, dict):
        return 400, f"{path}: the body must be a JSON object, got {type(body).__name__}"
    missing = [name for name in found.required if name not in body]
    unknown = [name for name in body if name not in found.required and name not in found.optional]
    wrong = [
        name for name, check in {**found.required, **found.optional}.items() if name in body and not check(body[name])
    ]
    if path == "/generate" and isinstance(body.get("sampling_params"), dict):
        params = body["sampling_params"]
        unknown += [f"sampling_params.{name}" for name in params if name not in SAMPLING_FIELDS]
        wrong += [
            f"sampling_params.{name}"
            for name, value in params.items()
            if name in SAMPLING_FIELDS and not SAMPLING_FIELDS[name](value)
        ]
    problems = [
        f"{label}: {', '.join(names)}"
        for label, names in (("missing", missing), ("unknown", unknown), ("wrong type", wrong))
        if names
    ]
    return (400, f"{path}: " + "; ".join(problems)) if problems else None


def needs_api_key(method: str, path: str, router: bool = False) -> bool:
    """Whether a server (or, ``router``, sglang-router 0.2.0) launched with ``--api-key`` asks this
    request for ``Authorization: Bearer KEY``."""
    if router:
        return path not in ROUTER_PUBLIC_PATHS
    return method != "OPTIONS" and not path.startswith(AUTH_EXEMPT_PREFIXES)


def required_context_length(prompt_tokens: int, max_new_tokens: int) -> int:
    """The smallest ``--context-length`` that serves a ``prompt_tokens`` prompt its ``max_new_tokens``
    in full (see the module docstring: refused at prompt + new >= context, cut at context - 2)."""
    return prompt_tokens + max_new_tokens + 2


def served_tokens(server_info: Dict[str, Any]) -> Optional[int]:
    """The most prompt + max_new_tokens tokens a server (its ``/get_server_info`` answer) serves
    in full, or None when the answer says nothing about it: ``max_req_input_len + 4`` (the KV pool
    counted) or, without it, ``context_length - 2``."""
    if server_info.get("max_req_input_len") is not None:
        return int(server_info["max_req_input_len"]) + 4
    if server_info.get("context_length") is not None:
        return int(server_info["context_length"]) - 2
    return None


def release_at_least(version: str, release: str) -> bool:
    """Whether SGLang ``version`` (as ``/get_server_info`` reports it) is ``release`` or newer."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version) >= Version(release)
    except InvalidVersion:
        return False
