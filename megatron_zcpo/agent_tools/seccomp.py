"""The code tool's seccomp filter: a classic-BPF program that refuses the system calls a sandbox never needs."""

from __future__ import annotations

import errno
import platform
import struct
from typing import Dict, List, Tuple

# System calls refused with EPERM, and why: new namespaces (a nested user namespace would give the code
# root over new mounts, e.g. a tmpfs of any size), keyrings shared by uid, ptrace, kernel attack
# surface (bpf, perf, userfaultfd, io_uring), and memory that no per-process limit counts (memfd,
# System V shared memory and message queues).
BLOCKED_SYSCALLS = (
    "unshare",
    "setns",
    "keyctl",
    "add_key",
    "request_key",
    "ptrace",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "memfd_create",
    "shmget",
    "msgget",
)

# Per machine: the audit architecture, and the numbers of the calls above plus clone and clone3
# (x86_64: arch/x86/entry/syscalls/syscall_64.tbl; aarch64: include/uapi/asm-generic/unistd.h).
_ARCHITECTURES: Dict[str, Tuple[int, Dict[str, int]]] = {
    "x86_64": (
        0xC000003E,
        {
            "clone": 56,
            "clone3": 435,
            "unshare": 272,
            "setns": 308,
            "keyctl": 250,
            "add_key": 248,
            "request_key": 249,
            "ptrace": 101,
            "bpf": 321,
            "perf_event_open": 298,
            "userfaultfd": 323,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "memfd_create": 319,
            "shmget": 29,
            "msgget": 68,
        },
    ),
    "aarch64": (
        0xC00000B7,
        {
            "clone": 220,
            "clone3": 435,
            "unshare": 97,
            "setns": 268,
            "keyctl": 219,
            "add_key": 217,
            "request_key": 218,
            "ptrace": 117,
            "bpf": 280,
            "perf_event_open": 241,
            "userfaultfd": 282,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "memfd_create": 279,
            "shmget": 194,
            "msgget": 186,
        },
    ),
}
_X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: the same calls under other numbers
# clone()'s namespace flags (CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET).
_CLONE_NAMESPACE_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

# classic BPF opcodes and seccomp return values (linux/filter.h, linux/seccomp.h)
_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_ALLOW, _RET_KILL_PROCESS, _RET_ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6] (args[0]'s low
# half first on these little-endian machines).
_NR, _ARCH, _ARG0_LOW = 0, 4, 16


def supported_machine() -> bool:
    return platform.machine() in _ARCHITECTURES


def seccomp_filter(machine: str = "") -> bytes:
    """The filter for ``machine`` (default: this one) as bwrap's ``--seccomp`` reads it: an array of
    ``struct sock_filter`` (8 bytes each). Another architecture's calls (32-bit x86 on x86_64) end
    the process; clone() with a namespace flag and the calls of BLOCKED_SYSCALLS fail with EPERM;
    clone3 fails with ENOSYS, so the C library falls back to clone(), whose flags the filter can
    read (clone3 passes them in memory). Raises ValueError for a machine without a table."""
    machine = machine or platform.machine()
    if machine not in _ARCHITECTURES:
        raise ValueError(f"no seccomp filter for the {machine!r} architecture (known: {sorted(_ARCHITECTURES)})")
    audit_arch, numbers = _ARCHITECTURES[machine]
    eperm, enosys = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
    # Each entry: (code, jump-if-true label, jump-if-false label, k); labels are resolved below.
    program: List[Tuple[int, str, str, int]] = [
        (_LD_W_ABS, "", "", _ARCH),
        (_JEQ_K, "", "kill", audit_arch),
        (_LD_W_ABS, "", "", _NR),
    ]
    if machine == "x86_64":
        program.append((_JGE_K, "eperm", "", _X32_SYSCALL_BIT))
    program += [(_JEQ_K, "eperm", "", numbers[name]) for name in BLOCKED_SYSCALLS]
    program += [
        (_JEQ_K, "enosys", "", numbers["clone3"]),
        (_JEQ_K, "", "allow", numbers["clone"]),
        (_LD_W_ABS, "", "", _ARG0_LOW),
        (_JSET_K, "eperm", "allow", _CLONE_NAMESPACE_FLAGS),
    ]
    returns = {"allow": _RET_ALLOW, "eperm": eperm, "enosys": enosys, "kill": _RET_KILL_PROCESS}
    where = {label: len(program) + i for i, label in enumerate(returns)}
    code = b""
    for index, (opcode, true_label, false_label, k) in enumerate(program):
        jump_true = where[true_label] - index - 1 if true_label else 0
        jump_false = where[false_label] - index - 1 if false_label else 0
        code += struct.pack("=HBBI", opcode, jump_true, jump_false, k)
    for label in returns:
        code += struct.pack("=HBBI", _RET_K, 0, 0, returns[label])
    return code
