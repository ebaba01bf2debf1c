"""A local HTTP server speaking SGLang's native API over any RolloutEngine (tests, CPU smoke runs).

It speaks the API of one SGLang release (:mod:`megatron_zcpo.rollout.sglang.api`: the pinned
0.5.3.post3 by default, or the newest checked one, whose /generate also returns the routed experts
of MoE models when its backend records them): with an ``api_key`` a request without it
answers 401 (the /health paths excepted); every request is then validated against that
release's endpoint table, so an unknown path answers 404, another method 405 and a body with a
missing, unknown or mistyped field 400, as SGLang does (stricter on unknown top-level fields, which
SGLang ignores). It behaves like the release where a run depends on it (see that module's
docstring): a prompt that does not fit the context length is refused with 400 and
``max_new_tokens`` cut as SGLang's scheduler cuts it; per-request seeds are used only with
``deterministic_inference``; weight updates are served one at a time; a ``/generate`` that arrives
while generation is paused waits for ``/continue_generation``, and one running when a pause or an
abort arrives answers with finish reason "abort". Answers, refusals and messages are the
release's own (:mod:`megatron_zcpo.testing.mock_answers`, held against the real servers), the
prompt tokens in front of ``output_ids`` included (0.5.3.post3 without ``skip_tokenizer_init``).
``/get_server_info`` reports what the client checks at start-up. It serves /generate from a backend engine (e.g. :class:`EmbeddedEngine`), each answer
no sooner than ``generate_delay_s`` (cluster time scales in CI), loads pushed weights into it
(received by broadcast in a weight-update group, or read from safetensors on disk), and can
misbehave on purpose: ``faults`` maps an endpoint path to actions used by its next requests, in
order: "drop" (close the connection without answering), "503", "hang" (never answer), or a
corruption of a /generate answer at output position 1 (position 0 of a one-token answer):
"bad_token" (an id far outside any vocabulary), "nan_logprob", "positive_logprob" or
"mismatched_ids" (``output_token_logprobs`` names another token).
``random_faults`` (a probability) adds a random "drop", "503" or "hang" to /generate requests
(soak runs: benchmarks/soak.py), each appended to ``fault_log`` when given. LoRA serving
(``enable_lora``, ``max_lora_rank``, ``lora_target_modules``: SGLang's launch flags) is
:mod:`megatron_zcpo.testing.mock_lora`'s.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Dict, List, Optional, Sequence

from megatron_zcpo.rollout.engine import RolloutEngine, SamplingParams
from megatron_zcpo.rollout.memory import MemoryLedger
from megatron_zcpo.rollout.sglang.api import (
    PINNED_RELEASE,
    RELEASES,
    SEED_LIMIT,
    WEIGHT_UPDATE_SESSIONS_SINCE,
    check_request,
    needs_api_key,
    release_at_least,
)
from megatron_zcpo.rollout.sglang.generate_io import encode_routed_experts
from megatron_zcpo.rollout.weight_sync import init_custom_process_group, receive_bucket
from megatron_zcpo.testing import mock_answers
from megatron_zcpo.testing.mock_continuous import ContinuousBatchingEndpoints
from megatron_zcpo.testing.mock_http import BackgroundHTTPServer
from megatron_zcpo.testing.mock_lora import LoraEndpoints
from megatron_zcpo.testing.mock_memory_saver import MEMORY_FAULTS, MemorySaverEndpoints

CORRUPTIONS = ("bad_token", "nan_logprob", "positive_logprob", "mismatched_ids")
FAULTS = ("drop", "503", "hang", *CORRUPTIONS, *MEMORY_FAULTS)
# Requests that join a weight-update group's collective: two groups' in flight at once can deadlock.
COLLECTIVE_UPDATES = ("/init_weights_update_group", "/update_weights_from_distributed")


class MockSGLangServer(ContinuousBatchingEndpoints, LoraEndpoints, MemorySaverEndpoints, BackgroundHTTPServer):
    """Serve ``backend`` on ``host:port`` (0: any free port) from a background thread.

    ``tp_size`` is what ``/get_server_info`` reports: how many blobs ``/update_weights_from_tensor``
    takes (TP rank k on ``gpus[k]``), and how many ranks it would take in a weight-update group (the
    mock joins one with one process: only at ``tp_size`` 1).
    ``release``: the SGLang release whose API it speaks. ``events`` records (path, detail) of every
    request, for tests: detail "ok", a fault action, or the status a refused request got.
    Launch settings, as SGLang's flags: ``context_length`` (``--context-length``; None: the
    model's, ``model_context_length``), ``max_total_num_tokens`` (the KV pool),
    ``deterministic_inference`` (``--enable-deterministic-inference``: per-request seeds are
    used), ``api_key`` (``--api-key``), ``skip_tokenizer_init`` (``--skip-tokenizer-init``, as the launchers
    start SGLang; false: the answers carry ``text`` and, on 0.5.3.post3, prompt tokens in front of
    ``output_ids``). ``weight_updates`` logs ("start" | "end", path, group) of
    the weight updates in the order served; ``update_overlaps`` the (group, other group) of every
    collective request that arrived while another group's was in flight here. Colocated placement
    (:mod:`megatron_zcpo.testing.mock_memory_saver`): ``memory_saver`` (``--enable-memory-saver``),
    the ``gpus`` it occupies, each memory tag's bytes per GPU (``memory_sizes``) booked in ``ledger``
    (shared with a test's trainer side), ``release_lag_s`` of a "late_release" fault,
    ``weights_cpu_backup`` (``--enable-weights-cpu-backup``), ``static_scales``: parameters the server
    loaded from its checkpoint that no push carries (FP8's ``input_scale``), lost at a release of the
    weights without the backup.
    ``continuous``: /generate runs on the backend's asynchronous requests, concurrent ones sharing its
    batches, and /pause_generation holds or aborts them as the release does
    (:mod:`megatron_zcpo.testing.mock_continuous`; asynchronous rollouts; no LoRA adapter).
    """

    thread_name = "mock-sglang"

    def __init__(
        self,
        backend: RolloutEngine,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        faults: Optional[Dict[str, List[str]]] = None,
        release: str = PINNED_RELEASE,
        random_faults: float = 0.0,
        seed: int = 0,
        fault_log: Optional[str] = None,
        context_length: Optional[int] = None,
        model_context_length: int = 32768,
        max_total_num_tokens: int = 2**20,
        deterministic_inference: bool = False,
        api_key: Optional[str] = None,
        generate_delay_s: float = 0.0,
        memory_saver: bool = False,
        tp_size: int = 1,
        gpus: Optional[Sequence[int]] = None,
        memory_sizes: Optional[Dict[str, int]] = None,
        ledger: Optional[MemoryLedger] = None,
        release_lag_s: float = 0.5,
        skip_tokenizer_init: bool = True,
        enable_lora: bool = False,
        max_lora_rank: Optional[int] = None,
        lora_target_modules: Sequence[str] = (),
        weights_cpu_backup: bool = False,
        static_scales: Optional[Dict[str, Any]] = None,
        continuous: bool = False,
    ):
        if release not in RELEASES:
            raise ValueError(f"release {release!r}: the mock speaks {RELEASES}")
        super().__init__(host, port)
        self.release = release
        for path, actions in (faults or {}).items():
            unknown = [a for a in actions if a not in FAULTS]
            if unknown:
                raise ValueError(f"faults[{path!r}] has unknown actions {unknown}; choose from {FAULTS}")
        self.backend = backend
        self.faults = {path: list(actions) for path, actions in (faults or {}).items()}
        self.random_faults, self._random, self.fault_log = random_faults, random.Random(seed), fault_log
        self.events: List[tuple] = []
        self.context_length, self.deterministic_inference, self.api_key = (
            context_length,
            deterministic_inference,
            api_key,
        )
        self.tokenizer = not skip_tokenizer_init
        # SGLang's scheduler: max_req_len = min(context - 1, KV pool - 1), max_req_input_len = max_req_len - 5
        self.max_req_len = min((context_length or model_context_length) - 1, max_total_num_tokens - 1)
        self.max_total_num_tokens, self.generate_delay_s = max_total_num_tokens, generate_delay_s
        self.weight_updates: List[tuple] = []
        self.update_overlaps: List[tuple] = []
        self._updates_in_flight: Dict[str, int] = {}
        self._update_lock = threading.Lock()  # SGLang serves weight updates one at a time
        self.served_version = "default"  # SGLang's initial --weight-version
        self.running_rids: set = set()
        self.aborted_rids: set = set()
        self._groups: Dict[str, Any] = {}
        self.sessions = release_at_least(release, WEIGHT_UPDATE_SESSIONS_SINCE)  # the release's protocol
        self.session_open = False
        self.int32_seeds = release == PINNED_RELEASE  # 0.5.3.post3's seed packing (0.5.23: int64)
        # prompt + max_new_tokens == context: refused by 0.5.3.post3 (>=), served by 0.5.23 (> context)
        self.total_slack = 0 if release == PINNED_RELEASE else 1
        self.crashed: Optional[str] = None  # why the scheduler died (every request is then dropped)
        self._backend_lock = threading.Lock()
        self._handlers = {
            "/generate": self._generate,
            "/health": self._health,
            "/health_generate": self._health,
            "/get_model_info": self._model_info,
            "/model_info": self._model_info,
            "/get_weight_version": self._get_weight_version,
            "/get_server_info": self._server_info,
            "/server_info": self._server_info,
            "/flush_cache": self._flush_cache,
            "/abort_request": self._abort_request,
            "/update_weights_from_disk": self._update_from_disk,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/begin_weight_update": self._begin_session,
            "/end_weight_update": self._end_session,
        }
        self.tp_size = tp_size
        gpus = tuple(range(tp_size)) if gpus is None else tuple(gpus)
        if len(gpus) != tp_size:
            raise ValueError(f"gpus={gpus}: a server at tp_size {tp_size} has one GPU per TP rank")
        self._init_memory_saver(memory_saver, gpus, memory_sizes, ledger, release_lag_s)
        self._init_lora(enable_lora, max_lora_rank, lora_target_modules)
        self.weights_cpu_backup = weights_cpu_backup
        self.static_scales = {name: tensor.clone() for name, tensor in (static_scales or {}).items()}
        self._init_continuous(continuous)

    # -- plumbing ------------------------------------------------------------------------------

    async def _dispatch(self, request):
        """The API key (401), then the release's API (404 / 405 / 400 like SGLang), then faults, then the handler."""
        from aiohttp import web

        path = request.path
        if self.dead:  # died mid-update: nothing answers any more
            request.transport.close()
            raise ConnectionResetError("mock server is dead")
        if self.crashed is not None:  # the process is gone
            request.transport.close()
            raise ConnectionResetError(f"mock server crashed: {self.crashed}")
        if (
            self.api_key is not None
            and needs_api_key(request.method, path)
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            self.events.append((path, "401"))
            return web.json_response({"error": "Unauthorized"}, status=401)
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = "<not JSON>"
        if path == "/generate" and isinstance(body, dict) and isinstance(body.get("sampling_params"), dict):
            answered = mock_answers.sampling_refusal(self.release, body["sampling_params"])
            if answered is not None:
                self.events.append((path, str(answered[0])))
                if isinstance(answered[1], str):
                    return web.Response(status=answered[0], text=answered[1])
                return web.json_response(answered[1], status=answered[0])
        refused = check_request(request.method, path, body, self.release)
        if refused is not None:
            status, reason = refused
            self.events.append((path, str(status)))
            if status == 404:
                return web.json_response({"detail": "Not Found"}, status=404)
            if status == 405:
                return web.json_response({"detail": "Method Not Allowed"}, status=405)
            return web.json_response(mock_answers.validation_error(reason), status=400)
        if path == "/generate" and isinstance(body, dict):
            too_long = self._context_refusal(body)
            if too_long is not None:
                self.events.append((path, "400"))
                return web.json_response(mock_answers.context_error(too_long[1]), status=400)
        queue = self.faults.get(path)
        action = queue.pop(0) if queue else None
        if action is None and path == "/generate" and self._random.random() < self.random_faults:
            action = self._random.choice(("drop", "503", "hang"))
            if self.fault_log:
                with open(self.fault_log, "a") as log:
                    log.write(f"{self.port} {action}\n")
        self.events.append((path, action or "ok"))
        if action in ("503", "502"):
            return web.Response(status=int(action), text="Service Unavailable" if action == "503" else "Bad Gateway")
        if action == "die":
            self.dead = True
            request.transport.close()
            raise ConnectionResetError("mock server died")
        if action == "hang":
            await asyncio.sleep(3600)
        if action == "drop":
            request.transport.close()
            raise ConnectionResetError("mock server dropped the connection")
        if action in CORRUPTIONS:
            request["corrupt"] = action
        if action == "late_release":
            request["fault"] = action
        return await self._handlers[path](request)

    async def _blocking(self, fn, *args):
        """Run ``fn`` off the event loop (the backend computes; group operations block)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _run_backend(self, fn, *args):
        with self._backend_lock:
            return fn(*args)

    @staticmethod
    def _result(success: bool, message: str, **more):
        from aiohttp import web

        return web.json_response({"success": success, "message": message, **more}, status=200 if success else 400)

    # -- endpoints -----------------------------------------------------------------------------

    async def _generate(self, request):
        from aiohttp import web

        body = await request.json()
        await self.generation_allowed.wait()  # SGLang holds a request that arrives while paused
        refusal = self.memory_refusal("generate") or self.lora_refusal(body)
        if refusal:
            return self._refuse(refusal)
        input_ids = body.get("input_ids")
        if not input_ids or body.get("stream"):
            return web.json_response({"error": {"message": "mock server needs input_ids and stream=false"}}, status=400)
        batch = isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
        sampling = dict(body.get("sampling_params") or {})
        seed = 42 if sampling.get("sampling_seed") is None else sampling["sampling_seed"]  # SGLang's default
        if self.deterministic_inference and self.int32_seeds and not -SEED_LIMIT <= seed < SEED_LIMIT:
            self._crash(request, f"scheduler: sampling_seed {seed} cannot be converted to type int32 without overflow")
        max_new_tokens = sampling.get("max_new_tokens", 128)
        params = SamplingParams(
            temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0),
            top_k=sampling.get("top_k", -1),
            # the scheduler's cut: max_req_len - prompt - 1 (one length for the batch: the mock's simplification)
            max_new_tokens=min(max_new_tokens, min(self.max_req_len - len(p) - 1 for p in prompts)),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
            seed=seed if self.deterministic_inference else None,
        )
        rid = body.get("rid") or "mock"
        self.running_rids.add(rid)
        try:
            await asyncio.sleep(self.generate_delay_s)
            if self.continuous:
                results = await self._complete_continuously(prompts, params, rid)
            else:
                results = await self._blocking(
                    self._run_backend, self._generate_with, body.get("lora_path"), prompts, params
                )
        finally:
            # a pause or an abort that arrived meanwhile cleared it: SGLang ends the request as aborted
            aborted = rid not in self.running_rids
            self.running_rids.discard(rid)
        answers = []
        for prompt, [completion] in zip(prompts, results):
            routed = body.get("return_routed_experts") and completion.routed_experts is not None
            answer = mock_answers.generate_answer(
                self.release,
                logprobs_asked=bool(body.get("return_logprob")),
                rid=rid,
                prompt_ids=prompt,
                output_ids=completion.output_ids,
                logprobs=completion.output_logprobs,
                finish="abort" if aborted else completion.finish_reason,
                weight_version=self.served_version,
                tokenizer=self.tokenizer,
                output_versions=completion.output_versions,
            )
            if routed:
                answer["meta_info"]["routed_experts"] = encode_routed_experts(completion.routed_experts)
            answers.append(answer)
        if request.get("corrupt"):
            _corrupt(answers[0], request["corrupt"])
        return web.json_response(answers if batch else answers[0])

    def _generate_with(self, adapter: Optional[str], prompts, params):
        """The backend's samples with ``adapter``'s weights (None: the base); under the backend lock."""
        self.serve_adapter(adapter)
        return self.backend.generate(prompts, params, 1)

    def _context_refusal(self, body) -> Optional[tuple]:
        """(400, SGLang's message) for a /generate prompt that does not fit the context length, or None."""
        input_ids = body.get("input_ids") or []
        prompts = input_ids if input_ids and isinstance(input_ids[0], list) else [input_ids]
        max_new_tokens = (body.get("sampling_params") or {}).get("max_new_tokens", 128)
        context = self.max_req_len + 1 if self.context_length is None else self.context_length
        refusal = None
        for prompt in prompts:
            if len(prompt) >= context:
                refusal = (
                    f"The input ({len(prompt)} tokens) is longer than the model's context length ({context} tokens)."
                )
            elif max_new_tokens is not None and len(prompt) + max_new_tokens >= context + self.total_slack:
                refusal = (
                    f"Requested token count exceeds the model's maximum context length of {context} tokens. "
                    f"You requested a total of {len(prompt) + max_new_tokens} tokens: {len(prompt)} tokens "
                    f"from the input messages and {max_new_tokens} tokens for the completion. Please reduce the "
                    f"number of tokens in the input messages or the completion to fit within the limit."
                )
            elif len(prompt) >= self.max_req_len - 5:
                refusal = (
                    f"Input length ({len(prompt)} tokens) exceeds the maximum allowed length "
                    f"({self.max_req_len - 5} tokens)."
                )
            if refusal:
                return 400, refusal
        return None

    async def _health(self, request):
        from aiohttp import web

        status = self.health_generation(request)  # SGLang's /health and /health_generate run a token
        return web.Response(status=status)

    async def _model_info(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "model_path": "mock",
                "tokenizer_path": "mock",
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.served_version,
            }
        )

    async def _server_info(self, request):
        from aiohttp import web

        return web.json_response(
            {
                "tp_size": self.tp_size,
                "dp_size": 1,
                "version": self.release,
                "context_length": self.context_length,
                "max_total_num_tokens": self.max_total_num_tokens,
                "max_req_input_len": self.max_req_len - 5,
                "enable_deterministic_inference": self.deterministic_inference,
                "sampling_backend": "pytorch" if self.deterministic_inference else "flashinfer",
                "enable_memory_saver": self.memory_saver,
                **self.lora_server_info(),
                "enable_weights_cpu_backup": self.weights_cpu_backup,
                "skip_tokenizer_init": not self.tokenizer,
            }
        )

    async def _get_weight_version(self, request):
        from aiohttp import web

        return web.json_response({"weight_version": self.served_version})

    async def _flush_cache(self, request):
        from aiohttp import web

        status, text = mock_answers.flush_answer(self.release, self.flush_refused())
        return web.Response(status=status, text=text)

    async def _abort_request(self, request):
        from aiohttp import web

        body = await request.json()
        self.aborted_rids.add("*" if body.get("abort_all") else body.get("rid"))
        if self.continuous:
            self._abort_continuous(None if body.get("abort_all") else body.get("rid"))
        if body.get("abort_all"):
            self.running_rids.clear()  # SGLang ends every running request
        else:
            self.running_rids.discard(body.get("rid"))
        return web.Response(status=200)

    async def _one_at_a_time(self, path: str, group: Optional[str], fn, *args):
        """Run weight update ``fn(*args)`` off the loop once no other update runs here (SGLang's order)."""
        if path in COLLECTIVE_UPDATES:
            self.update_overlaps.extend(
                (group, other) for other, count in self._updates_in_flight.items() if count and other != group
            )
            self._updates_in_flight[group] = self._updates_in_flight.get(group, 0) + 1

        def serially():
            with self._update_lock:
                self.weight_updates.append(("start", path, group))
                try:
                    return fn(*args)
                finally:
                    self.weight_updates.append(("end", path, group))

        try:
            return await self._blocking(serially)
        finally:
            if path in COLLECTIVE_UPDATES:
                self._updates_in_flight[group] -= 1

    async def _update_from_disk(self, request):
        body = await request.json()
        if self.memory_refusal("update_weights"):
            return self._result(False, self.memory_refusal("update_weights"))
        try:
            await self._one_at_a_time(
                request.path, None, self._load_checkpoint, body["model_path"], body.get("weight_version")
            )
        except (OSError, KeyError, ValueError) as err:  # SGLang's message when it cannot read the checkpoint
            return self._result(False, f"Failed to get weights iterator: {err}.", num_paused_requests=0)
        return self._result(True, "Succeeded to update model weights.", num_paused_requests=0)

    async def _init_group(self, request):
        body = await request.json()
        if self.tp_size != 1:
            return self._result(False, f"the mock joins weight-update groups as one rank, not tp_size {self.tp_size}")
        try:
            group = await self._one_at_a_time(
                request.path,
                body["group_name"],
                init_custom_process_group,
                body["backend"],
                body["master_address"],
                body["master_port"],
                body["rank_offset"],
                body["world_size"],
                body["group_name"],
            )
        except Exception as err:
            return self._result(False, f"Failed to init group: {err!r}")
        self._groups[body["group_name"]] = group
        return self._result(True, "Succeeded to initialize custom process group.")

    async def _update_from_distributed(self, request):
        body = await request.json()
        if self.memory_refusal("update_weights"):
            return self._result(False, self.memory_refusal("update_weights"))
        if self.sessions and not self.session_open:
            return self._result(
                False, "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"
            )
        group = self._groups.get(body.get("group_name"))
        if group is None:
            return self._result(False, f"no weight-update group named {body.get('group_name')!r}")
        flattened = body.get("load_format") == "flattened_bucket"

        def receive_and_load():
            received = receive_bucket(body["names"], body["dtypes"], body["shapes"], group, "cpu", 0, flattened)
            self._load(received, body.get("weight_version"))

        try:
            await self._one_at_a_time(request.path, body.get("group_name"), receive_and_load)
        except (KeyError, ValueError) as err:
            return self._result(False, f"Failed to update weights: {err}")
        return self._result(True, "Succeeded to update parameter online.")

    async def _destroy_group(self, request):
        import torch.distributed as dist

        body = await request.json()
        group = self._groups.pop(body.get("group_name"), None)
        if group is None:
            return self._result(False, f"no weight-update group named {body.get('group_name')!r}")
        await self._one_at_a_time(request.path, body.get("group_name"), dist.destroy_process_group, group)
        return self._result(True, "Succeeded to destroy custom process group.")

    async def _begin_session(self, request):
        if self.session_open:
            return self._result(False, "a weight-update session is already open; call end_weight_update() first")
        self.session_open = True
        self.weight_updates.append(("session", request.path, None))
        return self._result(True, "Success")

    async def _end_session(self, request):
        if not self.session_open:
            return self._result(False, "no weight-update session is open; call begin_weight_update() first")
        self.session_open = False
        self.weight_updates.append(("session", request.path, None))
        return self._result(True, "Success")

    def _load_checkpoint(self, directory: str, weight_version: Optional[str]) -> None:
        from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

        with SafetensorsCheckpoint(directory) as checkpoint:
            self._load(((name, checkpoint.tensor(name)) for name in checkpoint.names()), weight_version)

    def _load(self, named_tensors, weight_version: Optional[str]) -> None:
        version = int(weight_version) if weight_version is not None else self.backend.weight_version()
        # Under --enable-lora the adapted projections are renamed: SGLang's load_weights passes them over.
        kept = ((name, tensor) for name, tensor in named_tensors if not self.skips_under_lora(name))
        self._run_backend(self.backend.update_weights, kept, version)
        if weight_version is not None:
            self.served_version = str(weight_version)


def _corrupt(answer: Dict[str, Any], action: str) -> None:
    """Apply one of :data:`CORRUPTIONS` to a /generate answer, at output position 1 (or 0)."""
    entries = answer["meta_info"]["output_token_logprobs"]
    if not entries:
        return
    position = min(1, len(entries) - 1)
    if action == "bad_token":
        answer["output_ids"][position] = entries[position][1] = 10**9
    elif action == "nan_logprob":
        entries[position][0] = float("nan")
    elif action == "positive_logprob":
        entries[position][0] = 0.5
    else:
        entries[position][1] += 1


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron_zcpo.testing.mock_server --model-path DIR --port P``: a CPU stand-in for
    ``sglang.launch_server`` (other SGLang arguments are accepted and ignored) that serves the
    Hugging Face checkpoint in DIR with the embedded engine until terminated (on ``--node-rank`` > 0,
    a multi-node server's other nodes, it only waits, as SGLang's serve no HTTP)."""
    import argparse
    import signal

    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint, read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--context-length", type=int, default=None)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int, default=None)
    parser.add_argument("--lora-target-modules", nargs="*", default=[])
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--fault-rate", type=float, default=0.0, help="probability of a random /generate fault")
    parser.add_argument("--fault-log", default=None, help="append each random fault to this file")
    parser.add_argument("--generate-delay-s", type=float, default=0.0, help="each /generate answers no sooner")
    parser.add_argument(
        "--record-dir",
        default=None,
        help="on exit, write the requests, weight updates and update overlaps to DIR/<port>.json",
    )
    parser.add_argument("--node-rank", type=int, default=0, help="a server spanning nodes: this node's rank")
    args, _ = parser.parse_known_args(argv)
    stopped = threading.Event()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # as SGLang (uvicorn) and the router stop on either
        signal.signal(stop_signal, lambda *_: stopped.set())
    if args.node_rank > 0:  # as SGLang's: only a multi-node server's first node serves HTTP
        stopped.wait()
        return
    engine = EmbeddedEngine(model_config_from_hf(read_hf_config(args.model_path)), seed=args.random_seed)
    with SafetensorsCheckpoint(args.model_path) as checkpoint:
        engine.update_weights(((name, checkpoint.tensor(name)) for name in checkpoint.names()), version=0)
    server = MockSGLangServer(
        engine,
        host=args.host,
        port=args.port,
        random_faults=args.fault_rate,
        seed=args.random_seed,
        fault_log=args.fault_log,
        context_length=args.context_length,
        model_context_length=engine.model_config.max_position_embeddings,
        deterministic_inference=args.enable_deterministic_inference,
        api_key=args.api_key,
        generate_delay_s=args.generate_delay_s,
        memory_saver=args.enable_memory_saver,
        skip_tokenizer_init=args.skip_tokenizer_init,
        enable_lora=args.enable_lora,
        max_lora_rank=args.max_lora_rank,
        lora_target_modules=args.lora_target_modules,
        weights_cpu_backup=args.enable_weights_cpu_backup,
    )
    server.start()
    stopped.wait()
    server.stop()
    if args.record_dir:
        import json
        import os

        with open(os.path.join(args.record_dir, f"{server.port}.json"), "w") as record:
            json.dump(
                {
                    "events": server.events,
                    "weight_updates": server.weight_updates,
                    "update_overlaps": server.update_overlaps,
                },
                record,
            )


if __name__ == "__main__":
    main()
