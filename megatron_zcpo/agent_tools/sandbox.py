"""The sandboxed code tool: Python code run in its own process with time, memory and output limits, no network."""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
from typing import Any, List

from megatron_zcpo.agent_tools.base import Tool, ToolResult

# Environment variables that would let the code reach a proxy, or change how Python starts.
_DROPPED_ENV_PREFIXES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy", "python", "ld_")


@functools.cache
def network_isolation_prefix() -> tuple:
    """The command prefix that runs a process without network: ``unshare -rn`` (a new user and network
    namespace, loopback only) when this kernel allows it, else () (best effort: proxies are dropped
    from the environment, nothing more; the code tool reports ``isolated_network`` False)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for prefix in ((unshare, "-rn"), (unshare, "-n")):
        try:
            if subprocess.run([*prefix, "true"], capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.SubprocessError):
            continue
    return ()


def _limits(cpu_s: int, memory_bytes: int, file_bytes: int) -> None:
    """In the child, before exec: a new session (the timeout kills its whole group) and rlimits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _read_head(path: str, limit: int = 2**20) -> str:
    with open(path, "rb") as handle:
        return handle.read(limit).decode("utf-8", "replace")


class CodeTool(Tool):
    """Runs the call's Python code (a string, or ``{"code": ...}``) with ``python -I`` in a fresh temporary
    directory and returns its stdout (and stderr on failure).

    Limits: ``timeout_s`` wall clock (the process group is killed), a second more in CPU seconds
    (RLIMIT_CPU), ``memory_mb`` of address space (RLIMIT_AS), 1 MiB of written files; no network
    where ``unshare -n`` works (:func:`network_isolation_prefix`), ``network=True`` keeps it.
    """

    def __init__(self, name: str = "python", timeout_s: float = 5.0, memory_mb: int = 512, network: bool = False):
        self.name = name
        self.timeout_s = float(timeout_s)
        self.memory_mb = int(memory_mb)
        self.prefix = () if network else network_isolation_prefix()
        self.isolated_network = bool(self.prefix) or network

    def command(self, code: str) -> List[str]:
        return [*self.prefix, sys.executable, "-I", "-S", "-c", code]

    def run(self, arguments: Any) -> Any:
        code = arguments.get("code") if isinstance(arguments, dict) else arguments
        if not isinstance(code, str):
            raise ValueError(f"the code tool needs code as a string, got {code!r}")
        env = {k: v for k, v in os.environ.items() if not k.lower().startswith(_DROPPED_ENV_PREFIXES)}
        env["PATH"] = os.environ.get("PATH", "/usr/bin:/bin")
        # The CPU limit is a backstop one second past the wall-clock one: a busy loop uses CPU as fast as
        # wall time, and the wall-clock kill must win that race so the turn says what happened.
        cpu_limit_s = max(1, int(self.timeout_s + 0.999)) + 1
        limits = functools.partial(_limits, cpu_limit_s, self.memory_mb * 2**20, 2**20)
        # Output goes to files under the same 1 MiB limit as any file (a pipe would let a printing loop
        # fill this process's memory until the timeout); past it a write fails ("File too large":
        # Python ignores SIGXFSZ).
        with tempfile.TemporaryDirectory(prefix="zcpo-code-") as workdir:
            out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
            with open(out_path, "wb") as out, open(err_path, "wb") as err:
                process = subprocess.Popen(
                    self.command(code),
                    cwd=workdir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    preexec_fn=limits,
                )
                try:
                    process.wait(timeout=self.timeout_s)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                    return ToolResult(f"error: the code did not finish within {self.timeout_s:g} s", error=True)
            stdout, stderr = (_read_head(path) for path in (out_path, err_path))
        if process.returncode != 0:
            reason = f"signal {-process.returncode}" if process.returncode < 0 else f"exit code {process.returncode}"
            tail = stderr.strip().splitlines()[-1:] or [""]
            return ToolResult(f"error: the code failed ({reason}): {tail[0]}".strip(), error=True)
        return stdout
