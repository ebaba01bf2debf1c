"""The real SGLang parts a CPU runs, for tests: sglang-router's binary and SGLang's own request schema.

sglang-router is a compiled binary in a pip wheel that runs on a CPU: :func:`router_package` installs
one release (with its Python dependencies) with pip into a per-version folder of a cache
(``ZCPO_TEST_CACHE``, default ``~/.cache/megatron_zcpo/test-packages``) once, and
:class:`RealRouter` runs ``python -m sglang_router.launch_router`` from it in front of given
workers. SGLang itself needs CUDA; its wheel is only downloaded (``pip download --no-deps``) and
unpacked (:func:`sglang_source`) so that tests read the release's own files: 0.5.23's generated
``/generate`` JSON contract (``sglang/api/v1/api_types.py``, needs only msgspec), every release's
request classes and sampling parameters (read from ``io_struct.py`` / ``sampling_params.py``
without importing them) and its launch-argument parser (``ServerArgs.add_cli_args``, imported in a
subprocess with the few pure-Python packages of :data:`PARSER_DEPENDENCIES`: no CUDA needed), and its
CUDA IPC deserialisation (``utils/patch_torch.py`` with ``MultiprocessingSerializer`` / ``SafeUnpickler``
cut out of ``utils/common.py``, :func:`open_blobs_with_wheel`, on fake GPUs). A download that fails raises
:class:`PackageUnavailable`, which tests turn into a skip naming the package.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from types import ModuleType
from typing import Iterator, List, Optional, Set, Tuple, Union

from megatron_zcpo.rollout.sglang.api import ROUTER_RELEASES

__all__ = [
    "ROUTER_RELEASES",
    "PackageUnavailable",
    "RealRouter",
    "generate_contract",
    "open_blobs_with_wheel",
    "parse_launch_args",
]

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


@contextlib.contextmanager
def _filling(target: Path) -> Iterator[bool]:
    """Hold ``target``'s lock (another process, e.g. a second pytest worker, may fill it at the same time);
    yields whether it still needs filling, and marks it complete when the block ends without an error."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        needed = not (target / _DONE).exists()
        yield needed
        if needed:
            (target / _DONE).touch()


def pip_target(requirement: str, name: str) -> Path:
    """``pip install --target`` of ``requirement`` (with its dependencies) into the cache folder ``name``, once."""
    target = cache_dir() / name
    with _filling(target) as needed:
        if needed:
            target.mkdir(parents=True, exist_ok=True)
            _pip(["install", "--upgrade", "--target", str(target), *requirement.split()], requirement)
    return target


def router_package(version: str) -> Path:
    """The folder holding sglang-router ``version`` and its dependencies (put it on PYTHONPATH)."""
    return pip_target(f"sglang-router=={version}", f"sglang-router-{version}")


def sglang_source(version: str) -> Path:
    """The unpacked wheel of sglang ``version`` (no dependencies: read, not run)."""
    target = cache_dir() / f"sglang-{version}"
    with _filling(target) as needed:
        if needed:
            wheels = target / "wheel"
            wheels.mkdir(parents=True, exist_ok=True)
            _pip(["download", "--no-deps", "-d", str(wheels), f"sglang=={version}"], f"sglang=={version}")
            with zipfile.ZipFile(next(wheels.glob("sglang-*.whl"))) as wheel:
                wheel.extractall(target, [n for n in wheel.namelist() if n.startswith("sglang/")])
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


# What importing sglang.srt.server_args needs besides torch and transformers (0.5.3.post3 and 0.5.23).
PARSER_DEPENDENCIES = (
    "orjson pybase64 msgspec requests starlette fastapi pyzmq ipython openai partial_json_parser sentencepiece"
)
_PARSE = """
import argparse, contextlib, io, json, sys
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
request, answers = json.loads(sys.stdin.read()), []
for argv in request["argvs"]:
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parsed = vars(parser.parse_args(argv))
        answers.append({key: value for key, value in parsed.items() if key in request["keys"]})
    except SystemExit:
        answers.append(errors.getvalue().strip().splitlines()[-1])
print(json.dumps(answers))
"""


def parse_launch_args(version: str, argvs: List[List[str]], keys: List[str]) -> List[Union[dict, str]]:
    """Each of ``argvs`` (arguments of ``python -m sglang.launch_server``) parsed by sglang ``version``'s
    own parser (``ServerArgs.add_cli_args``, one subprocess): the parsed values of ``keys``, or
    argparse's error line where that release refuses them."""
    path = os.pathsep.join([str(pip_target(PARSER_DEPENDENCIES, "sglang-parser-deps")), str(sglang_source(version))])
    done = subprocess.run(
        [sys.executable, "-c", _PARSE],
        input=json.dumps({"argvs": argvs, "keys": keys}),
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sglang {version}'s parser did not load: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _class_fields(tree: ast.Module, name: str) -> Set[str]:
    """The annotated fields of class ``name`` and of its bases defined in the same module."""
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    node = classes[name]
    fields = {
        item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    }
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields |= _class_fields(tree, base.id)
    return fields


def request_fields(version: str, class_name: str) -> Set[str]:
    """The fields of request class ``class_name`` of sglang ``version``'s ``managers/io_struct.py``
    (what an HTTP body of that endpoint may carry), read without importing it."""
    return _class_fields(
        ast.parse((sglang_source(version) / "sglang/srt/managers/io_struct.py").read_text()), class_name
    )


def sampling_fields(version: str) -> Set[str]:
    """The keywords of sglang ``version``'s ``SamplingParams`` (``sampling/sampling_params.py``): its
    ``__init__`` arguments (0.5.3.post3) or struct fields (0.5.23)."""
    tree = ast.parse((sglang_source(version) / "sglang/srt/sampling/sampling_params.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
    if init is not None:
        return {arg.arg for arg in init.args.args + init.args.kwonlyargs} - {"self"}
    return _class_fields(tree, "SamplingParams")


# SGLang's own CUDA IPC deserialisation, run on a CPU: only the wheel's utils/patch_torch.py (imported as
# it is) and its MultiprocessingSerializer / SafeUnpickler / _safe_load_torch_storage (cut out of
# utils/common.py, whose imports need CUDA packages), with the fake GPUs of testing/fake_cuda_ipc.py.
_OPEN_BLOBS = """
import ast, base64, functools, importlib, io, json, os, pickle, sys, types
from multiprocessing.reduction import ForkingPickler
import torch
from torch.multiprocessing import reductions
from megatron_zcpo.testing.fake_cuda_ipc import open_fake_cuda_handle
request = json.loads(sys.stdin.read())
root, visible = request["root"], []
for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
    package = types.ModuleType(name)
    package.__path__ = [os.path.join(root, *name.split("."))]
    sys.modules[name] = package
path = os.path.join(root, "sglang", "srt", "utils", "common.py")
tree = ast.parse(open(path).read())
kept = [n for n in tree.body if getattr(n, "name", None) in ("MultiprocessingSerializer", "SafeUnpickler", "_safe_load_torch_storage")]
common = types.ModuleType("sglang.srt.utils.common")
release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
common.__dict__.update(io=io, pickle=pickle, torch=torch, ForkingPickler=ForkingPickler, pybase64=base64,
                       is_npu=lambda: False, is_musa=lambda: False, torch_release=release)
exec(compile(ast.Module(body=kept, type_ignores=[]), path, "exec"), common.__dict__)
sys.modules["sglang.srt.utils.common"] = common
sys.modules["sglang.srt.utils"].__dict__.update(is_npu=common.is_npu)
patch_torch = importlib.import_module("sglang.srt.utils.patch_torch")
torch.cuda.device_count = lambda: len(visible)  # the GPUs this TP rank's process sees
torch.cuda.get_device_properties = lambda index: types.SimpleNamespace(uuid=visible[index])
reductions.rebuild_cuda_tensor = functools.partial(open_fake_cuda_handle, visible)  # torch's, on emulated handles
patch_torch.monkey_patch_torch_reductions()  # the scheduler's step before it unpickles (tp_worker.py)
answers = []
for blob, sees in request["cases"]:
    visible[:] = sees
    try:
        received = common.MultiprocessingSerializer.deserialize(blob)
        flat = received["flattened_tensor"]
        answers.append({"device": getattr(flat, "fake_device", None), "values": flat.double().tolist(),
                        "names": [meta.name for meta in received["metadata"]]})
    except Exception as error:
        answers.append({"error": f"{type(error).__name__}: {error}"})
print(json.dumps(answers))
"""


def open_blobs_with_wheel(version: str, cases: List[Tuple[str, List[str]]]) -> List[dict]:
    """Each (blob, visible) of ``cases`` (a ``serialized_named_tensors`` entry of a flattened bucket, the
    UUIDs of the GPUs a TP rank's process sees: fake ones, :mod:`megatron_zcpo.testing.fake_cuda_ipc`)
    opened by sglang ``version``'s own code: {"device": the index it opened on, "values", "names"} or
    {"error": what SGLang raised}. One subprocess (the patches stay out of the caller)."""
    done = subprocess.run(
        [sys.executable, "-c", _OPEN_BLOBS],
        input=json.dumps({"root": str(sglang_source(version)), "cases": cases}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        raise RuntimeError(f"sglang {version}'s deserialiser did not run: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class RealRouter:
    """sglang-router ``version`` (from :func:`router_package`) in front of ``worker_urls`` on
    ``127.0.0.1:port`` (worker checks every ``health_check_interval_s``), launched with the command line the launcher uses
    (:func:`~megatron_zcpo.rollout.sglang.server.router_command`); a context manager that waits until it
    answers ``/readiness`` with every worker healthy, and stops it."""

    def __init__(
        self,
        version: str,
        worker_urls: List[str],
        port: int,
        api_key: Optional[str] = None,
        health_check_interval_s: int = 60,
    ):
        self.version, self.worker_urls, self.port, self.api_key = version, list(worker_urls), port, api_key
        self.health_check_interval_s = health_check_interval_s
        self._process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> RealRouter:
        from megatron_zcpo.rollout.sglang.server import SGLangServerConfig, router_command
        from megatron_zcpo.utils.runtime import free_port

        launch = SGLangServerConfig(
            model_path="-",
            router_port=self.port,
            router_metrics_port=free_port(),  # its metrics exporter binds 29000 on every interface by default
            router_policy="round_robin",
            router_health_check_interval_s=self.health_check_interval_s,
        )
        command = router_command(self.worker_urls, launch, "127.0.0.1", self.api_key)  # the launcher's own line
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
