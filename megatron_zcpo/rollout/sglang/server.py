"""Launch SGLang servers (one per inference TP group) and the sglang router from a config or Slurm's environment.

Command lines follow SGLang v0.5.3 (``python -m sglang.launch_server --model-path ... --tp-size
...``) and sglang-router 0.2.0 (``python -m sglang_router.launch_router --worker-urls ...``). Each
server gets its GPUs through ``CUDA_VISIBLE_DEVICES``; under Slurm every node runs the servers
of its own GPUs (one launcher per node) and the first node also runs the router. Servers and
router bind to their node's address (the host of their URL), not to every interface, and take
requests only with the job's API key (``--api-key``: a fresh one per launch unless given).
What must agree with the client is filled in from its config by :func:`server_config_for_run`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.api import (
    DETERMINISTIC_ATTENTION_BACKENDS,
    ROUTER_DEFAULT_REQUEST_TIMEOUT_S,
    ROUTER_HEALTH_CHECK_INTERVAL_S,
    ROUTER_HEALTH_CHECK_PATH,
    required_context_length,
)
from megatron_zcpo.utils.network import is_loopback, resolve
from megatron_zcpo.utils.slurm import expand_slurm_nodelist

# Device memory of one NCCL communicator on each of its ranks, an upper estimate at NCCL's defaults on
# H100 (a broadcast runs on rings: up to 32 channels x the receive buffers of its three protocols,
# SIMPLE 4 MiB + LL128 ~4.6 MiB + LL 0.25 MiB = ~283 MiB). Measure it with nvidia-smi before and after
# /init_weights_update_group on your cluster and set rollout.sglang.launch.communicator_mib.
NCCL_COMMUNICATOR_MIB = 288.0
MIN_MEM_FRACTION_STATIC = 0.3  # below it the launch refuses: the pushes' memory leaves SGLang too little


@dataclass
class SGLangServerConfig:
    """How to start the rollout servers.

    ``tp_size`` GPUs per server; ``gpus_per_node`` (None: Slurm's SLURM_GPUS_ON_NODE, else the
    CUDA_VISIBLE_DEVICES count) are split into ``gpus_per_node // tp_size`` servers per node,
    capped at ``num_servers`` in total when given. Ports: ``base_port + i * port_stride`` for the
    i-th server of a node (SGLang takes a few ports above its HTTP port). ``nodes``: host names
    (None: SLURM_JOB_NODELIST, else this host). ``quantization`` is passed as
    ``--quantization`` (``modelopt_fp8`` for FP8 rollouts). Mixture-of-experts models: ``ep_size``
    splits each server's experts over that many of its TP ranks (``--ep-size``: 1 or ``tp_size``),
    ``return_routed_experts`` launches with ``--enable-return-routed-experts`` (SGLang >= 0.5.7;
    routing replay). ``extra_args`` are appended to every
    server command. ``server_module`` / ``router_module`` can point at stand-ins (tests).
    ``api_key``: ``--api-key`` of every server and the router (None: a fresh random key per
    launcher, :attr:`SGLangLauncher.api_key`). ``router_request_timeout_s``: the router's
    ``--request-timeout-secs`` (the client's ``router_timeout_s``); its periodic worker checks ask
    :data:`~megatron_zcpo.rollout.sglang.api.ROUTER_HEALTH_CHECK_PATH` (never a generation) every
    ``router_health_check_interval_s``.
    ``enable_deterministic_inference``: per-request seeds are used (the client's
    ``sampling_seeds``); SGLang then needs ``attention_backend`` among
    :data:`~megatron_zcpo.rollout.sglang.api.DETERMINISTIC_ATTENTION_BACKENDS` (fa3, SGLang's
    default for Qwen2/Llama/Qwen3 on H100).
    ``enable_memory_saver`` (``rollout.placement=colocated`` sets it): ``--enable-memory-saver``, so
    the server releases and resumes its weights, KV cache and CUDA graphs on request; its processes
    then run without ``expandable_segments`` in ``PYTORCH_CUDA_ALLOC_CONF`` (the memory saver's
    virtual-memory mapping and CUDA IPC of its tensors break with it).
    ``enable_weights_cpu_backup``: ``--enable-weights-cpu-backup``, a host copy of the weights across a
    release (:func:`server_config_for_run` sets it for quantised colocated servers: a release keeps only
    the model's buffers, and the FP8 activation scales are parameters no push carries).
    ``gpu_memory_gib`` (80: H100) and ``communicator_mib`` (one NCCL communicator's device memory,
    :data:`NCCL_COMMUNICATOR_MIB`): what :func:`server_config_for_run` takes off
    ``mem_fraction_static`` for the weight pushes.

    Large models (DeepSeek-V3 / Kimi-K2): a ``tp_size`` above the node's GPUs makes each server span
    ``tp_size / gpus_per_node`` consecutive nodes (``--nnodes``, ``--node-rank``, ``--dist-init-addr``
    on its first node's ``dist_init_port``; its URL is the first node's); ``dp_attention`` > 1 runs
    the attention data-parallel in that many groups (``--enable-dp-attention --dp-size``: each group
    keeps its own requests' KV cache, which multi-latent attention would otherwise copy to every GPU,
    at the price of a copy of the attention weights per group); ``attention_backend`` is passed
    whenever set (``fa3`` when deterministic inference needs one); ``trust_remote_code`` for
    checkpoints whose tokenizer is code (Kimi-K2). The same flags in 0.5.3.post3 and 0.5.23 (checked
    with both releases' parsers).
    ``lora_rank`` (``model.lora.push: adapter``): ``--enable-lora --max-lora-rank R
    --lora-target-modules ...`` (``lora_target_modules``, Hugging Face names), the servers then take
    the run's adapter by name; None: no LoRA serving (a merged push goes into the base).
    """

    model_path: str
    tp_size: int = 1
    gpus_per_node: Optional[int] = None
    num_servers: Optional[int] = None
    nodes: Optional[List[str]] = None
    base_port: int = 30000
    port_stride: int = 10
    mem_fraction_static: float = 0.85
    dtype: str = "bfloat16"
    context_length: Optional[int] = None
    quantization: Optional[str] = None
    random_seed: int = 0
    ep_size: int = 1
    return_routed_experts: bool = False
    extra_args: List[str] = field(default_factory=list)
    router: bool = True
    router_port: int = 29000
    router_policy: str = "cache_aware"
    log_dir: str = "sglang_logs"
    python: str = sys.executable
    server_module: str = "sglang.launch_server"
    router_module: str = "sglang_router.launch_router"
    startup_timeout_s: float = 1200.0
    api_key: Optional[str] = None
    router_request_timeout_s: float = float(ROUTER_DEFAULT_REQUEST_TIMEOUT_S)
    router_health_check_interval_s: int = ROUTER_HEALTH_CHECK_INTERVAL_S
    enable_deterministic_inference: bool = False
    attention_backend: Optional[str] = None
    enable_memory_saver: bool = False
    enable_weights_cpu_backup: bool = False
    gpu_memory_gib: float = 80.0
    communicator_mib: float = NCCL_COMMUNICATOR_MIB
    dp_attention: int = 1
    trust_remote_code: bool = False
    dist_init_port: int = 29700
    lora_rank: Optional[int] = None
    lora_target_modules: List[str] = field(default_factory=list)

    def validate(self, prefix: str = "rollout.servers") -> None:
        """Raise ``ValueError`` naming the offending key."""
        if not self.model_path:
            raise ValueError(f"{prefix}.model_path must name a Hugging Face model directory")
        if self.lora_rank is not None and (self.lora_rank < 1 or not self.lora_target_modules):
            raise ValueError(
                f"{prefix}.lora_rank={self.lora_rank} needs a positive rank and {prefix}.lora_target_modules"
            )
        for key in ("tp_size", "base_port", "port_stride", "router_port"):
            if getattr(self, key) < 1:
                raise ValueError(f"{prefix}.{key} must be >= 1, got {getattr(self, key)}")
        if self.dp_attention < 1 or self.tp_size % self.dp_attention:
            raise ValueError(
                f"{prefix}.dp_attention={self.dp_attention} must divide tp_size={self.tp_size} (SGLang's --dp-size "
                f"groups of the attention; 1: off)"
            )
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"{prefix}.ep_size={self.ep_size} must be 1 or tp_size={self.tp_size} (SGLang splits a "
                f"server's experts over its TP ranks)"
            )
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"{prefix}.mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.router_request_timeout_s <= 0:
            raise ValueError(f"{prefix}.router_request_timeout_s must be positive, got {self.router_request_timeout_s}")
        if self.enable_deterministic_inference and self.attention_backend not in (
            None,
            *DETERMINISTIC_ATTENTION_BACKENDS,
        ):
            raise ValueError(
                f"{prefix}.attention_backend={self.attention_backend!r}: SGLang's deterministic inference "
                f"(rollout.sglang.client.sampling_seeds) runs on {list(DETERMINISTIC_ATTENTION_BACKENDS)}"
            )


def weight_update_groups(pipeline: int, expert: int, client) -> int:
    """How many weight-update groups (NCCL communicators) every SGLang GPU holds at once: one per share
    under pipeline or expert parallelism (each share's lead has its own; ``pipeline`` x ``expert``
    shares), kept between pushes unless ``client.keep_weight_update_groups`` is false (then one at a
    time, during its share's push); none with the disk transport (``client``: an SGLangEngineConfig)."""
    if client.weight_sync != "distributed":
        return 0
    return int(pipeline) * int(expert) if client.keep_weight_update_groups else 1


def weight_update_reserve_bytes(groups: int, bucket_bytes: int, communicator_mib: float = NCCL_COMMUNICATOR_MIB) -> int:
    """Device memory an SGLang GPU holds for weight pushes outside its static pool: the received
    bucket (``bucket_bytes``) and ``groups`` communicators (:func:`weight_update_groups`)."""
    return (bucket_bytes if groups else 0) + int(groups * communicator_mib * 2**20)


def server_config_for_run(
    launch: Mapping[str, Any],
    client,
    max_prompt_length: int,
    max_new_tokens: int,
    weight_groups: int = 1,
    lora=None,
) -> SGLangServerConfig:
    """The launcher config of ``launch`` (``rollout.sglang.launch``) with what must agree with the
    client (``client``, its SGLangEngineConfig) and the run's lengths filled in where ``launch``
    leaves it: ``--context-length`` that serves ``max_prompt_length + max_new_tokens`` in full,
    the router's ``--request-timeout-secs`` from ``client.router_timeout_s``, deterministic
    inference when ``client.sampling_seeds``, the client's API key, and a host copy of the weights
    (``--enable-weights-cpu-backup``) for a memory-saver server of FP8 rollouts. ``--mem-fraction-static``
    gives up what the weight pushes hold outside SGLang's static pool (:func:`weight_update_reserve_bytes`
    of ``weight_groups`` groups, see :func:`weight_update_groups`, on GPUs of ``gpu_memory_gib``), so
    SGLang keeps the memory it plans for its activations (its static pool, model weights included,
    shrinks instead: the planner's decode rate sees the lowered fraction). ``lora`` (the run's
    ``model.lora`` when its adapters are pushed alone) sets the LoRA serving flags."""
    derived = {
        "context_length": required_context_length(max_prompt_length, max_new_tokens),
        "router_request_timeout_s": client.router_timeout_s,
        "enable_deterministic_inference": bool(client.sampling_seeds),
        "api_key": client.api_key,
    }
    if lora is not None and lora.push == "adapter":
        from megatron_zcpo.convert.peft import hf_target_modules

        derived.update(lora_rank=lora.rank, lora_target_modules=hf_target_modules(lora))
    config = SGLangServerConfig(**{**derived, **{key: value for key, value in launch.items() if value is not None}})
    if config.enable_memory_saver and (client.quantization == "fp8" or config.quantization):
        if launch.get("enable_weights_cpu_backup") is False:
            raise ValueError(
                "rollout.sglang.launch.enable_weights_cpu_backup=false with quantised rollouts on memory-saver "
                "(colocated) servers: a release keeps only the model's buffers and loses the FP8 activation "
                "scales no push carries; leave it unset"
            )
        config = dataclasses.replace(config, enable_weights_cpu_backup=True)
    groups = weight_groups if client.weight_sync == "distributed" else 0
    reserve = weight_update_reserve_bytes(groups, client.bucket_bytes, config.communicator_mib)
    fraction = config.mem_fraction_static - reserve / (config.gpu_memory_gib * 2**30)
    if fraction < MIN_MEM_FRACTION_STATIC:
        raise ValueError(
            f"the weight pushes hold {reserve / 2**30:.1f} GiB of every SGLang GPU outside its static pool "
            f"({groups} weight-update groups x {config.communicator_mib:.0f} MiB + a "
            f"rollout.sglang.client.bucket_bytes = {client.bucket_bytes / 2**30:.2f} GiB bucket), leaving "
            f"rollout.sglang.launch.mem_fraction_static {config.mem_fraction_static} - "
            f"{reserve / 2**30:.1f} / {config.gpu_memory_gib:.0f} GiB = {fraction:.2f} < {MIN_MEM_FRACTION_STATIC}: "
            f"set rollout.sglang.client.keep_weight_update_groups=false (one group at a time), lower "
            f"bucket_bytes, or use rollout.sglang.client.weight_sync=disk"
        )
    return dataclasses.replace(config, mem_fraction_static=round(fraction, 4))


def without_expandable_segments(env: Mapping[str, str]) -> Dict[str, str]:
    """``env`` with ``expandable_segments`` dropped from ``PYTORCH_CUDA_ALLOC_CONF`` (a memory-saver
    server's allocations must stay plain cudaMalloc blocks: CUDA IPC handles and the saver's
    pause/resume both need them), the allocator's other settings kept."""
    env = dict(env)
    settings = [s for s in env.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if s]
    kept = [s for s in settings if s.split(":")[0].strip() != "expandable_segments"]
    if kept:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(kept)
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    return env


@dataclass(frozen=True)
class ServerSpec:
    """One SGLang server: where it runs (``node``, which serves HTTP; a server spanning nodes runs on
    all of ``hosts``, ``node`` first), its HTTP port and the GPU ids it owns on each of its nodes."""

    node: str
    port: int
    gpu_ids: tuple
    hosts: tuple = ()

    @property
    def url(self) -> str:
        return f"http://{self.node}:{self.port}"

    @property
    def nodes(self) -> tuple:
        """Every node the server runs on, its first (HTTP) node first."""
        return self.hosts or (self.node,)


def _gpus_per_node(config: SGLangServerConfig, env: Mapping[str, str]) -> int:
    if config.gpus_per_node:
        return config.gpus_per_node
    if env.get("SLURM_GPUS_ON_NODE"):
        return int(env["SLURM_GPUS_ON_NODE"])
    if env.get("CUDA_VISIBLE_DEVICES"):
        return len(env["CUDA_VISIBLE_DEVICES"].split(","))
    raise ValueError(
        "rollout.servers.gpus_per_node is not set and neither SLURM_GPUS_ON_NODE nor "
        "CUDA_VISIBLE_DEVICES says how many GPUs this node has"
    )


def server_specs(config: SGLangServerConfig, env: Optional[Mapping[str, str]] = None) -> List[ServerSpec]:
    """Every server of the job, node by node (every node computes the same list)."""
    env = os.environ if env is None else env
    config.validate()
    nodes = config.nodes or (
        expand_slurm_nodelist(env["SLURM_JOB_NODELIST"]) if env.get("SLURM_JOB_NODELIST") else [_this_host(env)]
    )
    gpus = _gpus_per_node(config, env)
    visible = env.get("CUDA_VISIBLE_DEVICES", "").split(",") if env.get("CUDA_VISIBLE_DEVICES") else None
    if config.tp_size > gpus:
        return _multi_node_specs(config, nodes, gpus, visible)
    specs: List[ServerSpec] = []
    for node in nodes:
        for index in range(gpus // config.tp_size):
            if config.num_servers is not None and len(specs) == config.num_servers:
                return specs
            ids = list(range(index * config.tp_size, (index + 1) * config.tp_size))
            gpu_ids = tuple(visible[i] for i in ids) if visible else tuple(str(i) for i in ids)
            specs.append(ServerSpec(node, config.base_port + index * config.port_stride, gpu_ids))
    return specs


def _multi_node_specs(config: SGLangServerConfig, nodes: List[str], gpus: int, visible) -> List[ServerSpec]:
    """Servers of ``tp_size / gpus`` consecutive nodes each, every GPU of those nodes."""
    if config.tp_size % gpus:
        raise ValueError(
            f"rollout.servers.tp_size={config.tp_size} spans nodes of {gpus} GPUs: it must be a multiple of {gpus}"
        )
    per_server = config.tp_size // gpus
    if len(nodes) % per_server:
        raise ValueError(
            f"{len(nodes)} rollout nodes do not split into servers of {per_server} nodes (tp_size={config.tp_size})"
        )
    gpu_ids = tuple(visible) if visible else tuple(str(i) for i in range(gpus))
    specs = [
        ServerSpec(nodes[i], config.base_port, gpu_ids, tuple(nodes[i : i + per_server]))
        for i in range(0, len(nodes), per_server)
    ]
    return specs[: config.num_servers] if config.num_servers is not None else specs


def _this_host(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or socket.gethostname()


def server_command(
    spec: ServerSpec, config: SGLangServerConfig, api_key: Optional[str] = None, node_rank: int = 0
) -> List[str]:
    """The ``python -m sglang.launch_server ...`` command line of one server (``api_key``: default
    ``config.api_key``) on its ``node_rank``-th node (servers spanning nodes)."""
    command = [
        config.python,
        "-m",
        config.server_module,
        "--model-path",
        config.model_path,
        "--host",
        spec.node,
        "--port",
        str(spec.port),
        "--tp-size",
        str(config.tp_size),
        "--mem-fraction-static",
        str(config.mem_fraction_static),
        "--dtype",
        config.dtype,
        "--random-seed",
        str(config.random_seed),
    ]
    if config.context_length:
        command += ["--context-length", str(config.context_length)]
    if config.quantization:
        command += ["--quantization", config.quantization]
    if config.enable_deterministic_inference:
        command += ["--enable-deterministic-inference", "--attention-backend", config.attention_backend or "fa3"]
    elif config.attention_backend:
        command += ["--attention-backend", config.attention_backend]
    if len(spec.nodes) > 1:
        command += ["--nnodes", str(len(spec.nodes)), "--node-rank", str(node_rank)]
        command += ["--dist-init-addr", f"{spec.nodes[0]}:{config.dist_init_port}"]
    if config.dp_attention > 1:
        command += ["--enable-dp-attention", "--dp-size", str(config.dp_attention)]
    if config.trust_remote_code:
        command += ["--trust-remote-code"]
    if api_key or config.api_key:
        command += ["--api-key", api_key or config.api_key]
    if config.ep_size > 1:
        command += ["--ep-size", str(config.ep_size)]
    if config.return_routed_experts:
        command += ["--enable-return-routed-experts"]
    if config.enable_memory_saver:
        command += ["--enable-memory-saver"]
    if config.lora_rank is not None:
        command += ["--enable-lora", "--max-lora-rank", str(config.lora_rank), "--lora-target-modules"]
        command += list(config.lora_target_modules)
    if config.enable_weights_cpu_backup:
        command += ["--enable-weights-cpu-backup"]
    return command + list(config.extra_args)


def router_command(
    worker_urls: List[str], config: SGLangServerConfig, host: str, api_key: Optional[str] = None
) -> List[str]:
    """The ``python -m sglang_router.launch_router ...`` command line over ``worker_urls``, bound to
    ``host`` (the router node's name), cutting requests after ``config.router_request_timeout_s``.
    Its worker checks never generate (:data:`~megatron_zcpo.rollout.sglang.api.ROUTER_HEALTH_CHECK_PATH`):
    SGLang's ``/health`` would run a token on a colocated server's released memory during training,
    and block behind a long weight push until the router marks the workers unhealthy."""
    command = [
        config.python,
        "-m",
        config.router_module,
        "--host",
        host,
        "--port",
        str(config.router_port),
        "--policy",
        config.router_policy,
        "--request-timeout-secs",
        str(int(config.router_request_timeout_s)),
        "--health-check-endpoint",
        ROUTER_HEALTH_CHECK_PATH,
        "--health-check-interval-secs",
        str(int(config.router_health_check_interval_s)),
        "--worker-urls",
        *worker_urls,
    ]
    if api_key or config.api_key:
        command += ["--api-key", api_key or config.api_key]
    return command


def check_bind_address(node: str, getaddrinfo=None) -> None:
    """Raise ``ValueError`` when the servers of ``node`` would bind to a loopback address although
    ``node`` is not a loopback name (a Debian-style /etc/hosts maps the host name to 127.0.1.1):
    other nodes could not reach them. ``getaddrinfo``: the name service (default socket's)."""
    if node in ("localhost", "::1") or node.startswith("127."):
        return
    address = resolve(node, 0, getaddrinfo)[1]
    if is_loopback(address):
        raise ValueError(
            f"rollout node {node!r} resolves to {address} on this host: servers bound there could not "
            f"be reached from other nodes; name the rollout nodes by an address of the cluster network "
            f"(rollout.sglang.launch.nodes, or sglang_node.py --nodes)"
        )


class SGLangLauncher:
    """Starts this node's servers (and, on the first node, the router); stops them on :meth:`stop`.

    Each process gets its own session (so stopping kills its children too) and a log file under
    ``config.log_dir``; a process that dies during start-up is reported with its log's tail.
    """

    def __init__(self, config: SGLangServerConfig, env: Optional[Mapping[str, str]] = None):
        self.config = config
        self.env: Dict[str, str] = dict(os.environ if env is None else env)
        self.specs = server_specs(config, self.env)
        self.api_key = config.api_key or secrets.token_urlsafe(32)  # the servers' and router's --api-key
        self.processes: Dict[str, subprocess.Popen] = {}
        self._logs: Dict[str, str] = {}

    @property
    def server_urls(self) -> List[str]:
        return [spec.url for spec in self.specs]

    @property
    def router_url(self) -> Optional[str]:
        return f"http://{self.specs[0].node}:{self.config.router_port}" if self.config.router else None

    def _is_this_node(self, node: str) -> bool:
        here = _this_host(self.env)
        return node in (here, here.split(".")[0], "127.0.0.1", "localhost")

    def start(self) -> None:
        """Spawn the processes that belong to this node."""
        os.makedirs(self.config.log_dir, exist_ok=True)
        for spec in self.specs:
            for rank, host in enumerate(spec.nodes):
                if not self._is_this_node(host):
                    continue
                check_bind_address(spec.node)
                env = dict(self.env, CUDA_VISIBLE_DEVICES=",".join(spec.gpu_ids))
                if self.config.enable_memory_saver:
                    env = without_expandable_segments(env)
                command = server_command(spec, self.config, self.api_key, node_rank=rank)
                suffix = f"-node{rank}" if len(spec.nodes) > 1 else ""
                self._spawn(f"server-{spec.node}-{spec.port}{suffix}", command, env)
        if self.config.router and self._is_this_node(self.specs[0].node):
            self._spawn(
                "router",
                router_command(self.server_urls, self.config, self.specs[0].node, self.api_key),
                dict(self.env),
            )

    def _spawn(self, name: str, command: List[str], env: Dict[str, str]) -> None:
        path = os.path.join(self.config.log_dir, f"{name}.log")
        with open(path, "ab") as log:
            self.processes[name] = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._logs[name] = path

    def alive(self) -> bool:
        """Whether every launched process still runs."""
        return all(process.poll() is None for process in self.processes.values())

    def failure_report(self, lines: int = 20) -> str:
        """Exit codes and log tails of the processes that exited."""
        report = []
        for name, process in self.processes.items():
            if process.poll() is not None:
                with open(self._logs[name], errors="replace") as log:
                    tail = "".join(log.readlines()[-lines:])
                report.append(
                    f"{name} exited with code {process.returncode}; last lines of {self._logs[name]}:\n{tail}"
                )
        return "\n".join(report)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM every process group, then SIGKILL what is left after ``grace_s``."""
        for process in self.processes.values():
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # exited (with its group) since we looked
        os.killpg(process.pid, sig)


def launch_sglang(launcher: SGLangLauncher, **client_options):
    """Start ``launcher``'s processes, wait until all servers of the job are healthy, return a client.

    ``client_options`` go to :class:`SGLangEngineConfig` (timeouts, weight push); the client
    sends the launcher's API key and knows the router's timeout. The returned :class:`SGLangEngine` stops the launched processes
    when it shuts down. Raises ``RolloutError`` with the exit codes and log tails when a process
    dies during start-up.
    """
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    launcher.start()
    options = {
        **client_options,
        "api_key": launcher.api_key,
        "router_timeout_s": launcher.config.router_request_timeout_s,
    }
    engine = SGLangEngine(
        SGLangEngineConfig(server_urls=launcher.server_urls, router_url=launcher.router_url, **options),
        on_shutdown=launcher.stop,
    )
    try:
        engine.wait_until_healthy(launcher.config.startup_timeout_s, is_alive=launcher.alive)
    except RolloutError as err:
        report = launcher.failure_report()
        engine.shutdown()
        raise RolloutError(f"{err}\n{report}") from None
    return engine
