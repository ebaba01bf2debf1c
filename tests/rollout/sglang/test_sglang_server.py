"""SGLang launcher: Slurm node lists, GPU/port plans, command lines, health wait and clean stop (without SGLang)."""

import os
import socket

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
from megatron_zcpo.rollout.sglang.server import (
    ServerSpec,
    SGLangLauncher,
    SGLangServerConfig,
    check_bind_address,
    launch_sglang,
    router_command,
    server_command,
    server_specs,
)
from megatron_zcpo.utils.runtime import free_port
from megatron_zcpo.utils.slurm import expand_slurm_nodelist


def test_expand_slurm_nodelist():
    assert expand_slurm_nodelist("gpu[07-09,12],login1,h[1-2]") == [
        "gpu07",
        "gpu08",
        "gpu09",
        "gpu12",
        "login1",
        "h1",
        "h2",
    ]
    assert expand_slurm_nodelist("node001") == ["node001"]
    with pytest.raises(ValueError, match="malformed Slurm node list"):
        expand_slurm_nodelist("gpu[a-3]")


def test_plan_from_slurm_environment():
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_GPUS_ON_NODE": "8", "SLURMD_NODENAME": "gpu07"}
    specs = server_specs(SGLangServerConfig(model_path="/m", tp_size=4, base_port=31000), env)
    assert specs == [
        ServerSpec("gpu07", 31000, ("0", "1", "2", "3")),
        ServerSpec("gpu07", 31010, ("4", "5", "6", "7")),
        ServerSpec("gpu08", 31000, ("0", "1", "2", "3")),
        ServerSpec("gpu08", 31010, ("4", "5", "6", "7")),
    ]
    assert specs[2].url == "http://gpu08:31000"
    # visible GPU ids are kept (a job step that got GPUs 4-7), and num_servers caps the plan
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    specs = server_specs(SGLangServerConfig(model_path="/m", tp_size=2, nodes=["h"], num_servers=1), env)
    assert specs == [ServerSpec("h", 30000, ("4", "5"))]
    with pytest.raises(ValueError, match="1 rollout nodes do not split into servers of 2 nodes"):
        server_specs(SGLangServerConfig(model_path="/m", tp_size=16), {"SLURM_GPUS_ON_NODE": "8"})
    with pytest.raises(ValueError, match="tp_size=12 spans nodes of 8 GPUs: it must be a multiple of 8"):
        server_specs(SGLangServerConfig(model_path="/m", tp_size=12), {"SLURM_GPUS_ON_NODE": "8"})
    with pytest.raises(ValueError, match="rollout.servers.gpus_per_node"):
        server_specs(SGLangServerConfig(model_path="/m"), {})


def test_command_lines():
    config = SGLangServerConfig(
        model_path="/ckpt/qwen",
        tp_size=8,
        quantization="modelopt_fp8",
        context_length=20480,
        python="python",
        extra_args=["--enable-fp32-lm-head"],
    )
    command = server_command(ServerSpec("n1", 30010, tuple("01234567")), config)
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    assert "--skip-tokenizer-init" in command  # every launch: token ids in, token ids out
    valued = [arg for arg in command[3:] if arg != "--skip-tokenizer-init"]
    flags = dict(zip(valued[::2], valued[1::2]))
    assert flags["--model-path"] == "/ckpt/qwen" and flags["--port"] == "30010" and flags["--tp-size"] == "8"
    assert flags["--quantization"] == "modelopt_fp8" and flags["--context-length"] == "20480"
    assert command[-1] == "--enable-fp32-lm-head"
    assert flags["--host"] == "n1" and "--api-key" not in flags  # the node's address; no key given here
    assert router_command(["http://a:1", "http://b:2"], config, "n1", "k3y") == [
        "python",
        "-m",
        "sglang_router.launch_router",
        "--host",
        "n1",
        "--port",
        "29000",
        "--policy",
        "cache_aware",
        "--request-timeout-secs",
        "1800",
        "--prometheus-port",  # not the routers' default 29000, the router's own port here
        "29001",
        "--health-check-endpoint",  # the router's checks never generate: a liveness check
        "/get_model_info",
        "--health-check-interval-secs",
        "60",
        "--worker-urls",
        "http://a:1",
        "http://b:2",
        "--api-key",
        "k3y",
    ]


TINY = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def write_tiny_checkpoint(directory, config=TINY):
    """A random Hugging Face checkpoint of ``config`` in ``directory`` (what mock servers load); returns it."""
    from megatron_zcpo.convert.hf_checkpoint import write_hf_config, write_safetensors_shards
    from megatron_zcpo.convert.mapping import hf_config_from_model_config
    from megatron_zcpo.rollout.embedded import build_hf_causal_lm

    torch.manual_seed(0)
    model = build_hf_causal_lm(config)
    write_hf_config(directory, hf_config_from_model_config(config))
    write_safetensors_shards(directory, ((n, p) for n, p in model.named_parameters() if n != "lm_head.weight"))
    return directory


def test_launch_waits_for_health_serves_and_stops(tmp_path):
    """Two CPU stand-ins for sglang.launch_server and one for the router, started with a fresh API key,
    health-waited, checked, used, and stopped; a client without the key is refused at start-up."""
    config = SGLangServerConfig(
        model_path=write_tiny_checkpoint(str(tmp_path / "hf")),
        nodes=["127.0.0.1"],
        gpus_per_node=2,
        tp_size=1,
        base_port=free_port(2),
        port_stride=1,
        router_port=free_port(2),  # and its metrics on the next
        log_dir=str(tmp_path / "logs"),
        server_module="megatron_zcpo.testing.mock_server",
        router_module="megatron_zcpo.testing.mock_router",
        startup_timeout_s=120,
        router_request_timeout_s=120,
    )
    launcher = SGLangLauncher(config, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    engine = launch_sglang(launcher, request_timeout_s=60)
    processes = list(launcher.processes.values())
    try:
        assert len(processes) == 3 and all(p.poll() is None for p in processes)
        assert engine.config.api_key == launcher.api_key and len(launcher.api_key) >= 32  # generated for this launch
        assert [fact.url for fact in engine.check_servers(3, 3)] == launcher.server_urls
        results = engine.generate([[1, 2, 3], [4]], SamplingParams(max_new_tokens=3, seed=0), n=2)
        assert all(len(c.output_ids) == 3 for samples in results for c in samples)
        stranger = SGLangEngineConfig(
            server_urls=launcher.server_urls, router_url=launcher.router_url, api_key="guessed", router_timeout_s=3600
        )
        with (
            SGLangEngine(stranger) as other,
            pytest.raises(RolloutError, match="(?s)refused the API key.*" + launcher.router_url),
        ):
            other.check_servers(3, 3)
    finally:
        engine.shutdown()
    assert all(p.poll() is not None for p in processes)


def test_servers_bind_to_their_nodes_address_never_silently_to_loopback():
    def resolver(table):
        return lambda host, port, *args, **kwargs: [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (table[host], port))]

    check_bind_address("gpu05", resolver({"gpu05": "10.1.0.5"}))
    check_bind_address("127.0.0.1", resolver({}))  # a loopback name: tests, one-host runs
    with pytest.raises(ValueError, match="'gpu05' resolves to 127.0.1.1 on this host.*rollout.sglang.launch.nodes"):
        check_bind_address("gpu05", resolver({"gpu05": "127.0.1.1"}))  # a Debian-style /etc/hosts


def test_launch_reports_a_dying_server(tmp_path):
    config = SGLangServerConfig(
        model_path="/nonexistent",
        nodes=["127.0.0.1"],
        gpus_per_node=1,
        router=False,
        base_port=free_port(),
        log_dir=str(tmp_path),
        server_module="no_such_sglang_module",
        startup_timeout_s=60,
    )
    with pytest.raises(
        RolloutError, match=r"(?s)exited before.*exited with code 1.*No module named no_such_sglang_module"
    ):
        launch_sglang(SGLangLauncher(config, env=dict(os.environ)))
