"""A trainer stand-in for attacks on the process that runs the code tool: ``python -m
tests.agent_tools.stand_in_trainer ATTACK``.

It builds the registry as a rollout does, holds a marker in its memory, records SIGWINCH, and makes one
code-tool call whose code attacks it (its PID and the marker's address are in the code: an attacker
may guess both). Then it prints one JSON line: the tool's result, whether the marker is intact and
whether SIGWINCH arrived. If the attack kills or stops it, no line comes (the test fails).
"""

import json
import os
import signal
import sys

from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.parser import parse_tool_call
from megatron_zcpo.agent_tools.registry import ToolRegistry

MARKER = b"ZCPO-TRAINER-MARKER-0123456789"  # its bytes lie in the object, just past id(MARKER)

ATTACKS = {
    # the code's parent and the trainer's own PID: SIGKILL and SIGSTOP
    "kill_parent": "os.kill(os.getppid(), signal.SIGKILL)",
    "stop_parent": "os.kill(os.getppid(), signal.SIGSTOP)",
    "kill_trainer": "os.kill(TRAINER, signal.SIGKILL)",
    "stop_trainer": "os.kill(TRAINER, signal.SIGSTOP)",
    # every process it may signal, and its process group (SIGWINCH: harmless to anything else a broken
    # sandbox would reach on this machine)
    "signal_everyone": "os.kill(-1, signal.SIGWINCH)",
    "signal_group": "os.killpg(0, signal.SIGWINCH)",
    # the trainer's memory, stdout and a debugger's attach
    "overwrite_memory": (
        "f = open(f'/proc/{TRAINER}/mem', 'r+b'); f.seek(ADDRESS); data = f.read(4096); "
        "at = data.index(b'ZCPO-TRAINER-MARKER'); f.seek(ADDRESS + at); f.write(b'PWNED')"
    ),
    "write_stdout": "open(f'/proc/{TRAINER}/fd/1', 'w').write('PWNED\\n')",
    "ptrace_attach": (
        "import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        "assert libc.ptrace(16, TRAINER, 0, 0) == 0, os.strerror(ctypes.get_errno())"
    ),
}


def main(attack: str) -> None:
    received = []
    signal.signal(signal.SIGWINCH, lambda number, frame: received.append(number))
    prologue = f"import os, signal\nTRAINER = {os.getpid()}\nADDRESS = {id(MARKER)}\n"
    code = prologue + ATTACKS[attack] + "\nprint('attacked')"
    config = ToolsConfig(
        enabled=True, timeout_s=10, registry={"python": {"kind": "code", "timeout_s": 5, "packages": []}}
    )
    registry = ToolRegistry.from_config(config)
    call = parse_tool_call(
        "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>", "hermes"
    )
    (result,) = registry.call_all([call])
    registry.close()
    answer = {"result": result.text, "marker": MARKER.decode(), "signalled": bool(received)}
    print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
