"""Benchmark overlapped rollouts and the per-stage weight push.

Part 1 (``--part overlap``): ``zcpo train`` on the tiny demo model against the mock SGLang server
(megatron_zcpo/testing/mock_server.py), whose generation time is emulated from a tokens/s figure:
each /generate answer is held until its tokens would have been decoded at ``--tokens-per-s`` (the
server decodes one request at a time), so rollout time scales like a real server's. One run with
``rollout.overlap=false`` (on-policy), one with ``true``; reported per step (the first excluded):
step time, trainer wait for data, engine busy share and the idle share of the two "GPUs" (the
training process and the emulated server).

Part 2 (``--part push``): the weight push of a larger random model at PP1 and PP2 (gloo) to the
mock server: time, bytes rank 0 sends to the server and bytes rank 0 receives from the other
stage, for the funnel (every stage through rank 0: the old way, still used for the embedded
engine) and the per-stage push.

    python benchmarks/bench_overlap.py --part overlap --steps 6 --tokens-per-s 400
    python benchmarks/bench_overlap.py --part push --layers 8 --hidden 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import types
from pathlib import Path

from megatron_zcpo.rollout.engine import RolloutEngine


class PacedEngine(RolloutEngine):
    """``inner``'s answers, released no faster than ``tokens_per_s`` generated tokens per second."""

    def __init__(self, inner: RolloutEngine, tokens_per_s: float):
        self.inner, self.tokens_per_s = inner, tokens_per_s
        self.busy_s, self.lock = 0.0, threading.Lock()

    def generate(self, prompts, params, n=1):
        started = time.perf_counter()
        result = self.inner.generate(prompts, params, n)
        tokens = sum(len(c.output_ids) for group in result for c in group)
        time.sleep(max(0.0, tokens / self.tokens_per_s - (time.perf_counter() - started)))
        with self.lock:
            self.busy_s += time.perf_counter() - started
        return result

    def update_weights(self, named_hf_tensors, version):
        self.inner.update_weights(named_hf_tensors, version)

    def weight_version(self):
        return self.inner.weight_version()

    def shutdown(self):
        self.inner.shutdown()


class UniformEngine(RolloutEngine):
    """Answers without a model: ``max_new_tokens`` uniform random tokens per sample, so the CPU
    that also trains is not spent generating; the pacing alone sets the rollout time."""

    def __init__(self, vocab_size: int, seed: int = 0):
        import torch

        self.vocab_size, self.version = vocab_size, -1
        self.generator = torch.Generator().manual_seed(seed)

    def generate(self, prompts, params, n=1):
        import math

        import torch

        from megatron_zcpo.rollout.engine import Completion

        logprob = -math.log(self.vocab_size)
        return [
            [
                Completion(
                    list(prompt),
                    torch.randint(self.vocab_size, (params.max_new_tokens,), generator=self.generator).tolist(),
                    [logprob] * params.max_new_tokens,
                    "length",
                    weight_version=self.version,
                )
                for _ in range(n)
            ]
            for prompt in prompts
        ]

    def update_weights(self, named_hf_tensors, version):
        for _ in named_hf_tensors:
            pass
        self.version = int(version)

    def weight_version(self):
        return self.version

    def shutdown(self):
        pass


class DiscardingEngine(RolloutEngine):
    """A server backend that receives pushed weights and drops them (push timing only)."""

    def generate(self, prompts, params, n=1):
        raise NotImplementedError("push benchmark only")

    def update_weights(self, named_hf_tensors, version):
        for _ in named_hf_tensors:
            pass

    def weight_version(self):
        return 0

    def shutdown(self):
        pass


# ----------------------------------------------------------------------------- part 1: overlap


def run_overlap(args) -> list:
    """Two `zcpo train` runs (overlap off / on) against one paced mock server; per-mode rows."""
    from megatron_zcpo.cli.demo import demo_config
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.megatron.initialize import free_port
    from megatron_zcpo.recipe.demo_assets import DemoSpec, build_demo_assets
    from megatron_zcpo.testing.mock_server import MockSGLangServer

    root = Path(tempfile.mkdtemp(prefix="bench_overlap_"))
    assets = build_demo_assets(DemoSpec(size=300, sft_max_steps=1), cache_dir=root / "cache", log=lambda _: None)
    rows = []
    for overlap in (False, True):
        vocab = model_config_from_hf(read_hf_config(assets)).vocab_size
        backend = PacedEngine(UniformEngine(vocab), args.tokens_per_s)
        with MockSGLangServer(backend, port=free_port()) as server:
            run_dir = root / f"overlap-{overlap}"
            config = demo_config(
                assets,
                run_dir,
                {
                    "parallel": {"tensor": 1},
                    "rollout": {
                        "engine": "sglang",
                        "overlap": overlap,
                        "prompts_per_step": args.prompts,
                        "dynamic_sampling": {"drop_tied_groups": False},
                        "sglang": {
                            "server_urls": [server.url],
                            "client": {"group_backend": "gloo", "master_address": "127.0.0.1", "max_concurrency": 8},
                        },
                    },
                    "eval": {"at_start": False, "at_end": False},
                    # the uniform answers' log-probs are not the policy's: no mismatch correction
                    "train": {"importance_sampling": {"enabled": False}},
                    "logging": {"console": "quiet", "tensorboard": False},
                },
                steps=args.steps,
            )
            path = run_dir.with_suffix(".yaml")
            run_dir.mkdir(parents=True)
            path.write_text(json.dumps(config))
            env = dict(os.environ, OMP_NUM_THREADS="1")
            done = subprocess.run(
                [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(path)],
                capture_output=True,
                text=True,
                env=env,
            )
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "time/step" in r][1:]  # the first step has nothing to overlap
        wall = sum(r["time/step"] for r in steps)
        waits = sum(r.get("time/wait_for_data", r["time/rollout"]) for r in steps)
        pushes = sum(r["time/weight_sync"] for r in steps)
        train_busy = sum(r["time/step"] - r["time/rollout"] - (0 if overlap else r["time/weight_sync"]) for r in steps)
        engine_busy = backend.busy_s * len(steps) / (len(steps) + 1 + overlap)  # the run generated steps+1(+1) rollouts
        rows.append(
            {
                "mode": "overlapped" if overlap else "sequential",
                "step_s": wall / len(steps),
                "wait_for_data_s": waits / len(steps),
                "push_s": pushes / len(steps),
                "train_busy_share": train_busy / wall,
                "engine_busy_share": engine_busy / wall,
                "idle_share": 1 - (train_busy + engine_busy) / (2 * wall),
                "staleness_max": max(r.get("rollout/staleness_max", 0.0) for r in steps),
            }
        )
    return rows


# ----------------------------------------------------------------------------- part 2: push


def _push_worker(rank, world, pp, url, per_stage, model_config, bucket_bytes):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import is_stage_lead
    from megatron_zcpo.recipe.weight_push import StageWeightPush, push_weights
    from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig

    setup_megatron(pipeline_parallel=pp, seed=1)
    model = build_gpt_model(model_config, transformer_config(model_config, pipeline_parallel=pp))

    def engine(group):
        return SGLangEngine(
            SGLangEngineConfig(
                server_urls=[url],
                group_name=group,
                group_backend="gloo",
                master_address="127.0.0.1",
                bucket_bytes=bucket_bytes,
            )
        )

    stages = None
    if per_stage:
        stages = StageWeightPush(
            engine(f"bench-pp{ps.get_pipeline_model_parallel_rank()}") if is_stage_lead() else None
        )
    rank0_engine = engine("bench-rank0") if rank == 0 else None
    received = [0]
    recv = dist.recv

    def counted(tensor, *a, **k):
        received[0] += tensor.numel() * tensor.element_size()
        return recv(tensor, *a, **k)

    dist.recv = counted
    trainer = types.SimpleNamespace(policy=model, model_config=model_config)
    push_weights(trainer, rank0_engine, 1, stages)  # joins the update groups: not timed
    received[0] = 0
    dist.barrier()
    started = time.perf_counter()
    push_weights(trainer, rank0_engine, 2, stages)
    seconds = time.perf_counter() - started
    sender = stages.engine if stages is not None else rank0_engine
    result = {
        "seconds": seconds,
        "sent": sender.pushed["bytes"] / 2 if sender is not None else 0.0,
        "received": received[0],
    }  # pushed counts both pushes: the second one's share
    for handle in (stages.engine if stages is not None else None, rank0_engine):
        if handle is not None:
            handle.shutdown()
    return result


def run_push(args) -> list:
    """Push timings at PP1, PP2 funnel and PP2 per stage; per-case rows."""
    from megatron_zcpo.megatron.initialize import free_port
    from megatron_zcpo.megatron.model import ModelConfig
    from megatron_zcpo.testing import run_distributed
    from megatron_zcpo.testing.mock_server import MockSGLangServer

    model = ModelConfig(
        family="qwen2",
        vocab_size=32000,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
    )
    rows = []
    for pp, per_stage, name in ((1, False, "PP1"), (2, False, "PP2 funnel (rank 0)"), (2, True, "PP2 per stage")):
        with MockSGLangServer(DiscardingEngine(), port=free_port()) as server:
            results = run_distributed(
                _push_worker, pp, pp, server.url, per_stage, model, args.bucket_mib * 2**20, timeout=900
            )
        rows.append(
            {
                "case": name,
                "push_s": max(r["seconds"] for r in results),
                "rank0_sends_mib": results[0]["sent"] / 2**20,
                "rank0_receives_mib": results[0]["received"] / 2**20,
                "model_mib": 4 * model.num_parameters / 2**20,
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("overlap", "push", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--tokens-per-s", type=float, default=400.0, help="emulated server decode speed")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--bucket-mib", type=int, default=16)
    args = parser.parse_args()
    if args.part in ("overlap", "both"):
        rows = run_overlap(args)
        print(
            "| mode | step s | trainer waits for data s | push s | trainer busy | engine busy | idle share | max staleness |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['mode']} | {r['step_s']:.2f} | {r['wait_for_data_s']:.2f} | {r['push_s']:.3f} | "
                f"{r['train_busy_share']:.0%} | {r['engine_busy_share']:.0%} | {r['idle_share']:.0%} | {r['staleness_max']:.0f} |"
            )
        print(f"step time overlapped / sequential: {rows[1]['step_s'] / rows[0]['step_s']:.2f}")
    if args.part in ("push", "both"):
        rows = run_push(args)
        print("| case | push s | MiB rank 0 sends | MiB rank 0 receives from other stages | model MiB (fp32) |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['case']} | {r['push_s']:.2f} | {r['rank0_sends_mib']:.1f} | {r['rank0_receives_mib']:.1f} | {r['model_mib']:.1f} |"
            )


if __name__ == "__main__":
    main()
