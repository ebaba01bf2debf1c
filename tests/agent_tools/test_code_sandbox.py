"""The code tool as a security boundary (issue 42): each attack through the path a rollout takes
(``ToolsConfig`` -> ``ToolRegistry.from_config`` -> ``parse_tool_call(..., "hermes")`` -> ``call_all``),
as the user the tests run as (root in CI and in the image), against a stand-in of the trainer's host:
its secrets in the environment, a run directory with a config and a checkpoint, listeners on loopback
and on unix sockets."""

import json
import os
import platform
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from megatron_zcpo.agent_tools.config import ToolsConfig
from megatron_zcpo.agent_tools.parser import parse_tool_call
from megatron_zcpo.agent_tools.registry import ToolRegistry, build_tool, tool_problems
from megatron_zcpo.agent_tools.sandbox import BASE_ENV
from megatron_zcpo.agent_tools.seccomp import _ARCHITECTURES, BLOCKED_SYSCALLS
from tests.agent_tools.stand_in_trainer import ATTACKS

ROOT = Path(__file__).resolve().parents[2]
SECRETS = {"HF_TOKEN": "hf_zcpoSecret1", "WANDB_API_KEY": "wandbZcpoSecret2", "OPENAI_API_KEY": "sk-zcpoSecret3"}
MEMORY_MB = 512


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The trainer's host as an attacker would find it (its paths are in the code: they can be guessed)."""
    run = tmp_path_factory.mktemp("run")
    (run / "config.yaml").write_text("model: secret-path\n")
    (run / "checkpoints" / "step_10").mkdir(parents=True)
    (run / "checkpoints" / "step_10" / "weights.pt").write_bytes(b"w" * 4096)
    listener = socket.create_server(("127.0.0.1", 0))
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(str(run / "trainer.sock"))
    unix.listen()
    abstract = socket.socket(socket.AF_UNIX)
    abstract_name = f"\0zcpo-test-{uuid.uuid4().hex}"
    abstract.bind(abstract_name)
    abstract.listen()
    yield {"run": run, "port": listener.getsockname()[1], "abstract": abstract_name}
    for sock in (listener, unix, abstract):
        sock.close()


@pytest.fixture(scope="module")
def registry():
    """The code tool as a rollout builds it, the trainer's secrets in its environment."""
    patch = pytest.MonkeyPatch()
    for name, value in SECRETS.items():
        patch.setenv(name, value)
    spec = {"kind": "code", "timeout_s": 10, "memory_mb": MEMORY_MB}  # no attack here waits for the clock
    registry = ToolRegistry.from_config(ToolsConfig(enabled=True, timeout_s=10, registry={"python": spec}))
    yield registry
    registry.close()
    patch.undo()


def call(registry, code: str):
    text = "<tool_call>" + json.dumps({"name": "python", "arguments": {"code": code}}) + "</tool_call>"
    (result,) = registry.call_all([parse_tool_call(text, "hermes")])
    return result


def lines(result) -> dict:
    """The ``key=value`` lines the code printed."""
    assert not result.error, result.text
    return dict(line.split("=", 1) for line in result.text.splitlines() if "=" in line)


def attempts(*statements: str) -> str:
    """Code that tries each statement and prints ``N=ok`` or ``N=<the exception's class>``."""
    body = ["import ctypes, os, signal, socket, sys"]
    for n, statement in enumerate(statements):
        body.append(
            f"try:\n    {statement}\n    print('{n}=ok')\nexcept BaseException as e:\n    print('{n}=' + type(e).__name__)"
        )
    return "\n".join(body)


def processes_with(marker: str) -> list:
    """The host's processes with ``marker`` in their command line or name."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() + Path(f"/proc/{pid}/comm").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


# -- 1. the trainer's secrets -----------------------------------------------------------------------------


def test_the_trainers_secrets_stay_out(registry):
    code = (
        "import os\nprint(sorted(os.environ))\nprint(dict(os.environ))\n"
        "for path in ('/proc/self/environ', '/proc/1/environ', '/proc/1/cmdline'):\n"
        "    try:\n        print(open(path, 'rb').read())\n    except OSError as e:\n        print(path, e)\n"
    )
    result = call(registry, code)
    assert not result.error, result.text
    assert not any(value in result.text for value in SECRETS.values()), result.text
    names = eval(result.text.splitlines()[0])  # the environment: the allow-list and nothing else
    assert set(names) <= set(BASE_ENV) | {"PATH", "PWD"}, names


# -- 2. and 5. the trainer's process: signals, memory, stdout, ptrace (a stand-in trainer per attack) ---------


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_the_trainer_survives_untouched(attack):
    done = subprocess.run(
        [sys.executable, "-m", "tests.agent_tools.stand_in_trainer", attack],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    answer = json.loads(done.stdout.splitlines()[-1])
    assert "PWNED" not in done.stdout
    assert answer["marker"] == "ZCPO-TRAINER-MARKER-0123456789" and not answer["signalled"], answer
    # The attack itself fails, but for signalling its own process group: allowed, and only the sandbox's.
    assert answer["result"] != "attacked\n" or attack == "signal_group", answer


# -- 3. the host's files ------------------------------------------------------------------------------------


def test_the_hosts_files_are_out_of_reach(registry, host):
    run = host["run"]
    checkpoint = run / "checkpoints" / "step_10" / "weights.pt"
    result = call(
        registry,
        attempts(
            "open('/etc/shadow').read()",
            f"open('{run}/config.yaml').read()",
            f"open('{ROOT}/README.md').read()",
            f"open('{run}/checkpoints/planted', 'w').write('x')",
            f"open('{checkpoint}', 'r+b').truncate(0)",
            f"os.rename('{run}/config.yaml', '{run}/moved.yaml')",
            "open(os.path.expanduser('~/.bashrc')).read()",
            "os.listdir('/work')",
            "open('/usr/lib/planted', 'w')",
            f"open('{sys.executable}', 'r+b')",
        ),
    )
    outcomes = lines(result)
    assert set(outcomes.values()) <= {"FileNotFoundError", "PermissionError", "OSError"}, outcomes
    assert (run / "config.yaml").read_text() == "model: secret-path\n"
    assert checkpoint.read_bytes() == b"w" * 4096
    assert sorted(p.name for p in run.rglob("*")) == sorted(
        ["config.yaml", "checkpoints", "step_10", "weights.pt", "trainer.sock"]
    )


def test_writes_are_bounded_in_total_size_and_file_count(registry):
    sizes = call(
        registry,
        "n = 0\ntry:\n    while n < 200:\n        open(f'/tmp/f{n}', 'wb').write(b'0' * 2**20)\n        n += 1\n"
        "except OSError as e:\n    print(f'mib={n}', f'error={type(e).__name__}', sep='\\n')\n",
    )
    outcomes = lines(sizes)
    assert int(outcomes["mib"]) <= 64 and outcomes["error"] == "OSError"  # the tmpfs is full (ENOSPC)
    many = call(registry, "import itertools\nfor n in itertools.count():\n    open(f'/tmp/{n}', 'w').close()\n")
    assert many.error and "created more than 4096 files" in many.text


# -- 4. nothing outlives the call ---------------------------------------------------------------------------


def test_no_process_outlives_the_call(registry):
    marker = f"zcpo-survivor-{uuid.uuid4().hex}"
    spawn = f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', '{marker}'])"
    code = f"""
import os, signal, sys, time
if os.fork() == 0:  # double fork and a new session, deaf to hang-ups
    os.setsid()
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    if os.fork() == 0:
        {spawn}
    os._exit(0)
forked = 0
for _ in range(300):  # a fork bomb's first round
    try:
        if os.fork() == 0:
            {spawn}
        forked += 1
    except OSError:
        break
print(f"forked={{forked}}")
"""
    started = time.monotonic()
    outcomes = lines(call(registry, code))
    assert int(outcomes["forked"]) < 32  # max_processes
    assert time.monotonic() - started < 8  # returned when the code did, not at the time limit (10 s)
    assert processes_with(marker) == []  # every process of the call ended with it


def test_the_memory_of_the_whole_tree_is_bounded(registry):
    marker = f"zh{uuid.uuid4().hex[:12]}"  # a process name (15 characters at most)
    code = f"""
import ctypes, os, time
for _ in range(3):  # each under the per-process limit, together over it
    if os.fork() == 0:
        ctypes.CDLL(None).prctl(15, b"{marker}")
        block = b"1" * ({MEMORY_MB // 2} * 2**20)
        time.sleep(60)
time.sleep(60)
"""
    result = call(registry, code)
    assert result.error and f"held more than {MEMORY_MB} MiB" in result.text, result.text
    assert processes_with(marker) == []


def test_the_cpu_time_of_the_whole_tree_is_bounded():
    tool = build_tool("python", {"kind": "code", "timeout_s": 20, "cpu_s": 1, "packages": []})
    result = tool.run("import os\nos.fork()\nos.fork()\nwhile True:\n    pass\n")  # 4 spinning processes
    assert result.error and "used more than 1 CPU seconds" in result.text, result.text  # not the wall clock's 20


def test_output_is_bounded_by_the_reader(registry):
    result = call(registry, "while True:\n    print('x' * 65536)\n")
    assert result.error and "wrote more than 1048576 bytes" in result.text


# -- 5. and 6. the network, loopback services, unix sockets --------------------------------------------------


def test_the_network_and_the_hosts_sockets_are_out_of_reach(registry, host):
    result = call(
        registry,
        attempts(
            f"socket.create_connection(('127.0.0.1', {host['port']}), timeout=1)",
            "socket.create_connection(('10.255.255.1', 80), timeout=1)",
            f"s = socket.socket(socket.AF_UNIX); s.connect('{host['run']}/trainer.sock')",
            f"s = socket.socket(socket.AF_UNIX); s.connect({host['abstract']!r})",
            "socket.getaddrinfo('pypi.org', 443)",
        ),
    )
    outcomes = lines(result)
    assert "ok" not in outcomes.values(), outcomes
    assert build_tool("python", {"kind": "code"}).isolated_network
    assert not build_tool("python", {"kind": "code", "network": True}).isolated_network


# -- 7. the result comes through a pipe ----------------------------------------------------------------------


def test_links_and_fifos_planted_for_the_trainer_change_nothing(registry):
    code = (
        "import os\nfor name in ('.stdout', '.stderr', 'stdout', 'result'):\n"
        "    os.symlink('/etc/shadow', name)\n"
        "os.mkfifo('fifo'); os.symlink('fifo', '.out')\nprint('fine')\n"
    )
    started = time.monotonic()
    assert call(registry, code).text == "fine\n" and time.monotonic() - started < 8


# -- attacks beyond the list -------------------------------------------------------------------------


def test_the_kernels_doors_stay_shut(registry):
    clone = _ARCHITECTURES[platform.machine()][1]["clone"]
    CLONE_NEWUSER, CLONE_NEWNS, SIGCHLD = 0x10000000, 0x00020000, 17
    result = call(
        registry,
        attempts(
            "assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0",  # a nested user namespace
            f"assert ctypes.CDLL(None, use_errno=True).syscall({clone}, {CLONE_NEWUSER | CLONE_NEWNS | SIGCHLD}, 0, 0, 0, 0) >= 0",
            "assert os.memfd_create('x') >= 0",  # memory no limit counts
            "assert ctypes.CDLL(None, use_errno=True).shmget(0, 2**30, 0o1600) >= 0",
            "os.setuid(0)",
            "open('/dev/planted', 'w')",
            "open('/proc/sys/kernel/hostname', 'w').write('x')",
            "assert sorted(os.listdir('/proc/self/fd')) == ['0', '1', '2', '3'], os.listdir('/proc/self/fd')",
            "assert len([p for p in os.listdir('/proc') if p.isdigit()]) <= 3, os.listdir('/proc')",
            "assert socket.gethostname() == 'sandbox'",
            "import resource; resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))",
        ),
    )
    outcomes = lines(result)
    opened = {str(n) for n in range(7)}
    assert all(outcomes[n] != "ok" for n in opened), outcomes  # refused
    assert outcomes["7"] == outcomes["8"] == outcomes["9"] == "ok", outcomes  # only its own fds, processes, name
    assert outcomes["10"] == "ValueError", outcomes  # a hard limit cannot be raised
    assert "ptrace" in BLOCKED_SYSCALLS


# -- 8. and benign code ------------------------------------------------------------------------------------


def test_benign_code_gets_its_output_and_the_allowed_packages(registry):
    code = "import numpy, sympy\nprint(int(numpy.arange(10).sum()), sympy.factorint(360), '\\u00e9t\\u00e9')"
    assert call(registry, code).text == "45 {2: 3, 3: 2, 5: 1} \u00e9t\u00e9\n"
    failed = call(registry, "raise ValueError('bad input')")
    assert failed.error and failed.text.endswith("ValueError: bad input")
    assert call(registry, "import torch").text.endswith("ModuleNotFoundError: No module named 'torch'")
    hidden = "import os, sysconfig\nprint(os.listdir(sysconfig.get_path('purelib')))"  # the interpreter's own
    assert call(registry, hidden).text == "[]\n"


# -- a loud refusal where the isolation cannot be had, and the explicit opt-out --------------------------------


def test_a_missing_or_broken_bubblewrap_is_refused_naming_the_fix(tmp_path, monkeypatch):
    config = ToolsConfig(enabled=True, registry={"python": {"kind": "code", "packages": []}})
    monkeypatch.setenv("PATH", str(tmp_path))
    (problem,) = tool_problems(config)
    assert problem.startswith("tools.registry.python: ") and "apt-get install bubblewrap" in problem
    with pytest.raises(ValueError, match="bubblewrap"):
        ToolRegistry.from_config(config)
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.6.1' && exit 0\nexit 1\n")
    fake.chmod(0o755)
    (problem,) = tool_problems(config)
    assert "0.7.0 or newer" in problem
    fake.write_text(
        "#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.8.0' && exit 0\n"
        "echo 'bwrap: No permissions to create new namespace' >&2; exit 1\n"
    )
    (problem,) = tool_problems(config)
    assert "No permissions to create new namespace" in problem and "user.max_user_namespaces" in problem


def test_isolation_none_is_an_explicit_opt_out_warned_at_every_start(caplog):
    config = ToolsConfig(enabled=True, registry={"python": {"kind": "code", "isolation": "none", "packages": []}})
    for _ in range(2):
        ToolRegistry.from_config(config).close()
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 2
    assert "isolation=none: model-written code runs unisolated" in caplog.records[0].getMessage()
    tool = build_tool("python", config.registry["python"])
    assert tool.run("print(6 * 7)") == "42\n" and not tool.isolated_network
