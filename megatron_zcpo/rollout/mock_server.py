"""A local HTTP server speaking SGLang's native API over any RolloutEngine (tests, CPU smoke runs).

It speaks the API of one SGLang release (:mod:`megatron_zcpo.rollout.sglang_api`: the pinned
0.5.3.post3 by default, or the newest checked one, whose /generate also returns the routed experts
of MoE models when its backend records them): every request is validated against that
release's endpoint table first, so an unknown path answers 404, another method 405 and a body
with a missing, unknown or mistyped field 400, as SGLang does (stricter on unknown fields). It
serves /generate from a backend engine (e.g. :class:`EmbeddedEngine`), loads pushed weights into
it (received by broadcast in a weight-update group, or read from safetensors on disk), and can
misbehave on purpose: ``faults`` maps an endpoint path to actions used by its next requests, in
order: "drop" (close the connection without answering), "503", "hang" (never answer), or a
corruption of a /generate answer at output position 1 (position 0 of a one-token answer):
"bad_token" (an id far outside any vocabulary), "nan_logprob", "positive_logprob" or
"mismatched_ids" (``output_token_logprobs`` names another token).
``random_faults`` (a probability) adds a random "drop", "503" or "hang" to /generate requests
(soak runs: benchmarks/soak.py), each appended to ``fault_log`` when given.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Any, Dict, List, Optional

from megatron_zcpo.rollout.engine import RolloutEngine, SamplingParams
from megatron_zcpo.rollout.sglang_api import PINNED_RELEASE, RELEASES, check_request
from megatron_zcpo.rollout.sglang_client import encode_routed_experts
from megatron_zcpo.rollout.weight_sync import init_custom_process_group, receive_bucket

CORRUPTIONS = ("bad_token", "nan_logprob", "positive_logprob", "mismatched_ids")
FAULTS = ("drop", "503", "hang", *CORRUPTIONS)


class MockSGLangServer:
    """Serve ``backend`` on ``host:port`` (0: any free port) from a background thread.

    ``tp_size`` is what ``/get_server_info`` reports, i.e. how many ranks this server takes in a
    weight-update group (the mock joins with one process and counts as ``tp_size`` = 1).
    ``release``: the SGLang release whose API it speaks. ``events`` records (path, detail) of every
    request, for tests: detail "ok", a fault action, or the status a refused request got.
    """

    def __init__(self, backend: RolloutEngine, *, host: str = "127.0.0.1", port: int = 0,
                 faults: Optional[Dict[str, List[str]]] = None, release: str = PINNED_RELEASE,
                 random_faults: float = 0.0, seed: int = 0, fault_log: Optional[str] = None):
        if release not in RELEASES:
            raise ValueError(f"release {release!r}: the mock speaks {RELEASES}")
        self.release = release
        for path, actions in (faults or {}).items():
            unknown = [a for a in actions if a not in FAULTS]
            if unknown:
                raise ValueError(f"faults[{path!r}] has unknown actions {unknown}; choose from {FAULTS}")
        self.backend = backend
        self.host, self.port = host, port
        self.faults = {path: list(actions) for path, actions in (faults or {}).items()}
        self.random_faults, self._random, self.fault_log = random_faults, random.Random(seed), fault_log
        self.events: List[tuple] = []
        self.served_version = "default"  # SGLang's initial --weight-version
        self.running_rids: set = set()
        self.aborted_rids: set = set()
        self._groups: Dict[str, Any] = {}
        self._backend_lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._runner = None
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- lifecycle -----------------------------------------------------------------------------

    def start(self) -> str:
        """Start serving; returns the base URL."""
        self._thread = threading.Thread(target=self._serve, name="mock-sglang", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise RuntimeError("mock SGLang server did not start within 30s")
        return self.url

    def _serve(self) -> None:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=2**30)
        self._handlers = {
            "/generate": self._generate, "/health": self._health, "/health_generate": self._health,
            "/get_model_info": self._model_info, "/model_info": self._model_info,
            "/get_weight_version": self._get_weight_version,
            "/get_server_info": self._server_info, "/server_info": self._server_info,
            "/flush_cache": self._flush_cache, "/abort_request": self._abort_request,
            "/update_weights_from_disk": self._update_from_disk, "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._update_from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
        }
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        self._runner = web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self._runner.cleanup())
        leftovers = asyncio.all_tasks(self._loop)  # e.g. "hang" handlers
        for task in leftovers:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        self._loop.close()

    def stop(self) -> None:
        """Stop serving (pending "hang" requests are cancelled)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> "MockSGLangServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- plumbing ------------------------------------------------------------------------------

    async def _dispatch(self, request):
        """Validate against the release's API (404 / 405 / 400 like SGLang), then faults, then the handler."""
        from aiohttp import web

        path = request.path
        body = None
        if request.can_read_body:
            try:
                body = await request.json()
            except ValueError:
                body = "<not JSON>"
        refused = check_request(request.method, path, body, self.release)
        if refused is not None:
            status, reason = refused
            self.events.append((path, str(status)))
            if status == 404:
                return web.json_response({"detail": "Not Found"}, status=404)
            if status == 405:
                return web.json_response({"detail": "Method Not Allowed"}, status=405)
            return web.json_response({"error": {"message": reason, "type": "Bad Request", "code": 400}}, status=400)
        queue = self.faults.get(path)
        action = queue.pop(0) if queue else None
        if action is None and path == "/generate" and self._random.random() < self.random_faults:
            action = self._random.choice(("drop", "503", "hang"))
            if self.fault_log:
                with open(self.fault_log, "a") as log:
                    log.write(f"{self.port} {action}\n")
        self.events.append((path, action or "ok"))
        if action == "503":
            return web.Response(status=503, text="Service Unavailable")
        if action == "hang":
            await asyncio.sleep(3600)
        if action == "drop":
            request.transport.close()
            raise ConnectionResetError("mock server dropped the connection")
        if action in CORRUPTIONS:
            request["corrupt"] = action
        return await self._handlers[path](request)

    async def _blocking(self, fn, *args):
        """Run ``fn`` off the event loop (the backend computes; group operations block)."""
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    def _run_backend(self, fn, *args):
        with self._backend_lock:
            return fn(*args)

    @staticmethod
    def _result(success: bool, message: str):
        from aiohttp import web

        return web.json_response({"success": success, "message": message}, status=200 if success else 400)

    # -- endpoints -----------------------------------------------------------------------------

    async def _generate(self, request):
        from aiohttp import web

        body = await request.json()
        input_ids = body.get("input_ids")
        if not input_ids or body.get("stream"):
            return web.json_response({"error": {"message": "mock server needs input_ids and stream=false"}}, status=400)
        batch = isinstance(input_ids[0], list)
        prompts = input_ids if batch else [input_ids]
        sampling = dict(body.get("sampling_params") or {})
        params = SamplingParams(
            temperature=sampling.get("temperature", 1.0),
            top_p=sampling.get("top_p", 1.0),
            top_k=sampling.get("top_k", -1),
            max_new_tokens=sampling.get("max_new_tokens", 128),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
            seed=sampling.get("sampling_seed"),
        )
        rid = body.get("rid") or "mock"
        self.running_rids.add(rid)
        try:
            results = await self._blocking(self._run_backend, self.backend.generate, prompts, params, 1)
        finally:
            self.running_rids.discard(rid)
        answers = []
        for [completion] in results:
            routed = body.get("return_routed_experts") and completion.routed_experts is not None
            answers.append({
                "text": "",
                "output_ids": completion.output_ids,
                "meta_info": {
                    "id": rid,
                    "finish_reason": {"type": completion.finish_reason},
                    "prompt_tokens": len(completion.prompt_ids),
                    "completion_tokens": len(completion.output_ids),
                    "cached_tokens": 0,
                    "output_token_logprobs": [[lp, tok, None] for lp, tok in zip(completion.output_logprobs, completion.output_ids)],
                    "weight_version": self.served_version,
                    **({"routed_experts": encode_routed_experts(completion.routed_experts)} if routed else {}),
                },
            })
        if request.get("corrupt"):
            _corrupt(answers[0], request["corrupt"])
        return web.json_response(answers if batch else answers[0])

    async def _health(self, request):
        from aiohttp import web

        return web.Response(status=200)

    async def _model_info(self, request):
        from aiohttp import web

        return web.json_response({"model_path": "mock", "tokenizer_path": "mock", "is_generation": True,
                                  "preferred_sampling_params": None, "weight_version": self.served_version})

    async def _server_info(self, request):
        from aiohttp import web

        return web.json_response({"tp_size": 1, "dp_size": 1, "version": f"mock-{self.release}"})

    async def _get_weight_version(self, request):
        from aiohttp import web

        return web.json_response({"weight_version": self.served_version})

    async def _flush_cache(self, request):
        from aiohttp import web

        if self.running_rids:
            return web.Response(status=400, text="Cache not flushed: requests are running.\n")
        return web.Response(status=200, text="Cache flushed.\n")

    async def _abort_request(self, request):
        from aiohttp import web

        body = await request.json()
        self.aborted_rids.add("*" if body.get("abort_all") else body.get("rid"))
        if body.get("abort_all"):
            self.running_rids.clear()  # SGLang ends every running request
        return web.Response(status=200)

    async def _update_from_disk(self, request):
        body = await request.json()
        try:
            await self._blocking(self._load_checkpoint, body["model_path"], body.get("weight_version"))
        except (OSError, KeyError, ValueError) as err:
            return self._result(False, f"Failed to update weights: {err}")
        return self._result(True, "Succeeded to update model weights.")

    async def _init_group(self, request):
        body = await request.json()
        try:
            group = await self._blocking(
                init_custom_process_group, body["backend"], body["master_address"], body["master_port"],
                body["rank_offset"], body["world_size"], body["group_name"],
            )
        except Exception as err:  # noqa: BLE001 - reported to the client like SGLang does
            return self._result(False, f"Failed to init group: {err!r}")
        self._groups[body["group_name"]] = group
        return self._result(True, "Succeeded to initialize custom process group.")

    async def _update_from_distributed(self, request):
        body = await request.json()
        group = self._groups.get(body.get("group_name"))
        if group is None:
            return self._result(False, f"no weight-update group named {body.get('group_name')!r}")
        flattened = body.get("load_format") == "flattened_bucket"
        received = await self._blocking(receive_bucket, body["names"], body["dtypes"], body["shapes"], group,
                                        "cpu", 0, flattened)
        try:
            await self._blocking(self._load, received, body.get("weight_version"))
        except (KeyError, ValueError) as err:
            return self._result(False, f"Failed to update weights: {err}")
        return self._result(True, "Succeeded to update parameter online.")

    async def _destroy_group(self, request):
        import torch.distributed as dist

        body = await request.json()
        group = self._groups.pop(body.get("group_name"), None)
        if group is None:
            return self._result(False, f"no weight-update group named {body.get('group_name')!r}")
        dist.destroy_process_group(group)
        return self._result(True, "Succeeded to destroy custom process group.")

    def _load_checkpoint(self, directory: str, weight_version: Optional[str]) -> None:
        from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

        with SafetensorsCheckpoint(directory) as checkpoint:
            self._load(((name, checkpoint.tensor(name)) for name in checkpoint.names()), weight_version)

    def _load(self, named_tensors, weight_version: Optional[str]) -> None:
        version = int(weight_version) if weight_version is not None else self.backend.weight_version()
        self._run_backend(self.backend.update_weights, named_tensors, version)
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
    """``python -m megatron_zcpo.rollout.mock_server --model-path DIR --port P``: a CPU stand-in for
    ``sglang.launch_server`` (other SGLang arguments are accepted and ignored) that serves the
    Hugging Face checkpoint in DIR with the embedded engine until terminated."""
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
    parser.add_argument("--fault-rate", type=float, default=0.0, help="probability of a random /generate fault")
    parser.add_argument("--fault-log", default=None, help="append each random fault to this file")
    args, _ = parser.parse_known_args(argv)
    engine = EmbeddedEngine(model_config_from_hf(read_hf_config(args.model_path)), seed=args.random_seed)
    with SafetensorsCheckpoint(args.model_path) as checkpoint:
        engine.update_weights(((name, checkpoint.tensor(name)) for name in checkpoint.names()), version=0)
    server = MockSGLangServer(engine, host=args.host, port=args.port, random_faults=args.fault_rate,
                              seed=args.random_seed, fault_log=args.fault_log)
    server.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    stopped.wait()
    server.stop()


if __name__ == "__main__":
    main()
