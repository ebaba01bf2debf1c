"""Cluster time scales in CI: the loop at TP2 x PP2 (4 gloo ranks) through a router and two mock SGLang
servers whose rollout outlasts the process groups' timeout and the router's (all scaled down to
seconds), with the API key, per-request seeds and the context length of a real launch. The run
finishes, and its metrics equal those of the same run on instant servers. (The stages' pushes to
two servers through weight-update groups: tests/recipe/test_weight_push_stages.py.)"""

import datetime
import json
import time

import yaml

from megatron_zcpo.rollout.sglang.api import required_context_length
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.mock_router import MockSGLangRouter
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.utils.runtime import free_port
from tests.cli.test_train import tiny_model  # noqa: F401 - a fixture

# Scaled down from 1,800 s; still well above what a legitimate collective (the checkpoint's barriers)
# takes on two cores shared with other jobs (4 s was exceeded there at a load average of 50).
COLLECTIVE_TIMEOUT_S = 10.0  # parallel.collective_timeout_s
REQUEST_TIMEOUT_S = 7.0
ROUTER_TIMEOUT_S = 8.0  # the router's --request-timeout-secs (rollout.sglang.client.router_timeout_s)
GENERATE_S = 6.0  # each request takes this long; 8 samples, 4 in flight: a rollout takes >= 12 s
PROMPT_TOKENS, NEW_TOKENS = 64, 6
API_KEY = "job-key-4242"


def parity_reward(response, ground_truth, metadata):
    """1 or 0 by the parity of the response's characters: groups of a random model get contrast (and gradients)."""
    return float(sum(map(ord, response)) % 2)


def _config(root, model_dir, urls, router_url, run_dir):
    config = {
        "model": {"path": str(model_dir)},
        "parallel": {"tensor": 2, "pipeline": 2, "collective_timeout_s": COLLECTIVE_TIMEOUT_S},
        "train": {
            "steps": 2,
            "mini_batches": 2,
            "micro_batch_tokens": 256,
            "verify_against_hf": False,
            "optimizer": {"lr": 1e-4, "warmup_steps": 0},
        },
        "algorithm": {"name": "zcpo", "beta": 1.0},
        "rollout": {
            "engine": "sglang",
            "prompts_per_step": 4,
            "samples_per_prompt": 2,
            "max_new_tokens": NEW_TOKENS,
            "dynamic_sampling": {"drop_tied_groups": False},
            "sglang": {
                "server_urls": urls,
                "router_url": router_url,
                "client": {
                    "sampling_seeds": True,
                    "max_concurrency": 4,
                    "request_timeout_s": REQUEST_TIMEOUT_S,
                    "router_timeout_s": ROUTER_TIMEOUT_S,
                    "max_retries": 1,
                    "rollout_timeout_s": 60.0,
                    "startup_timeout_s": 30.0,
                    "update_timeout_s": 60.0,
                    # the servers share this process: one weight-update group each is not possible here
                    "weight_sync": "disk",
                    "weight_dir": str(root / f"weights-{run_dir.name}"),
                },
            },
        },
        "data": {"train_files": [str(model_dir / "train.jsonl")], "max_prompt_length": PROMPT_TOKENS},
        # rank 0 evaluates alone at the end while the others wait to save the last checkpoint
        "eval": {
            "at_start": False,
            "at_end": True,
            "data": {"train_files": [str(model_dir / "eval.jsonl")]},
            "num_prompts": 4,
            "k": 2,
        },
        "reward": {
            "num_workers": 1,
            "function": "tests.recipe.test_cluster_time_scales:parity_reward",
            "overlong_penalty": False,
            "overlong_filter": False,
        },
        "checkpoint": {"every": 0, "keep_last": 1},
        "logging": {"run_dir": str(run_dir), "console": "plain", "tensorboard": False},
    }
    path = root / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _line_up(rank, world, store_port):
    """Return once every rank got here: a scaled-down collective timeout also bounds the rendezvous,
    and spawned ranks finish their imports seconds apart on a loaded machine."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", store_port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    store.add("arrived", 1)
    while store.add("arrived", 0) < world:
        time.sleep(0.01)
    return store


def _two_runs(rank, world, store_port, paths):
    """Both runs in the same four processes (one spawn), one after the other; then the control: the
    same wait for rank 0 alone in the training group times out. Returns whether it did here."""
    import torch.distributed as dist

    from megatron_zcpo.recipe.config import load_run_config
    from megatron_zcpo.recipe.training import run_training

    store = _line_up(rank, world, store_port)  # noqa: F841 - rank 0 serves it until the runs end
    for path in paths:
        run_training(load_run_config(str(path)))
    if rank == 0:
        time.sleep(COLLECTIVE_TIMEOUT_S + 2)  # rank 0 alone, as in a rollout
    try:
        dist.broadcast_object_list([None], src=0)  # the default group: parallel.collective_timeout_s
    except RuntimeError:
        return True
    return False


def _servers(model_dir, delay):
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.rollout.embedded import EmbeddedEngine

    model = model_config_from_hf(read_hf_config(str(model_dir)))
    servers = [
        MockSGLangServer(
            EmbeddedEngine(model, seed=index),
            deterministic_inference=True,
            api_key=API_KEY,
            context_length=required_context_length(PROMPT_TOKENS, NEW_TOKENS),
            generate_delay_s=delay,
        )
        for index in range(2)
    ]
    for server in servers:
        server.start()
    router = MockSGLangRouter(
        [server.url for server in servers], request_timeout_secs=ROUTER_TIMEOUT_S, api_key=API_KEY
    )
    router.start()
    return servers, router


def _logged(run_dir):
    """The trained steps' metrics {step: metrics} and the evaluations' [metrics] of a run (without its run
    id: each run has its own)."""
    records = [
        {k: v for k, v in json.loads(line).items() if k != "run_id"}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: r for r in records if "rollout/reward_mean" in r}, [r for r in records if "eval/avg@2" in r]


def test_a_rollout_longer_than_every_timeout_trains_like_instant_servers(tmp_path, tiny_model):
    instant, instant_router = _servers(tiny_model, 0.0)
    slow, slow_router = _servers(tiny_model, GENERATE_S)
    paths = [
        _config(tmp_path, tiny_model, [s.url for s in servers], router.url, tmp_path / name)
        for name, servers, router in (("instant", instant, instant_router), ("slow", slow, slow_router))
    ]
    try:
        timed_out = run_distributed(_two_runs, 4, free_port(), paths, timeout=600, env={"ZCPO_SGLANG_API_KEY": API_KEY})
    finally:
        for server in (*instant, *slow, instant_router, slow_router):
            server.stop()
    (fast_steps, fast_eval), (slow_steps, slow_eval) = _logged(tmp_path / "instant"), _logged(tmp_path / "slow")
    assert sorted(fast_steps) == sorted(slow_steps) == [1, 2]
    assert len(slow_eval) == 1 and {k: v for k, v in slow_eval[0].items() if k != "time"} == {
        k: v for k, v in fast_eval[0].items() if k != "time"
    }
    for step in (1, 2):
        # The scaled rollout outlasted the process groups' and the router's timeouts ...
        assert slow_steps[step]["time/rollout"] > max(COLLECTIVE_TIMEOUT_S, ROUTER_TIMEOUT_S)
        # ... and trained exactly what instant servers gave.
        keys = [k for k in fast_steps[step] if not k.startswith("time") and k != "train/tokens_per_s"]
        assert {"rollout/reward_mean", "experience/kl", "update/grad_norm"} <= set(keys)
        assert fast_steps[step]["update/grad_norm"] > 0  # the steps trained: step 2 sampled other weights
        assert {k: slow_steps[step][k] for k in keys} == {k: fast_steps[step][k] for k in keys}
    for server in slow:  # every request carried the key; none was cut, refused or retried
        assert {detail for path, detail in server.events} == {"ok"}
    assert {detail for _, detail in slow_router.events} == {"ok"}
    assert timed_out[1:] == [True] * 3  # the control: waiting in a training group instead does not survive
