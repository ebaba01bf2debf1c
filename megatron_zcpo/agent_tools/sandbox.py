"""The code tool: model-written Python run as hostile code, isolated by bubblewrap, limits over the whole call.

Every call is treated as an attack (the policy being trained writes it, and RL learns whatever the
reward allows). With ``isolation: bwrap`` (the default) a call runs in new namespaces
(:mod:`~megatron_zcpo.agent_tools.bubblewrap`) over a read-only view of the interpreter, the system
libraries and an allow-list of packages (:mod:`~megatron_zcpo.agent_tools.sandbox_view`), with a
size-limited tmpfs as its only writable place, a seccomp filter, an environment built from an
allow-list, and limits over its whole process tree (:mod:`~megatron_zcpo.agent_tools.supervisor`);
when the call returns, every process it started has ended. Where that cannot be had, :meth:`CodeTool.check`
refuses naming what is missing. ``isolation: none`` is an explicit, logged opt-out.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import tempfile
import time
from typing import Any, Dict, List, Optional

from megatron_zcpo.agent_tools.base import Tool, ToolResult
from megatron_zcpo.agent_tools.bubblewrap import (
    SANDBOX_CODE,
    SANDBOX_UID,
    USERNS_HINT,
    SandboxUnavailableError,
    bwrap_arguments,
    find_bwrap,
    start_bwrap,
)
from megatron_zcpo.agent_tools.sandbox_view import SANDBOX_PACKAGES, installed_default_packages, sandbox_view
from megatron_zcpo.agent_tools.seccomp import seccomp_filter
from megatron_zcpo.agent_tools.supervisor import Outcome, TreeLimits, supervise

logger = logging.getLogger(__name__)

ISOLATIONS = ("bwrap", "none")
OPTIONS = (
    "timeout_s",
    "cpu_s",
    "memory_mb",
    "network",
    "isolation",
    "packages",
    "max_processes",
    "disk_mb",
    "max_files",
    "max_output_bytes",
    "env",
)
# The environment of every call: nothing is copied from the trainer's; ``env`` adds to it. One thread
# per numerical library: a call is one of tools.max_workers at once, and OpenBLAS's per-thread buffers
# would otherwise take the address space limit.
BASE_ENV = {
    "HOME": "/tmp",
    "TMPDIR": "/tmp",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_MAX_OPEN_FILES = 256  # per process: bounds what pipes and sockets can hold in the kernel

# Runs first in the sandbox, before any code of the call: the per-process limits (RLIMIT_NPROC here,
# inside the call's own user namespace, so that it counts the call's processes only), the switch to
# the sandbox's uid (as root), no inherited descriptor, the packages on sys.path; then the call's
# code as __main__.
_BOOTSTRAP = """
import json, os, resource, sys
spec = json.loads(sys.argv[1])
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
if spec["user"] is not None:
    os.setgroups([])
    os.setresgid(spec["user"], spec["user"], spec["user"])
    os.setresuid(spec["user"], spec["user"], spec["user"])
os.closerange(3, 1 << 20)
sys.path += spec["path"]
sys.argv = [spec["code"]]
def run(path):
    import builtins
    with open(path, encoding="utf-8") as handle:
        code = compile(handle.read(), path, "exec")
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update({"__name__": "__main__", "__file__": path, "__builtins__": builtins})
    exec(code, namespace)
run(spec["code"])
"""


class CodeTool(Tool):
    """Runs the call's Python code (a string, or ``{"code": ...}``) and returns its stdout (an error
    turn with the last line of its stderr when it fails).

    Options (``tools.registry.NAME``, kind code): ``timeout_s`` wall clock, ``cpu_s`` CPU seconds of the
    whole tree (default: timeout_s), ``memory_mb`` resident memory of the whole tree (and address space per process),
    ``max_processes`` (processes and threads), ``disk_mb`` (its tmpfs /tmp and per file),
    ``max_files`` (in /tmp), ``max_output_bytes`` (of stdout and of stderr), ``network`` (false: a
    network namespace of its own, loopback only), ``packages`` (import names visible to the code,
    with what they require; default: numpy and sympy where installed), ``env`` (variables added to
    BASE_ENV), ``isolation`` ("bwrap", or "none": an unisolated child process, for trusted code only).
    """

    def __init__(
        self,
        name: str = "python",
        timeout_s: float = 5.0,
        cpu_s: Optional[float] = None,
        memory_mb: int = 1024,
        network: bool = False,
        isolation: str = "bwrap",
        packages: Optional[List[str]] = None,
        max_processes: int = 32,
        disk_mb: int = 64,
        max_files: int = 4096,
        max_output_bytes: int = 2**20,
        env: Optional[Dict[str, str]] = None,
    ):
        key = f"tools.registry.{name}"
        if isolation not in ISOLATIONS:
            raise ValueError(f"{key}.isolation must be one of {ISOLATIONS}, got {isolation!r}")
        cpu_s = timeout_s if cpu_s is None else cpu_s
        for option, value in (
            ("timeout_s", timeout_s),
            ("cpu_s", cpu_s),
            ("memory_mb", memory_mb),
            ("max_processes", max_processes),
        ):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{key}.{option} must be a positive number, got {value!r}")
        for option, value in (("disk_mb", disk_mb), ("max_files", max_files), ("max_output_bytes", max_output_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key}.{option} must be a positive integer, got {value!r}")
        if not isinstance(network, bool):
            raise ValueError(f"{key}.network must be true or false, got {network!r}")
        if packages is not None and (isinstance(packages, str) or not all(isinstance(p, str) for p in packages)):
            raise ValueError(f"{key}.packages must be a list of import names, got {packages!r}")
        env = dict(env or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ValueError(f"{key}.env must map names to strings, got {env!r}")
        self.name = name
        self.timeout_s = self.time_limit_s = float(timeout_s)
        self.cpu_s = float(cpu_s)
        self.memory_mb = int(memory_mb)
        self.network = network
        self.isolation = isolation
        self.max_processes = int(max_processes)
        self.disk_mb = disk_mb
        self.max_files = max_files
        self.max_output_bytes = max_output_bytes
        self.env = {**BASE_ENV, **env}
        self._bwrap: Optional[str] = None  # found on the first call
        try:
            self.view = sandbox_view(tuple(installed_default_packages() if packages is None else packages))
        except ValueError as error:
            raise ValueError(f"{key}.packages: {error}") from None
        self.env.setdefault("PATH", os.path.dirname(self.view.interpreter))

    @property
    def isolated_network(self) -> bool:
        """Whether the code has no network: a network namespace of its own (loopback only)."""
        return self.isolation == "bwrap" and not self.network

    def check(self) -> None:
        """Refuse (SandboxUnavailableError, naming what is missing and how to get it) unless the isolation
        works here: one call must run in the sandbox and import every allowed package. Logs a warning
        for ``isolation: none``."""
        if self.isolation == "none":
            logger.warning(
                "tools.registry.%s.isolation=none: model-written code runs unisolated, as the trainer's user "
                "(it can read and write the trainer's files, signal its processes, reach the network)",
                self.name,
            )
            return
        find_bwrap()
        try:
            seccomp_filter()
        except ValueError as error:
            raise SandboxUnavailableError(f"isolation bwrap: {error}") from None
        imports = "".join(f"import {package}\n" for package in self.view.packages)
        result = self.run(imports + "print('ok')")
        if result != "ok\n":
            text = result.text if isinstance(result, ToolResult) else repr(result)
            hint = USERNS_HINT if "did not start" in text else "each of packages needs what it imports installed"
            raise SandboxUnavailableError(f"isolation bwrap: the sandbox does not work here ({text}); {hint}")

    def run(self, arguments: Any) -> Any:
        code = arguments.get("code") if isinstance(arguments, dict) else arguments
        if not isinstance(code, str):
            raise ValueError(f"the code tool needs code as a string, got {code!r}")
        deadline = time.monotonic() + self.timeout_s
        limits = TreeLimits(
            cpu_s=self.cpu_s,
            memory_bytes=self.memory_mb * 2**20,
            max_files=self.max_files,
            output_bytes=self.max_output_bytes,
        )
        if self.isolation == "bwrap":
            outcome = self._run_bwrap(code, limits, deadline)
        else:
            outcome = self._run_unisolated(code, limits, deadline)
        return outcome if isinstance(outcome, ToolResult) else self._result(outcome)

    def _rlimits(self, processes: bool) -> Dict[str, int]:
        # A CPU backstop one second past the tree's limit, which the supervisor enforces first and names.
        limits = {
            "RLIMIT_CPU": int(self.cpu_s) + 2,
            "RLIMIT_AS": self.memory_mb * 2**20,
            "RLIMIT_FSIZE": self.disk_mb * 2**20,
            "RLIMIT_NOFILE": _MAX_OPEN_FILES,
            "RLIMIT_CORE": 0,
            "RLIMIT_MSGQUEUE": 0,
        }
        if processes:
            limits["RLIMIT_NPROC"] = self.max_processes
        return limits

    def _command(self, spec: Dict[str, Any]) -> List[str]:
        return [self.view.interpreter, "-I", "-S", "-B", "-c", _BOOTSTRAP, json.dumps(spec)]

    def _run_bwrap(self, code: str, limits: TreeLimits, deadline: float) -> Any:
        bwrap = self._bwrap = self._bwrap or find_bwrap()

        def arguments(fds: Dict[str, int], as_root: bool) -> List[str]:
            spec = {
                "rlimits": self._rlimits(processes=True),
                "user": SANDBOX_UID if as_root else None,
                "path": [SANDBOX_PACKAGES] if self.view.packages else [],
                "code": SANDBOX_CODE,
            }
            return bwrap_arguments(
                bwrap,
                self.view,
                self._command(spec),
                self.env,
                network=self.network,
                disk_bytes=self.disk_mb * 2**20,
                fds=fds,
                as_root=as_root,
            )

        process, init_pid, pidfd = start_bwrap(arguments, code, _seccomp(), deadline)
        if init_pid is None:  # bwrap failed before making the sandbox, or made none in time
            process.kill()
            _, stderr = process.communicate()
            last = stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no answer in time"]
            return ToolResult(f"error: the sandbox did not start: {last[0]}", error=True)
        return supervise(process, init_pid, pidfd, limits, deadline, files_dir=f"/proc/{init_pid}/root/tmp")

    def _run_unisolated(self, code: str, limits: TreeLimits, deadline: float) -> Outcome:
        import subprocess

        with tempfile.TemporaryDirectory(prefix="zcpo-code-") as workdir:
            path = os.path.join(workdir, "main.py")
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(code)
            # No RLIMIT_NPROC: without a user namespace of its own it would count every process of the user.
            spec = {"rlimits": self._rlimits(processes=False), "user": None, "path": list(self.view.package_dirs)}
            process = subprocess.Popen(
                self._command({**spec, "code": path}),
                cwd=workdir,
                env={**self.env, "HOME": workdir, "TMPDIR": workdir, "PATH": os.defpath},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
            )
            pidfd = os.pidfd_open(process.pid)  # (a child not yet waited for: its PID is still its own)
            return supervise(process, process.pid, pidfd, limits, deadline, kill_group=True)

    def _result(self, outcome: Outcome) -> Any:
        reasons = {
            "time": f"did not finish within {self.timeout_s:g} s",
            "cpu": f"used more than {self.cpu_s:g} CPU seconds",
            "memory": f"held more than {self.memory_mb} MiB of memory",
            "files": f"created more than {self.max_files} files",
            "output": f"wrote more than {self.max_output_bytes} bytes of output",
        }
        if outcome.stopped is not None:
            return ToolResult(f"error: the code {reasons[outcome.stopped]}", error=True)
        stdout = outcome.stdout.decode("utf-8", "replace")
        if outcome.exit_code != 0:
            tail = outcome.stderr.decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
            return ToolResult(f"error: the code failed (exit code {outcome.exit_code}): {tail[0]}".strip(), error=True)
        return stdout


@functools.cache
def _seccomp() -> bytes:
    return seccomp_filter()
