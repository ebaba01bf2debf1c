"""Watching one sandboxed call: its output read through pipes under a size limit, the whole process
tree's time, CPU, memory and files, and the end of every process of the call when it returns."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

POLL_S = 0.05  # how often the tree's CPU, memory and files are summed
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class TreeLimits:
    """What one call may use, summed over all its processes: ``cpu_s`` CPU seconds,
    ``memory_bytes`` of resident memory, ``max_files`` files in its tmpfs (``files_dir``, the tmpfs as
    the host sees it; None: not counted) and ``output_bytes`` of stdout and of stderr each."""

    cpu_s: float
    memory_bytes: int
    max_files: int
    output_bytes: int


@dataclass(frozen=True)
class Outcome:
    """How a call ended: ``exit_code`` (None when it was stopped), what it wrote, and ``stopped``, the limit
    that ended it: "time", "cpu", "memory", "files" or "output" (None: it ended on its own)."""

    exit_code: Optional[int]
    stdout: bytes
    stderr: bytes
    stopped: Optional[str] = None


@dataclass(frozen=True)
class TreeUsage:
    processes: int
    cpu_s: float
    memory_bytes: int


def tree_pids(root: int) -> List[int]:
    """``root`` and its descendants (orphans of a PID namespace are its init's children), read from
    /proc/PID/task/TID/children; processes that end meanwhile are skipped."""
    pids, index = [root], 0
    while index < len(pids):
        pid = pids[index]
        index += 1
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as handle:
                    pids += [int(child) for child in handle.read().split()]
        except OSError:
            continue
    return pids


def tree_usage(root: int) -> TreeUsage:
    """CPU time (that of the live processes and of the children they reaped) and resident memory of
    ``root``'s tree."""
    cpu_ticks = resident_pages = processes = 0
    for pid in tree_pids(root):
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rpartition(")")[2].split()
            with open(f"/proc/{pid}/statm") as handle:
                resident = int(handle.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
        processes += 1
        cpu_ticks += sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
        resident_pages += resident
    return TreeUsage(processes, cpu_ticks / _TICKS_PER_S, resident_pages * _PAGE_BYTES)


def files_in(directory: str) -> int:
    """Files and directories in use on the file system of ``directory``."""
    try:
        stats = os.statvfs(directory)
    except OSError:
        return 0
    return stats.f_files - stats.f_ffree


def supervise(
    process: subprocess.Popen,
    root: int,
    pidfd: int,
    limits: TreeLimits,
    deadline: float,
    files_dir: Optional[str] = None,
    kill_group=False,
) -> Outcome:
    """Read ``process``'s stdout and stderr until they close and it exits (by ``deadline``, a
    time.monotonic() value), checking ``limits`` every POLL_S over the tree of ``root`` (the
    sandbox's init, or the process itself; ``pidfd``: a pidfd of it, which this closes); when a
    limit is passed, or on any error, the tree is killed. Returns once ``root`` is gone: for a PID
    namespace's init, once every process of the call is. ``kill_group``: kill ``process``'s process
    group too (without a PID namespace, the best there is: a process that left the group survives)."""
    assert process.stdout is not None and process.stderr is not None  # started with stdout=stderr=PIPE
    out, err = process.stdout.fileno(), process.stderr.fileno()
    streams: Dict[int, bytearray] = {out: bytearray(), err: bytearray()}
    stopped: Optional[str] = None
    try:
        open_streams = list(streams)
        while stopped is None and (open_streams or process.poll() is None):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                stopped = "time"
                break
            ready = _readable(open_streams, min(POLL_S, remaining))
            for fd in ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    open_streams.remove(fd)
                elif len(streams[fd]) + len(chunk) > limits.output_bytes:
                    stopped = "output"
                else:
                    streams[fd] += chunk
            stopped = stopped or _passed(tree_usage(root), limits, files_dir)
    finally:
        _kill_tree(process, pidfd, kill_group)
    exit_code = None if stopped else process.returncode
    return Outcome(exit_code, bytes(streams[out]), bytes(streams[err]), stopped)


def _readable(fds: List[int], timeout_s: float) -> List[int]:
    """Those of ``fds`` with data or at their end, waiting up to ``timeout_s`` (poll: descriptors of a
    busy trainer can lie above select's 1024)."""
    if not fds:
        time.sleep(timeout_s)
        return []
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return [fd for fd, _ in poller.poll(timeout_s * 1000)]


def _passed(usage: TreeUsage, limits: TreeLimits, files_dir: Optional[str]) -> Optional[str]:
    if usage.cpu_s > limits.cpu_s:
        return "cpu"
    if usage.memory_bytes > limits.memory_bytes:
        return "memory"
    # bwrap's init makes the mounts before it starts the first process: only then is files_dir the tmpfs.
    if files_dir is not None and usage.processes > 1 and files_in(files_dir) > limits.max_files:
        return "files"
    return None


def _kill_tree(process: subprocess.Popen, pidfd: int, kill_group: bool) -> None:
    """SIGKILL the tree's root (a PID namespace's init takes every process of the namespace with it),
    ``process`` and, ``kill_group``, its process group; wait until the root is gone."""
    with contextlib.suppress(ProcessLookupError):
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if kill_group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # the group's id stays reserved while a member lives
    process.kill()  # (a no-op once it has been waited for)
    process.wait()
    _readable([pidfd], 10.0)  # once the root has ended (its namespace is empty by then)
    os.close(pidfd)
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()
