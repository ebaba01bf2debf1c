"""The real SGLang parts a CPU runs, for tests: sglang-router's binary and SGLang's own request schema.

sglang-router is a compiled binary in a pip wheel that runs on a CPU: :func:`router_package` installs
one release (with its Python dependencies) with pip into a per-version folder of a cache
(``ZCPO_TEST_CACHE``, default ``~/.cache/megatron_zcpo/test-packages``) once, and
:class:`RealRouter` runs ``python -m sglang_router.launch_router`` from it in front of given
workers. SGLang itself needs CUDA; its wheel is only downloaded (``pip download --no-deps``) and
unpacked (:func:`sglang_source`) so that tests read the release's own files: 0.5.23's generated
``/generate`` JSON contract (``sglang/api/v1/api_types.py``, needs only msgspec) and every
release's ``server_args.py`` (the launch flags). A download that fails raises
:class:`PackageUnavailable`, which tests turn into a skip naming the package.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from types import ModuleType
from typing import List, Optional, Set

ROUTER_RELEASES = ("0.2.0", "0.3.2")  # the Dockerfile's pin, and the newest on PyPI (2026-12)
_DONE = ".complete"


class PackageUnavailable(RuntimeError):
    """pip could not fetch a package (no registry); the message names it and pip's last words."""


def cache_dir() -> Path:
    """Where installed and unpacked test packages are kept between sessions."""
    return Path(os.environ.get("ZCPO_TEST_CACHE", Path.home() / ".cache" / "megatron_zcpo" / "test-packages"))


def _pip(args: List[str], what: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise PackageUnavailable(f"pip could not fetch {what}: {done.stderr.strip()[-500:]}")


def pip_target(requirement: str, name: str) -> Path:
    """``pip install --target`` of ``requirement`` (with its dependencies) into the cache folder ``name``, once."""
    target = cache_dir() / name
    if not (target / _DONE).exists():
        target.mkdir(parents=True, exist_ok=True)
        _pip(["install", "--upgrade", "--target", str(target), requirement], requirement)
        (target / _DONE).touch()
    return target


def router_package(version: str) -> Path:
    """The folder holding sglang-router ``version`` and its dependencies (put it on PYTHONPATH)."""
    return pip_target(f"sglang-router=={version}", f"sglang-router-{version}")


def sglang_source(version: str) -> Path:
    """The unpacked wheel of sglang ``version`` (no dependencies: read, not run)."""
    target = cache_dir() / f"sglang-{version}"
    if not (target / _DONE).exists():
        wheels = target / "wheel"
        wheels.mkdir(parents=True, exist_ok=True)
        _pip(["download", "--no-deps", "-d", str(wheels), f"sglang=={version}"], f"sglang=={version}")
        with zipfile.ZipFile(next(wheels.glob("sglang-*.whl"))) as wheel:
            wheel.extractall(target, [n for n in wheel.namelist() if n.startswith("sglang/")])
        (target / _DONE).touch()
    return target


def generate_contract(version: str) -> ModuleType:
    """SGLang ``version``'s generated ``/generate`` JSON contract (``sglang.api.v1.api_types``, 0.5.23's
    schema check: ``GenerateRequest.from_json_value(body)`` raises ``JsonContractError``)."""
    path = sglang_source(version) / "sglang" / "api" / "v1" / "api_types.py"
    if not path.exists():
        raise FileNotFoundError(f"sglang {version} has no {path.name} (no JSON contract before 0.5.23)")
    sys.path.insert(0, str(pip_target("msgspec", "msgspec")))
    try:
        spec = importlib.util.spec_from_file_location(f"sglang_api_types_{version.replace('.', '_')}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.pop(0)
    return module


def launch_flags(version: str) -> Set[str]:
    """Every ``--flag`` of ``python -m sglang.launch_server`` in sglang ``version``, read from its
    ``server_args.py`` without importing it (that needs CUDA packages): the option strings of
    ``add_argument`` calls, and (0.5.23 derives flags from its dataclass fields) the ``ServerArgs`` fields."""
    tree = ast.parse((sglang_source(version) / "sglang" / "srt" / "server_args.py").read_text())
    flags = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            flags.update(a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("--"))
        if isinstance(node, ast.ClassDef) and node.name == "ServerArgs":
            flags.update(
                "--" + item.target.id.replace("_", "-")
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    return flags


class RealRouter:
    """``python -m sglang_router.launch_router`` of sglang-router ``version`` in front of ``worker_urls``
    on ``127.0.0.1:port``, from :func:`router_package`; a context manager that waits until it
    answers ``/readiness`` with every worker healthy, and stops it."""

    def __init__(self, version: str, worker_urls: List[str], port: int, api_key: Optional[str] = None):
        self.version, self.worker_urls, self.port, self.api_key = version, list(worker_urls), port, api_key
        self._process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RealRouter:
        command = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *self.worker_urls]
        command += ["--host", "127.0.0.1", "--port", str(self.port), "--policy", "round_robin"]
        command += ["--api-key", self.api_key] if self.api_key else []
        env = dict(os.environ, PYTHONPATH=str(router_package(self.version)))
        self._process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"sglang-router {self.version} exited with {self._process.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/readiness", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"sglang-router {self.version} not ready within 60 s")

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
