"""Benchmark the trainer's per-micro-batch bookkeeping: THD collation and the packed attention around SDPA.

Two pure-overhead parts of a small training step (issue 15), one process, one thread:
  collate    collate_packed of ``--samples`` samples of ~30 tokens (prompts 8-16, responses 8-24),
             token ids as Python lists, with rollout log-probs; CP=1 and CP=2 (rank 0).
  attention  PackedCausalAttention forward + backward, ``--layers`` calls sharing one fresh
             PackedSeqParams (one micro-batch through that many layers), over a packed
             [``--tokens``, 4 heads, 32] batch of ``--sequences`` sequences of 0.5-1.5x the mean length.
Median CPU milliseconds per micro-batch over ``--repeat`` runs. ``--compare PATH`` runs the same
measurement in a subprocess with PATH (another checkout, e.g. main) first on PYTHONPATH and
prints both side by side with the ratio.

    python benchmarks/bench_step_overhead.py
    python benchmarks/bench_step_overhead.py --compare /path/to/main/checkout
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time


def _median_ms(run, repeat: int) -> float:
    """Median CPU milliseconds of ``run()`` (CPU time: steadier than wall time on a shared machine)."""
    run()  # warm-up
    times = []
    for _ in range(repeat):
        started = time.process_time()
        run()
        times.append(time.process_time() - started)
    return 1000 * statistics.median(times)


def time_collate(samples: int, repeat: int, cp_size: int) -> float:
    """Median ms of one collate_packed of ``samples`` ~30-token samples on CP rank 0."""
    from megatron_zcpo.training.batch import RolloutSample, collate_packed

    rng = random.Random(0)
    rollout = []
    for index in range(samples):
        response = [rng.randrange(1000) for _ in range(rng.randint(8, 24))]
        rollout.append(
            RolloutSample(
                [rng.randrange(1000) for _ in range(rng.randint(8, 16))],
                response,
                group_id=index // 8,
                reward=0.0,
                rollout_logprobs=[-rng.random() for _ in response],
            )
        )
    indices = list(range(samples))
    return _median_ms(lambda: collate_packed(rollout, indices, 0, cp_size), repeat)


def _single_process_groups():
    import torch.distributed as dist

    if not dist.is_initialized():  # an in-memory store: no port to share with the --compare subprocess
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from megatron.core.process_groups_config import ProcessGroupCollection

    group = dist.new_group([0])
    return ProcessGroupCollection(tp=group, cp=group)


def time_attention(
    tokens: int, sequences: int, layers: int, repeat: int, heads: int = 4, head_dim: int = 32, plan_only: bool = False
) -> float:
    """Median ms of ``layers`` PackedCausalAttention forward calls on one fresh PackedSeqParams, plus the
    backward; ``plan_only``: of planning that micro-batch's attention layout alone."""
    import torch
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.enums import AttnMaskType, AttnType

    from megatron_zcpo.megatron.attention import PackedCausalAttention

    config = TransformerConfig(
        num_layers=layers,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    modules = [
        PackedCausalAttention(
            config, n + 1, AttnMaskType.causal, AttnType.self_attn, pg_collection=_single_process_groups()
        )
        for n in range(layers)
    ]
    rng = random.Random(0)
    mean = tokens // sequences  # lengths within a factor 1.5 of the mean; the last one takes the rest
    lengths = [rng.randint(mean // 2, mean + mean // 2) for _ in range(sequences - 1)]
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths), tokens], dtype=torch.int32)
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, heads, head_dim, generator=generator).requires_grad_() for _ in range(3))

    if plan_only:  # what every call paid before the plan was kept per micro-batch
        from megatron_zcpo.megatron.attention import attention_plan

        return _median_ms(lambda: attention_plan(cu_seqlens.clone(), 0, 1, q.device), repeat)

    def step():
        params = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu_seqlens.clone(),
            cu_seqlens_kv=cu_seqlens.clone(),
            max_seqlen_q=int(cu_seqlens.diff().max()),
            max_seqlen_kv=int(cu_seqlens.diff().max()),
        )
        total = sum(m(q, k, v, None, packed_seq_params=params).sum() for m in modules)
        total.backward()

    return _median_ms(step, repeat)


def measure(args) -> dict:
    """{case: median ms} for this checkout."""
    import torch

    torch.set_num_threads(1)
    cases = {
        f"collate_packed {args.samples} samples CP1": time_collate(args.samples, args.repeat, 1),
        f"collate_packed {args.samples} samples CP2": time_collate(args.samples, args.repeat, 2),
        f"attention fwd+bwd {args.layers} layers, {args.sequences} seqs / {args.tokens} tokens": time_attention(
            args.tokens, args.sequences, args.layers, args.repeat
        ),
    }
    import megatron_zcpo.megatron.attention as attention

    if hasattr(attention, "attention_plan"):  # checkouts that plan once per micro-batch
        cases[f"attention plan alone, {args.sequences} seqs / {args.tokens} tokens"] = time_attention(
            args.tokens, args.sequences, args.layers, args.repeat, plan_only=True
        )
    return cases


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--sequences", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--compare", help="another checkout to time the same cases in (its package first on PYTHONPATH)"
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the --compare subprocess's output
    args = parser.parse_args(argv)
    ours = measure(args)
    if args.json:
        print(json.dumps(ours))
        return
    if not args.compare:
        for case, ms in ours.items():
            print(f"{case:55s} {ms:9.2f} CPU ms")
        return
    command = [sys.executable, os.path.abspath(__file__), "--json"] + [
        f"--{name}={getattr(args, name)}" for name in ("samples", "tokens", "sequences", "layers", "repeat")
    ]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([args.compare, os.environ.get("PYTHONPATH", "")]))
    theirs = json.loads(
        subprocess.run(command, env=environment, check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    print(f"{'case':55s} {'compared CPU ms':>15s} {'this CPU ms':>11s} {'ratio':>7s}")
    for case, ms in ours.items():
        if case in theirs:
            print(f"{case:55s} {theirs[case]:15.2f} {ms:11.2f} {theirs[case] / ms:6.2f}x")
        else:
            print(f"{case:55s} {'-':>15s} {ms:11.2f}")


if __name__ == "__main__":
    main()
