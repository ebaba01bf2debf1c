"""Starting one sandboxed process under bubblewrap: new namespaces, the read-only view, a tmpfs, seccomp.

Each call gets new user, PID, mount, network, IPC, UTS and cgroup namespaces (``bwrap``, Debian's
``bubblewrap``). Its PID 1 is bwrap's init: when the code's process exits, or the init is killed,
the kernel kills every process left in the namespace. As root, bwrap's user namespace would map
the sandbox to uid 0, for which the kernel ignores RLIMIT_NPROC, so the launcher writes the maps
itself (``--userns-block-fd``): uid 0 for bwrap's own set-up (it must read the bound paths, under
a 0700 /root too) and SANDBOX_UID, to which the sandbox's first process switches before it runs
any code of the call.
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Tuple

from megatron_zcpo.agent_tools.sandbox_view import SandboxView

MINIMUM_VERSION = (0, 7, 0)  # --size (a size-limited tmpfs) came with bubblewrap 0.7.0
SANDBOX_UID = 65534  # nobody: the code's uid (and gid) when the trainer runs as root
SANDBOX_CODE = "/code/main.py"
INSTALL_HINT = (
    "install bubblewrap: apt-get install bubblewrap (Debian, Ubuntu), dnf install bubblewrap (Fedora, RHEL), "
    "or set isolation: none on the tool to run model-written code unisolated"
)
USERNS_HINT = (
    "bubblewrap needs user namespaces: sysctl user.max_user_namespaces > 0 (kernel.unprivileged_userns_clone=1 "
    "on older Debian kernels, kernel.apparmor_restrict_unprivileged_userns=0 on Ubuntu 24.04 hosts); inside "
    "Docker, run the container with --security-opt seccomp=unconfined (the default profile refuses new namespaces)"
)


class SandboxUnavailableError(RuntimeError):
    """The isolation the code tool needs cannot be had here; the message says what is missing and how
    to get it."""


def find_bwrap(path: str = "bwrap") -> str:
    """The bwrap executable (``path``: a name on PATH or a path), checked to be MINIMUM_VERSION or newer."""
    found = shutil.which(path)
    if found is None:
        raise SandboxUnavailableError(f"isolation bwrap: bubblewrap ({path!r}) is not installed; {INSTALL_HINT}")
    try:
        answer = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise SandboxUnavailableError(f"isolation bwrap: {found} --version failed ({error}); {INSTALL_HINT}") from None
    match = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", answer)
    version = tuple(int(part or 0) for part in match.groups()) if match else (0, 0, 0)
    if version < MINIMUM_VERSION:
        raise SandboxUnavailableError(
            f"isolation bwrap: {found} is bubblewrap {'.'.join(map(str, version))}; the code tool needs "
            f"{'.'.join(map(str, MINIMUM_VERSION))} or newer (--size); {INSTALL_HINT}"
        )
    return found


def bwrap_arguments(
    bwrap: str,
    view: SandboxView,
    command: Sequence[str],
    env: Dict[str, str],
    *,
    network: bool,
    disk_bytes: int,
    fds: Dict[str, int],
    as_root: bool,
) -> List[str]:
    """bwrap's command line for ``command`` in ``view``. ``fds``: the launcher's descriptors "info"
    (bwrap writes the sandbox's PID there), "start" (the sandbox's init waits on it, its mounts made,
    until the launcher holds a pidfd of it), "seccomp" (the filter), "code" (the call's code, bound
    read-only at SANDBOX_CODE) and, ``as_root``, "block" (bwrap waits on it until the launcher has
    written the user namespace's maps)."""
    arguments = [bwrap, "--unshare-user", "--info-fd", str(fds["info"]), "--block-fd", str(fds["start"])]
    if as_root:
        arguments += ["--userns-block-fd", str(fds["block"])]
    arguments += ["--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if not network:
        arguments.append("--unshare-net")
    arguments += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--cap-drop", "ALL"]
    if as_root:  # for the first process's switch to SANDBOX_UID (it drops them with the switch)
        arguments += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    arguments.append("--clearenv")
    for name, value in sorted(env.items()):
        arguments += ["--setenv", name, value]
    for target, link in view.symlinks:
        arguments += ["--symlink", target, link]
    # bwrap would make the mount points' parents 0700 (owned by uid 0 as root: closed to SANDBOX_UID).
    for directory in _parents([inside for _, inside in view.read_only] + [SANDBOX_CODE]):
        arguments += ["--perms", "0755", "--dir", directory]
    for host, inside in view.read_only:
        arguments += ["--ro-bind", host, inside]
    for directory in view.hidden:
        arguments += ["--tmpfs", directory, "--remount-ro", directory]
    if network:
        arguments += [
            "--ro-bind-try",
            "/etc/resolv.conf",
            "/etc/resolv.conf",
            "--ro-bind-try",
            "/etc/hosts",
            "/etc/hosts",
        ]
    arguments += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]
    arguments += ["--size", str(disk_bytes), "--perms", "1777", "--tmpfs", "/tmp"]
    arguments += [
        "--perms",
        "0444",
        "--ro-bind-data",
        str(fds["code"]),
        SANDBOX_CODE,
        "--chdir",
        "/tmp",
        "--remount-ro",
        "/",
    ]
    arguments += ["--seccomp", str(fds["seccomp"]), "--", *command]
    return arguments


def start_bwrap(
    arguments_for, code: str, seccomp: bytes, deadline: float
) -> Tuple[subprocess.Popen, Optional[int], int]:
    """Start bwrap; returns the process, the host PID of the sandbox's init and a pidfd of it (None
    and -1 when bwrap failed before making it: its stderr says why).

    ``arguments_for(fds, as_root)``: the command line (:func:`bwrap_arguments`). The code and the
    filter go in through memory files, so nothing of the call touches the host's file system. The
    init waits until the pidfd is open: it cannot end, and its PID be reused, before.
    """
    as_root = os.geteuid() == 0
    code_fd = _memory_file("zcpo-code", code.encode("utf-8"))
    seccomp_fd = _memory_file("zcpo-seccomp", seccomp)
    info_read, info_write = os.pipe()
    start_read, start_write = os.pipe()
    block_read, block_write = os.pipe() if as_root else (-1, -1)
    fds = {"info": info_write, "start": start_read, "seccomp": seccomp_fd, "code": code_fd, "block": block_read}
    try:
        process = subprocess.Popen(
            arguments_for(fds, as_root),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=[fd for fd in fds.values() if fd >= 0],
            env={"PATH": os.defpath},  # bwrap itself gets nothing of the trainer's environment either
            start_new_session=True,
        )
    finally:
        for fd in (code_fd, seccomp_fd, info_write, start_read, block_read):
            if fd >= 0:
                os.close(fd)
    pidfd = -1
    try:
        info = _read_all(info_read, deadline)
        init_pid = json.loads(info)["child-pid"] if info else None
        if init_pid is not None:
            pidfd = os.pidfd_open(init_pid)  # (blocked on its gates, it is alive)
            if as_root:
                maps = f"0 0 1\n{SANDBOX_UID} {SANDBOX_UID} 1\n"
                for name in ("uid_map", "gid_map"):
                    with open(f"/proc/{init_pid}/{name}", "w") as handle:
                        handle.write(maps)
                os.write(block_write, b"1")
            os.write(start_write, b"1")
    except BaseException:
        process.kill()
        process.wait()
        if pidfd >= 0:
            os.close(pidfd)
        raise
    finally:
        for fd in (info_read, start_write, block_write):
            if fd >= 0:
                os.close(fd)
    return process, init_pid, pidfd


def _parents(paths: Sequence[str]) -> List[str]:
    """Every directory above ``paths`` (not "/"), parents first."""
    parents = {os.path.dirname(path) for path in paths}
    for path in list(parents):
        while path not in ("/", ""):
            parents.add(path)
            path = os.path.dirname(path)
    return sorted(parents - {"/", ""}, key=lambda path: (path.count("/"), path))


def _memory_file(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # Popen(pass_fds=...) hands it to bwrap alone
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read_all(fd: int, deadline: float) -> bytes:
    """What the writer end of ``fd`` writes until it closes; b"" when the deadline passes first."""
    data = b""
    while True:
        remaining = deadline - time.monotonic()
        poller = select.poll()  # not select(): descriptors of a busy trainer can lie above 1024
        poller.register(fd, select.POLLIN)
        if remaining <= 0 or not poller.poll(remaining * 1000):
            return b""
        chunk = os.read(fd, 65536)
        if not chunk:
            return data
        data += chunk
