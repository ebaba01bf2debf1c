"""Start this node's SGLang servers (and, on the first rollout node, the sglang router) for a Slurm job.

The train.sbatch scripts run it as one srun step with one task per rollout node; every task computes
the same layout (megatron_zcpo.rollout.sglang.server.server_specs: ``gpus_per_node // tp_size``
servers per node, ports ``base_port + i * port_stride``; a ``--tp-size`` above the node's GPUs:
servers of several consecutive nodes) and starts the processes that belong to its node, then
supervises them until the step is signalled. ``--print`` prints the plan's addresses
instead: the server URLs as a JSON list on the first line and the router URL on the second, which
the scripts pass to ``zcpo train`` as ``rollout.sglang.server_urls=[...]`` and
``rollout.sglang.router_url=...``.

Under Slurm a signal to a step reaches every process of it, servers included. Slurm's stop signals
(SIGTERM: a preemption's grace time; SIGUSR1) must not stop the servers, since the training's last
step before its checkpoint needs them: this process blocks them from its first line, and so does
every server and the router it starts (the signal mask is inherited; each runs through
:func:`stop_signals_blocked_python`, since SGLang's own start would unblock SIGTERM), and it prints
``sglang_node: received SIG...`` for the job script, which then knows the job is being stopped.
SIGINT (the job script's, forwarded by ``srun --disable-status``) stops the servers and the router.

``--run-config`` (the run's resolved config, ``zcpo train --dry-run``) sets what must agree with
the client (megatron_zcpo.rollout.sglang.server.server_config_for_run): ``--context-length`` that
serves ``data.max_prompt_length + max_new_tokens`` in full, the router's
``--request-timeout-secs`` from ``rollout.sglang.client.router_timeout_s``, deterministic inference
when ``rollout.sglang.client.sampling_seeds``, ``--enable-memory-saver`` (and no expandable segments)
when ``rollout.placement`` is colocated. Servers and router take requests only with the
job's key, ``--api-key`` from the environment variable ``ZCPO_SGLANG_API_KEY`` (train.sbatch
generates one per job; the training tasks send it), and bind to their node's address.

    ZCPO_SGLANG_API_KEY=... python examples/common/sglang_node.py --model-path HF_DIR --tp-size 4 \\
        --nodes n5,n6,n7,n8 --gpus-per-node 8 --python /opt/sglang/bin/python --run-config RESOLVED.yaml [--print]
"""

from __future__ import annotations

import signal

from megatron_zcpo.training.preemption import STOP_SIGNALS, record_stop_signals

if __name__ == "__main__":
    record_stop_signals()  # before the heavier imports: Slurm's SIGTERM/SIGUSR1 never stop this step

import argparse
import json
import os
import shlex
import sys
import time
from typing import List, Optional

from megatron_zcpo.megatron.lora import LoraConfig
from megatron_zcpo.rollout.sglang.config import API_KEY_ENV, SGLangEngineConfig
from megatron_zcpo.rollout.sglang.server import (
    SGLangLauncher,
    SGLangServerConfig,
    server_config_for_run,
    server_specs,
    weight_update_groups,
)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory the servers load")
    parser.add_argument(
        "--nodes", required=True, help="rollout nodes, comma-separated (the first also runs the router)"
    )
    parser.add_argument("--tp-size", type=int, required=True, help="GPUs per SGLang server")
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="interpreter with sglang and sglang-router (the image keeps them in their own venv)",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="--context-length of the servers (default with --run-config: what the run needs)",
    )
    parser.add_argument(
        "--run-config",
        default=None,
        help="the run's resolved config (zcpo train --dry-run): context length, router timeout, "
        "deterministic inference",
    )
    parser.add_argument("--mem-fraction-static", type=float, default=0.85)
    parser.add_argument("--base-port", type=int, default=30000)
    parser.add_argument("--router-port", type=int, default=29000)
    parser.add_argument("--log-dir", default="sglang_logs")
    parser.add_argument("--quantization", default=None, help="e.g. modelopt_fp8 (with rollout.quantization=fp8)")
    parser.add_argument("--ep-size", type=int, default=1, help="MoE models: experts split over a server's TP ranks")
    parser.add_argument(
        "--dp-attention",
        type=int,
        default=1,
        help="attention data-parallel in this many groups of a server (SGLang's --enable-dp-attention --dp-size)",
    )
    parser.add_argument("--attention-backend", default=None, help="SGLang's --attention-backend (e.g. fa3)")
    parser.add_argument("--trust-remote-code", action="store_true", help="checkpoints with code (Kimi-K2's tokenizer)")
    parser.add_argument(
        "--return-routed-experts",
        action="store_true",
        help="MoE routing replay: --enable-return-routed-experts (SGLang >= 0.5.7)",
    )
    parser.add_argument("--extra-args", default="", help="appended to every server command line (one string)")
    parser.add_argument(
        "--print",
        dest="show",
        action="store_true",
        help="print the plan's server URLs (a JSON list) and router URL on two lines, and exit",
    )
    return parser.parse_args(argv)


def server_config(args: argparse.Namespace) -> SGLangServerConfig:
    """The launcher config of ``args`` (explicit node list and GPU count: no dependence on the env
    but the API key), with the run config's settings (``--run-config``) where flags leave them."""
    launch = dict(
        model_path=args.model_path,
        tp_size=args.tp_size,
        gpus_per_node=args.gpus_per_node,
        nodes=[node for node in args.nodes.split(",") if node],
        base_port=args.base_port,
        mem_fraction_static=args.mem_fraction_static,
        context_length=args.context_length,
        quantization=args.quantization,
        ep_size=args.ep_size,
        dp_attention=args.dp_attention,
        attention_backend=args.attention_backend,
        trust_remote_code=args.trust_remote_code,
        return_routed_experts=args.return_routed_experts,
        extra_args=args.extra_args.split(),
        router=True,
        router_port=args.router_port,
        log_dir=args.log_dir,
        python=args.python,
    )
    if not args.run_config:
        return SGLangServerConfig(**launch, api_key=os.environ.get(API_KEY_ENV) or None)
    import yaml

    with open(args.run_config) as handle:
        run = yaml.safe_load(handle)
    client = SGLangEngineConfig(
        server_urls=["unset"],
        quantization=run["rollout"].get("quantization"),  # FP8 + colocated: --enable-weights-cpu-backup
        **(run["rollout"]["sglang"].get("client") or {}),
    )
    new_tokens = max(run["rollout"]["max_new_tokens"], (run.get("eval") or {}).get("max_new_tokens") or 0)
    launch["enable_memory_saver"] = run["rollout"].get("placement") == "colocated"
    parallel = run.get("parallel") or {}
    groups = weight_update_groups(parallel.get("pipeline", 1), parallel.get("expert", 1), client)
    lora = (run.get("model") or {}).get("lora")
    lora = LoraConfig(**lora) if lora else None  # push: adapter -> the servers' LoRA serving flags
    return server_config_for_run(launch, client, run["data"]["max_prompt_length"], new_tokens, groups, lora)


# Run first in a server's (and the router's) interpreter, then the module as ``python -m`` runs it.
# CPython's resource tracker unblocks SIGTERM in the thread that first starts it; SGLang starts it in
# its main thread before spawning its scheduler, which (and the HTTP server, whose SIGTERM handler
# stops it) then died of a preemption's SIGTERM (seen with SGLang 0.5.23 on CPU). Started here first,
# with the stop signals blocked again after it, it never unblocks them later.
_BLOCK_STOP_SIGNALS_THEN_RUN = (
    "import runpy, signal, sys; "
    "from multiprocessing import resource_tracker; "
    "resource_tracker.ensure_running(); "
    "signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGTERM, signal.SIGUSR1)); "
    "module = sys.argv[2]; "
    "sys.argv = [module, *sys.argv[3:]]; "
    'runpy.run_module(module, run_name="__main__", alter_sys=True)'
)


def stop_signals_blocked_python(python: str, directory: str) -> str:
    """An executable under ``directory`` that runs ``python -m MODULE ARGS`` with SIGTERM and SIGUSR1
    blocked for the whole life of the process and its children (see _BLOCK_STOP_SIGNALS_THEN_RUN)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.abspath(os.path.join(directory, "python-stop-signals-blocked"))
    staged = f"{path}.{os.getpid()}"  # every node writes the same file (a shared directory)
    with open(staged, "w") as script:
        script.write(f"#!/bin/sh\nexec {shlex.quote(python)} -c '{_BLOCK_STOP_SIGNALS_THEN_RUN}' \"$@\"\n")
    os.chmod(staged, 0o755)
    os.replace(staged, path)
    return path


def planned_addresses(config: SGLangServerConfig) -> dict:
    """{"server_urls": [...], "router_url": ...} of the whole job's plan."""
    specs = server_specs(config, env={})
    return {"server_urls": [spec.url for spec in specs], "router_url": f"http://{specs[0].node}:{config.router_port}"}


def supervise(launcher: SGLangLauncher, poll_s: float = 5.0) -> int:
    """Start this node's processes and wait: 0 after SIGINT, 1 when a process exits by itself.

    SIGTERM and SIGUSR1 (Slurm stopping the job) are reported on standard output, not obeyed: the
    servers keep serving until the job script sends SIGINT, after the training's last step."""
    stopping = []
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    for stop_signal in STOP_SIGNALS:  # run by record_stop_signals' thread when one arrives
        signal.signal(stop_signal, _report_stop_signal)
    launcher.start()
    if not launcher.processes:
        print(f"sglang_node: this host is not one of --nodes {launcher.config.nodes}", file=sys.stderr)
        return 1
    print(f"SGLang processes on this node: {', '.join(launcher.processes)}", flush=True)
    while not stopping and launcher.alive():
        time.sleep(poll_s)
    failed = not stopping
    if failed:
        print(launcher.failure_report(), file=sys.stderr, flush=True)
    for process in launcher.processes.values():  # what the job's SIGINT reached already; they block SIGTERM
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGINT)
    launcher.stop()
    return int(failed)


def _report_stop_signal(signum, frame) -> None:
    # The job script looks for this line (zcpo_job.sh, wait_for_health): a preemption's SIGTERM during
    # the servers' start-up reaches this step, not the script.
    print(f"sglang_node: received {signal.Signals(signum).name}; the servers keep serving until SIGINT", flush=True)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    config = server_config(args)
    if args.show:
        addresses = planned_addresses(config)
        print(json.dumps(addresses["server_urls"], separators=(",", ":")))
        print(addresses["router_url"])
        return 0
    if not config.api_key:  # every node must start its servers with the one key the trainer sends
        print(f"sglang_node: set {API_KEY_ENV} to the job's API key (train.sbatch generates one)", file=sys.stderr)
        return 2
    config.python = stop_signals_blocked_python(config.python, config.log_dir)
    return supervise(SGLangLauncher(config))


if __name__ == "__main__":
    sys.exit(main())
