"""The real SGLang server on a CPU, for tests: its venvs, made from ``../shared/sglang-cpu``, and servers started
through the project's own launcher.

SGLang has no CPU package on the registry; the recipe folder beside the repository (``../shared/sglang-cpu``,
or ``ZCPO_SGLANG_CPU_RECIPE``) builds a venv per release with ``setup_venv.sh`` (torch 2.13.0 CPU, sglang
without its CUDA dependencies, a CPU kernel wheel; minutes, mostly downloads). :func:`ensure_venv` runs it
once per release into the test cache (``ZCPO_TEST_CACHE``, default ``~/.cache/megatron_zcpo/test-packages``,
folder ``sglang-cpu/<release>-<digest>``), keyed by the checksums of every file of the recipe, so a changed
recipe builds anew and the old venv is removed: ``python -m megatron_zcpo.testing.real_sglang_server build``
(``make test`` runs it first where the recipe exists). ``ZCPO_SGLANG_VENVS=DIR`` uses prebuilt venvs
``DIR/v<release>`` instead (a shared machine's).

:class:`RealSGLangServer` starts one server of a release with
:class:`~megatron_zcpo.rollout.sglang.server.SGLangLauncher` and its CPU profile (``device="cpu"``: the flags
of :data:`~megatron_zcpo.rollout.sglang.server.CPU_PROFILE_ARGS`) on :func:`tiny_model`, waits until it
generates, hands out clients attached to it (:meth:`RealSGLangServer.engine`) and stops it. Tests skip when
a release's venv is missing (:func:`venv_python` raises :class:`RealSGLangUnavailable`, whose message says how
to enable them); with ``ZCPO_REQUIRE_REAL_SGLANG=1`` (CI's ``.ci/run``) they fail instead.

Start-up takes 30 s to minutes on 2 cores; while writing tests, keep one server running with ``python -m
megatron_zcpo.testing.real_sglang_server serve --release 0.5.23`` and export the line it prints
(``ZCPO_REAL_SGLANG_URL_0_5_23=http://...``): :class:`SharedServers` then attaches to it instead of starting one.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional, Sequence

from megatron_zcpo.rollout.sglang.api import RELEASES

RECIPE_ENV = "ZCPO_SGLANG_CPU_RECIPE"  # the recipe folder (default: ../shared/sglang-cpu beside the repository)
VENVS_ENV = "ZCPO_SGLANG_VENVS"  # prebuilt venvs DIR/v<release>, used as they are
REQUIRED_ENV = "ZCPO_REQUIRE_REAL_SGLANG"  # "1": a missing venv is an error, not a skip (CI)
ATTACH_ENV = "ZCPO_REAL_SGLANG_URL_"  # + release with "_" for ".": tests use that running server (`serve`)
API_KEY = "real-sglang-test-key"  # the harness's servers' --api-key
SERVER_RELEASES = RELEASES  # the tested range's ends, each served by its own venv
_DONE = ".zcpo-venv-complete"
ENABLE_HINT = (
    f"run `python -m megatron_zcpo.testing.real_sglang_server build` (needs ../shared/sglang-cpu or "
    f"{RECIPE_ENV}; minutes per release) or point {VENVS_ENV} at prebuilt venvs v<release>"
)


class RealSGLangUnavailable(RuntimeError):
    """A release's venv is not there (or could not be built); the message says how to get it."""


def required() -> bool:
    """Whether the real-SGLang tests must run (``ZCPO_REQUIRE_REAL_SGLANG=1``): then a missing venv fails them."""
    return os.environ.get(REQUIRED_ENV, "") not in ("", "0")


def recipe_dir() -> Optional[Path]:
    """The recipe folder (``ZCPO_SGLANG_CPU_RECIPE``, else ``../shared/sglang-cpu`` beside the repository), or None."""
    configured = os.environ.get(RECIPE_ENV)
    path = Path(configured) if configured else Path(__file__).resolve().parents[2].parent / "shared" / "sglang-cpu"
    return path if (path / "setup_venv.sh").is_file() else None


def recipe_digest(recipe: Path) -> str:
    """SHA-256 over the recipe's files (their relative names and contents): the venvs' cache key."""
    digest = hashlib.sha256()
    for path in sorted(p for p in recipe.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(recipe)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cache_dir() -> Path:
    """Where the venvs are built (the test cache of :mod:`megatron_zcpo.testing.real_sglang`)."""
    from megatron_zcpo.testing.real_sglang import cache_dir as test_cache

    return test_cache() / "sglang-cpu"


def venv_dir(release: str) -> Path:
    """Where release ``release``'s venv is (``ZCPO_SGLANG_VENVS``) or is built (keyed by the recipe's digest)."""
    if release not in SERVER_RELEASES:
        raise ValueError(f"release {release!r}: the harness serves {SERVER_RELEASES}")
    if os.environ.get(VENVS_ENV):
        return Path(os.environ[VENVS_ENV]) / f"v{release}"
    recipe = recipe_dir()
    if recipe is None:
        raise RealSGLangUnavailable(f"no real SGLang {release}: {ENABLE_HINT}")
    return cache_dir() / f"{release}-{recipe_digest(recipe)[:16]}"


def venv_python(release: str) -> Path:
    """The interpreter of release ``release``'s venv; :class:`RealSGLangUnavailable` when it is not built."""
    venv = venv_dir(release)
    prebuilt = bool(os.environ.get(VENVS_ENV))
    python = venv / "bin" / "python"
    if not python.exists() or not (prebuilt or (venv / _DONE).exists()):
        raise RealSGLangUnavailable(f"no real SGLang {release} venv at {venv}: {ENABLE_HINT}")
    return python


def ensure_venv(release: str, log: Callable[[str], None] = print) -> Path:
    """Build release ``release``'s venv with the recipe's ``setup_venv.sh`` unless it is there (one builder at
    a time: a lock beside it); returns its interpreter. Raises :class:`RealSGLangUnavailable` naming the log."""
    venv = venv_dir(release)
    if os.environ.get(VENVS_ENV):
        return venv_python(release)
    recipe = recipe_dir()
    assert recipe is not None  # venv_dir raised otherwise
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{release}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (venv / _DONE).exists():
            return venv / "bin" / "python"
        shutil.rmtree(venv, ignore_errors=True)  # a build that stopped half-way
        build_log = venv.parent / f"{venv.name}.log"
        log(f"building the real SGLang {release} CPU venv in {venv} (log: {build_log})")
        start = time.monotonic()
        with open(build_log, "w") as out:
            done = subprocess.run(
                ["bash", str(recipe / "setup_venv.sh"), str(venv)],
                env=dict(os.environ, SGLANG_VERSION=release),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        seconds = time.monotonic() - start
        if done.returncode != 0:
            raise RealSGLangUnavailable(
                f"building the real SGLang {release} venv failed (exit {done.returncode}); see {build_log}"
            )
        (venv / _DONE).write_text(f"{seconds:.0f} s\n")
        for stale in venv.parent.glob(f"{release}-*"):  # venvs of an older recipe
            if stale.is_dir() and stale != venv:
                shutil.rmtree(stale, ignore_errors=True)
        log(f"real SGLang {release} CPU venv built in {seconds:.0f} s")
    return venv / "bin" / "python"


# The demo's tiny Qwen2 (its tokenizer, task and architecture; no warm-up), with hidden and MLP sizes off the
# 32-wide tiles of SGLang's AMX CPU kernels: those repack every linear layer whose input size is a multiple
# of 32 after loading and replace its bias by a parameter without a weight loader, so the first weight update
# of the demo's own sizes (128 / 256; Qwen2's qkv bias) kills the scheduler (layers/amx_utils.py, both
# releases, on CPUs with AMX: this machine's and CI's). Unpacked, every weight transport loads as on a GPU.
TINY_MODEL = dict(size=300, vocab_size=300, hidden_size=112, intermediate_size=240, sft_max_steps=2)


def tiny_model(cache: Optional[Path] = None) -> Path:
    """The servers' model (:data:`TINY_MODEL`, built once by the demo's own builder and cached): a Hugging
    Face directory with its tokenizer and the task's train.jsonl / eval.jsonl prompts."""
    from megatron_zcpo.recipe.demo_assets import DemoSpec, build_demo_assets

    spec = dataclasses.replace(DemoSpec(), **TINY_MODEL)
    return build_demo_assets(spec, cache or cache_dir() / "models", log=lambda line: None)


class RealSGLangServer:
    """One real SGLang ``release`` server on ``127.0.0.1`` (a free port) serving ``model_dir``, started with
    the project's launcher in its CPU profile; logs under ``log_dir``. ``context_length``: its
    ``--context-length``; ``api_key``: its ``--api-key`` (every request but /health* needs it);
    ``launch``: more :class:`~megatron_zcpo.rollout.sglang.server.SGLangServerConfig` fields. A context
    manager; :meth:`start` returns once it generates (raises ``RolloutError`` with its log's tail if not)."""

    def __init__(
        self,
        release: str,
        model_dir: Path,
        log_dir: Path,
        *,
        context_length: int = 128,
        api_key: str = API_KEY,
        startup_timeout_s: float = 600.0,
        **launch,
    ):
        from megatron_zcpo.rollout.sglang.server import SGLangLauncher, SGLangServerConfig
        from megatron_zcpo.utils.runtime import free_port

        self.release, self.api_key, self.startup_timeout_s = release, api_key, startup_timeout_s
        config = SGLangServerConfig(
            model_path=str(model_dir),
            device="cpu",
            python=str(venv_python(release)),
            nodes=["127.0.0.1"],
            base_port=free_port(),
            router=False,
            log_dir=str(log_dir),
            context_length=context_length,
            api_key=api_key,
            startup_timeout_s=startup_timeout_s,
            **launch,
        )
        # The server's own interpreter and environment: nothing of the test process's Python set-up.
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "TRITON_INTERPRET")}
        self.launcher = SGLangLauncher(config, env=env)
        self.startup_s: Optional[float] = None

    @property
    def url(self) -> str:
        return self.launcher.server_urls[0]

    def start(self) -> RealSGLangServer:
        """Launch and wait until ``/health_generate`` answers 200."""
        from megatron_zcpo.rollout.engine import RolloutError

        start = time.monotonic()
        self.launcher.start()
        try:
            with self.engine() as engine:
                engine.wait_until_healthy(self.startup_timeout_s, poll_s=1.0, is_alive=self.launcher.alive)
        except RolloutError as err:
            report = self.launcher.failure_report(40) or self.log_tail()
            self.stop()
            raise RolloutError(f"real SGLang {self.release} did not start: {err}\n{report}") from None
        self.startup_s = time.monotonic() - start
        return self

    def engine(self, **client_options):
        """A client (:class:`~megatron_zcpo.rollout.sglang.client.SGLangEngine`) attached to this server with
        its key; shutting it down leaves the server running."""
        from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

        options = {"api_key": self.api_key, **client_options}
        return SGLangEngine(SGLangEngineConfig(server_urls=[self.url], **options))

    def alive(self) -> bool:
        """Whether the server's processes still run (a request that kills the scheduler ends them all)."""
        return self.launcher.alive()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server's log."""
        path = next(iter(self.launcher._logs.values()), None)
        if path is None or not os.path.exists(path):
            return ""
        with open(path, errors="replace") as log:
            return "".join(log.readlines()[-lines:])

    def stop(self) -> None:
        """Stop the server's process group (the launcher's SIGINT, then SIGKILL after 10 s)."""
        self.launcher.stop(grace_s=10.0)

    def __enter__(self) -> RealSGLangServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class AttachedServer(RealSGLangServer):
    """A server of ``release`` someone else started (``serve``) at ``url`` with the harness's key: used, never stopped."""

    def __init__(self, release: str, url: str):
        self.release, self.api_key, self._url, self.startup_s = release, API_KEY, url.rstrip("/"), 0.0

    @property
    def url(self) -> str:
        return self._url

    def alive(self) -> bool:
        """Whether it answers (``/get_model_info``: ``/health`` generates, and waits while memory is released)."""
        import urllib.request

        request = urllib.request.Request(self.url + "/get_model_info", headers={"Authorization": f"Bearer {API_KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        return f"(attached to {self.url}: see the log of its `serve`)"

    def stop(self) -> None:
        """Left running: its `serve` owns it."""


def attach_env(release: str) -> str:
    """The variable naming a running server of ``release`` to attach to."""
    return ATTACH_ENV + release.replace(".", "_")


class SharedServers:
    """The servers tests share: one per release, started on first use (:meth:`get`) and kept, at most one
    at a time (starting one stops the other), all under ``root`` (model cache aside); a release named by
    ``ZCPO_REAL_SGLANG_URL_<release>`` is attached to instead. Tests that kill a server (``killers``:
    {release: how many}, run after the release's other tests) get one each from :meth:`victim`: the shared
    one first, then spares started in the background while the tests before them run, one at a time, so
    at most two servers live at once."""

    def __init__(self, root: Path, killers: Optional[dict] = None, **server_options):
        self.root, self.server_options = Path(root), server_options
        self.killers = dict(killers or {})
        self.servers: dict = {}
        self._spares: dict = {}  # release -> (server, thread starting it)

    def _new(self, release: str) -> RealSGLangServer:
        index = sum(1 for _ in self.root.glob(f"logs-{release}-*"))
        return RealSGLangServer(release, tiny_model(), self.root / f"logs-{release}-{index}", **self.server_options)

    def get(self, release: str) -> RealSGLangServer:
        """Release ``release``'s shared server, started now unless it runs (a dead one is started anew)."""
        server = self.servers.get(release)
        if server is not None and server.alive():
            return server
        if os.environ.get(attach_env(release)):
            self.servers[release] = AttachedServer(release, os.environ[attach_env(release)])
            return self.servers[release]
        self.stop_all()
        self.servers[release] = self._new(release).start()
        if self.killers.get(release, 0) > 1:  # the first killer takes the shared server, the next a spare
            self._start_spare(release)
        return self.servers[release]

    def _start_spare(self, release: str) -> None:
        import threading

        server = self._new(release)
        errors: List[BaseException] = []

        def start():
            try:
                server.start()
            except BaseException as err:  # reported by victim()
                errors.append(err)

        thread = threading.Thread(target=start, name=f"spare-sglang-{release}", daemon=True)
        thread.start()
        self._spares[release] = (server, thread, errors)

    def victim(self, release: str) -> RealSGLangServer:
        """A server of ``release`` for a test that kills it (the shared one, else the spare, started now if
        none); starts the next spare when more such tests follow."""
        self.killers[release] = self.killers.get(release, 1) - 1
        server = self.servers.pop(release, None)
        if server is None or isinstance(server, AttachedServer) or not server.alive():
            if release not in self._spares:
                self._start_spare(release)
            server, thread, errors = self._spares.pop(release)
            thread.join()
            if errors:
                raise errors[0]
        if self.killers[release] > 0 and release not in self._spares:
            self._start_spare(release)
        return server

    def stop_all(self) -> None:
        """Stop every shared server and spare."""
        for server in self.servers.values():
            server.stop()
        for server, thread, _ in self._spares.values():
            thread.join()
            server.stop()
        self.servers.clear()
        self._spares.clear()


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m megatron_zcpo.testing.real_sglang_server build [--release R ...]``: make the venvs (once;
    a missing recipe is a no-op unless ``ZCPO_REQUIRE_REAL_SGLANG=1``). ``path --release R``: print one's
    interpreter. ``serve --release R``: run a server as the tests start it until interrupted, printing the
    variable that makes the tests attach to it."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("command", choices=("build", "path", "serve"))
    parser.add_argument("--release", action="append", choices=SERVER_RELEASES, default=None)
    args = parser.parse_args(argv)
    releases: List[str] = args.release or list(SERVER_RELEASES)
    if args.command == "path":
        for release in releases:
            print(venv_python(release))
        return 0
    if args.command == "serve":
        import signal
        import tempfile

        stopped: List[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(1))
        with RealSGLangServer(releases[0], tiny_model(), Path(tempfile.mkdtemp(prefix="real-sglang-"))) as server:
            print(f"export {attach_env(releases[0])}={server.url}  # up after {server.startup_s:.0f} s", flush=True)
            try:
                while not stopped and server.alive():
                    time.sleep(1.0)
            except KeyboardInterrupt:
                pass
        return 0
    if recipe_dir() is None and not os.environ.get(VENVS_ENV):
        print(f"real SGLang: no recipe (../shared/sglang-cpu or {RECIPE_ENV}); its tests will skip")
        return 1 if required() else 0
    failed = False
    for release in releases:
        try:
            print(f"real SGLang {release}: {ensure_venv(release)}", flush=True)
        except RealSGLangUnavailable as err:
            print(f"real SGLang {release}: {err}", file=sys.stderr, flush=True)
            failed = True
    return 1 if failed and required() else 0


if __name__ == "__main__":
    sys.exit(main())
