"""GPU acceptance check: what the CPU suite cannot see, on one GPU in at most about 10 minutes.

    python tools/gpu_check.py [--size small|tiny] [--out DIR]        (or: make gpu-check)

On one GPU (an H200 with the repository image's stack: NGC PyTorch, Transformer Engine,
megatron-core): a random Qwen2-style model in Hugging Face format is converted to a Megatron
checkpoint; it is built with the Transformer Engine layer spec; its log-probs from the experience
pass in bf16 at TP1 (sequence parallelism off) are compared with Hugging Face transformers in fp32
on the CPU; two bf16 training steps run (finite loss and gradient norm, parameters move);
``benchmarks/bench_token_stats.py --gpu`` checks the token statistics' Triton kernels against the
torch backend and float64 on the GPU and times them beside the peer against the HBM and bf16 rooflines; the converted checkpoint is ``--verify``-ed under
the TE spec; the memory planner's predicted peak is printed beside the measured one; and ``zcpo
train`` runs end to end on the GPU (a tiny random Qwen2 with its own tokenizer, the embedded rollout
engine, bf16, a checkpoint per step), once straight and once stopped after step 1 and resumed. One
table at the end; exit status 0 when every check passed, 1 when one failed.

Without a GPU the CPU-checkable parts run (the same model and conversion, the CPU reference, the
experience pass and two fp32 steps on the local layer spec, ``--verify`` on the CPU, the planner's
prediction), the GPU-only checks are listed as skipped, and the exit status is 3
(:data:`EXIT_NO_GPU`) with a line starting ``no GPU: skipped``.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
GIB = 2**30
H200_MEMORY_GIB = 141.0  # planner capacity when no device can be asked

# Max abs log-prob / logit differences accepted against the fp32 CPU reference. bf16 keeps 8
# mantissa bits (relative 4e-3 per rounding), and the activations of these models are O(1).
LOGPROB_TOLERANCE = {"bf16": 5e-2, "fp32": 1e-3}
VERIFY_TOLERANCE = {"gpu": 2e-2, "cpu": 1e-3}  # fp32 weights; GPU GEMMs sum in another order

MODEL_SIZES = {  # (vocab, hidden, ffn, layers, heads, kv heads)
    "tiny": (512, 64, 128, 2, 4, 2),
    "small": (32000, 1024, 2816, 8, 16, 4),  # ~123M parameters: weights dominate the GPU peak
}


@dataclasses.dataclass
class CheckRow:
    """One line of the final table."""

    check: str
    status: str  # "ok", "FAILED" or "skipped"
    measured: str = ""
    expected: str = ""
    seconds: float = 0.0


def model_config(size: str):
    """The :class:`ModelConfig` of a named size (untied output layer, Qwen2 with QKV bias)."""
    from megatron_zcpo.megatron.model import ModelConfig

    vocab, hidden, ffn, layers, heads, kv = MODEL_SIZES[size]
    return ModelConfig(
        family="qwen2",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )


def write_random_hf_model(directory: Path, model, seed: int = 0) -> None:
    """A randomly initialised Hugging Face model of ``model``'s architecture, saved in ``directory``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_zcpo.convert.mapping import hf_config_from_model_config

    config = hf_config_from_model_config(model)
    hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(hf_config).float().save_pretrained(directory)


def rollout(model, seed: int = 0, groups: int = 4, group_size: int = 4) -> List:
    """Synthetic samples: groups of ``group_size`` responses with mixed +-1 rewards."""
    from megatron_zcpo.training.batch import RolloutSample

    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(model.vocab_size) for _ in range(rng.randint(8, 24))]
        for member in range(group_size):
            response = [rng.randrange(model.vocab_size) for _ in range(rng.randint(16, 64))]
            samples.append(RolloutSample(prompt, response, group_id=group, reward=1.0 if member % 2 else -1.0))
    return samples


@torch.no_grad()
def reference_logprobs(hf_dir: Path, samples) -> List[torch.Tensor]:
    """log pi(response token) per sample from Hugging Face transformers in fp32 on the CPU."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").float().eval()
    result = []
    for sample in samples:
        tokens = torch.tensor([sample.prompt_ids + sample.response_ids])
        logprobs = torch.log_softmax(hf(input_ids=tokens).logits[0].float(), dim=-1)
        start = len(sample.prompt_ids)
        positions = torch.arange(start - 1, tokens.shape[1] - 1)
        result.append(logprobs[positions, tokens[0, start:]])
    return result


def _train_on_rank(rank, world_size, ckpt_dir, model, samples, bf16):
    """Experience log-probs, then two training steps, in one process (NCCL on a GPU, else gloo)."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import have_transformer_engine
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer
    from megatron_zcpo.utils.devices import has_cuda

    setup_megatron(seed=1)
    on_gpu = has_cuda()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    train = TrainConfig(
        steps=2, bf16=bf16, micro_batch_tokens=1024, optimizer=OptimizerSettings(lr=1e-4, warmup_steps=0)
    )
    trainer = PolicyTrainer(
        model,
        AlgorithmConfig(name="zcpo"),
        train,
        ParallelConfig(sequence_parallel=False),
        initial_weights=str(ckpt_dir),
    )
    te_modules = sorted({type(m).__name__ for m in trainer.policy.modules() if type(m).__name__.startswith("TE")})
    experience = trainer.experience(samples, trainer.assign_minibatches(samples))
    before = {name: tensor.float().clone() for name, tensor in trainer.global_state_dict().items()}
    metrics = [trainer.train_step(samples), trainer.train_step(rollout(model, seed=1))]
    after = trainer.global_state_dict()
    moved = max((after[name].float() - before[name]).abs().max().item() for name in before)
    return {
        "logprobs": [experience[i].old_logprob for i in range(len(samples))],
        "metrics": metrics,
        "moved": moved,
        "te_modules": te_modules,
        "use_te": have_transformer_engine(),
        "peak_bytes": torch.cuda.max_memory_allocated() if on_gpu else None,
        "device": torch.cuda.get_device_name() if on_gpu else "cpu",
        "micro_batch_tokens": train.micro_batch_tokens,
        "kl_chunk_size": train.kl_chunk_size,
    }


def predicted_peak(model, samples, trained: dict, capacity_gib: float):
    """The planner's :class:`MemoryPlan` for the run :func:`_train_on_rank` made (TP1, one GPU)."""
    from megatron_zcpo.planning.planner import Hardware, Layout, Workload, plan_memory

    layout = Layout(sequence_parallel=False, distributed_optimizer=False, recompute="none")
    workload = Workload(
        micro_batch_tokens=trained["micro_batch_tokens"],
        max_sequence_length=max(s.sequence_length for s in samples),
        kl_chunk_tokens=trained["kl_chunk_size"],
    )
    return plan_memory(model, layout, workload, Hardware(gpu_memory_gib=capacity_gib))


class GpuCheck:
    """Runs the checks in order, each timed, and collects the table rows."""

    def __init__(self, out: Path, size: str, on_gpu: bool):
        self.out, self.on_gpu = out, on_gpu
        self.model = model_config(size)
        self.rows: List[CheckRow] = []
        self.hf_dir, self.ckpt_dir = out / "hf", out / "megatron"
        self.samples = rollout(self.model)

    def run(self, name: str, body: Callable[[], CheckRow]) -> Optional[CheckRow]:
        """Time ``body``; an exception becomes a FAILED row naming it."""
        started = time.perf_counter()
        try:
            row = body()
        except Exception as error:  # one broken check must not hide the others
            row = CheckRow(name, "FAILED", f"{type(error).__name__}: {error}"[:300])
        row.seconds = time.perf_counter() - started
        self.rows.append(row)
        print(f"[gpu_check] {row.check}: {row.status} {row.measured}", flush=True)
        return row

    def skip(self, name: str, why: str) -> None:
        """Record a check that needs a GPU."""
        self.rows.append(CheckRow(name, "skipped", why))

    def convert(self) -> CheckRow:
        """HF random model -> Megatron checkpoint (the conversion tool's code, one process)."""
        from megatron_zcpo.testing import run_distributed

        write_random_hf_model(self.hf_dir, self.model)
        run_distributed(_convert_on_rank, 1, str(self.hf_dir), str(self.ckpt_dir), timeout=600)
        params = self.model.num_parameters
        return CheckRow("convert HF -> Megatron", "ok", f"{params / 1e6:.1f}M parameters", "a torch_dist checkpoint")

    def train(self) -> CheckRow:
        """Experience log-probs vs the CPU reference, then two steps; keeps the run for the planner row."""
        from megatron_zcpo.testing import run_distributed

        precision = "bf16" if self.on_gpu else "fp32"
        reference = reference_logprobs(self.hf_dir, self.samples)
        self.trained = run_distributed(
            _train_on_rank, 1, str(self.ckpt_dir), self.model, self.samples, self.on_gpu, timeout=600
        )[0]
        difference = max(
            (ours.float() - ref).abs().max().item() for ours, ref in zip(self.trained["logprobs"], reference)
        )
        tolerance = LOGPROB_TOLERANCE[precision]
        metrics = self.trained["metrics"]
        finite = all(torch.isfinite(torch.tensor(m["update/grad_norm"])) for m in metrics)
        ok = difference <= tolerance and finite and self.trained["moved"] > 0
        layer = "TE spec" if self.trained["use_te"] else "local spec"
        return CheckRow(
            f"log-probs + 2 steps, {precision} TP1 ({layer})",
            "ok" if ok else "FAILED",
            f"max |dlogp| {difference:.2e}; grad norms "
            + ", ".join(f"{m['update/grad_norm']:.3g}" for m in metrics)
            + f"; max |dparam| {self.trained['moved']:.1e}",
            f"<= {tolerance:g} vs HF fp32 CPU; finite; params move",
        )

    def te_spec(self) -> CheckRow:
        """The model the training run built used Transformer Engine modules."""
        modules = self.trained["te_modules"]
        ok = self.trained["use_te"] and bool(modules)
        found = ", ".join(modules) or (
            "no TE modules" if self.trained["use_te"] else "Transformer Engine is not installed"
        )
        return CheckRow(
            "TE layer spec model", "ok" if ok else "FAILED", found, f"TE modules on {self.trained['device']}"
        )

    def verify(self) -> CheckRow:
        """``--verify``: the checkpoint's logits in Megatron (TE spec on a GPU) vs transformers."""
        from megatron_zcpo.convert.verify import max_logit_difference, sample_tokens

        tokens = sample_tokens(self.hf_dir, self.model)
        difference = max_logit_difference(self.ckpt_dir, self.hf_dir, tokens)
        tolerance = VERIFY_TOLERANCE["gpu" if self.on_gpu else "cpu"]
        from megatron_zcpo.megatron.model import have_transformer_engine

        spec = "TE spec" if self.on_gpu and have_transformer_engine() else "local spec"
        return CheckRow(
            f"--verify converted model ({spec})",
            "ok" if difference <= tolerance else "FAILED",
            f"max |dlogit| {difference:.2e}",
            f"<= {tolerance:g}",
        )

    def bench(self) -> CheckRow:
        """``bench_token_stats.py --gpu``: the Triton kernels checked on the GPU, then timed against the peer."""
        result = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench_token_stats.py"), "--gpu"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=420,
        )
        print(result.stdout + result.stderr, flush=True)
        return CheckRow(
            "bench_token_stats --gpu",
            "ok" if bench_passed(result) else "FAILED",
            bench_summary(result.stdout),
            "exit 0: every check PASS, targets met (stats <= 1.5 ms, update <= 31 ms on an H200)",
        )

    def train_end_to_end(self) -> CheckRow:
        """``zcpo train`` for 2 steps; a second run stopped after step 1 and resumed must repeat step 2."""
        straight, resumed = write_train_runs(self.out / "e2e", ("straight", "resumed"), bf16=self.on_gpu)
        runs = [_zcpo_train(straight), _zcpo_train(resumed, "train.steps=1"), _zcpo_train(resumed)]
        codes = [run.returncode for run in runs]
        # The engine (HF, fp32) and the trainer must agree within the precision's tolerance at step 0.
        engine_gap_warned = any(
            "warning: the embedded engine's log-probs differ" in run.stdout + run.stderr for run in runs
        )
        expected, got = _trained_steps(straight.parent / "run"), _trained_steps(resumed.parent / "run")
        if codes != [0, 0, 0] or sorted(expected) != [1, 2] or sorted(got) != [1, 2]:
            return CheckRow(
                "zcpo train + resume",
                "FAILED",
                f"exit codes {codes}; steps {sorted(expected)}, {sorted(got)}",
                "exit 0; steps [1, 2]",
            )
        keys = ("rollout/reward_mean", "rollout/response_length_mean", "update/grad_norm")
        finite = all(torch.isfinite(torch.tensor(float(r.get(k, 0.0)))) for r in expected.values() for k in keys)
        same_samples = all(got[2][k] == expected[2][k] for k in keys[:2])
        gap = max(abs(float(got[2].get(k, 0.0)) - float(expected[2].get(k, 0.0))) for k in keys)
        step_s = expected[2].get("time/step", float("nan"))
        engine_gap = max(float(r.get("rollout/logprob_diff_max", 0.0)) for r in expected.values())
        ok = finite and same_samples and not engine_gap_warned
        return CheckRow(
            "zcpo train + resume",
            "ok" if ok else "FAILED",
            f"step 2 s {step_s:.2f}; engine vs trainer max |dlogp| {engine_gap:.1e}"
            f"{' (warned)' if engine_gap_warned else ''}; resumed vs straight step 2: max |d| {gap:.1e} "
            f"over {', '.join(keys)}",
            "exit 0; finite; no engine/trainer gap warning; resumed step 2 draws the same samples",
        )

    def memory(self) -> CheckRow:
        """The planner's predicted peak beside the measured ``max_memory_allocated`` of the run."""
        capacity = torch.cuda.get_device_properties(0).total_memory / GIB if self.on_gpu else H200_MEMORY_GIB
        plan = predicted_peak(self.model, self.samples, self.trained, capacity)
        without_overhead = plan.total_bytes - plan.components["overhead"]
        predicted = f"predicted {without_overhead / GIB:.3f} GiB (+ overhead {plan.components['overhead'] / GIB:.1f})"
        measured = self.trained["peak_bytes"]
        if measured is None:
            return CheckRow("planner peak memory", "ok", predicted, "measured: no GPU")
        return CheckRow(
            "planner peak memory",
            "ok",
            f"measured {measured / GIB:.3f} GiB; {predicted}",
            f"ratio measured/predicted {measured / without_overhead:.2f}",
        )


def bench_passed(result: subprocess.CompletedProcess) -> bool:
    """The benchmark exited 0 and printed its PASS summary (every check passed, every target met)."""
    return result.returncode == 0 and "# token-stats GPU bench: PASS" in result.stdout


def bench_summary(stdout: str) -> str:
    """ "table: ours ms (x peer)" for each table of the benchmark's output, and the checks passed."""
    parts, table = [], None
    for line in stdout.splitlines():
        header = re.match(r"# (stats|update|experience) (\d+ x [\d x]+)", line)
        if header:
            table = f"{header.group(1)} {header.group(2).split(':')[0].strip()}"
        timed = re.match(r"\s+ours \(triton\)(, logprob)?\s+([\d.]+) ms .* x peer\s+([\d.]+)", line)
        if table and timed:
            parts.append(f"{table}: {float(timed.group(2)):.2f} ms ({timed.group(3)}x peer)")
            table = None
    checks = re.findall(r"check .* (PASS|FAIL) ", stdout)
    return "; ".join(parts + [f"checks {checks.count('PASS')}/{len(checks)} pass"])


def addition_rows(count: int, seed: int) -> List[Dict[str, str]]:
    """``count`` two-digit addition prompts with their answers (no reasoning-gym: the GPU image lacks it)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        rows.append({"prompt": f"{a} + {b} = ? Put the final answer in \\boxed{{}}.", "answer": str(a + b)})
    return rows


def write_train_runs(directory: Path, names, bf16: bool) -> List[Path]:
    """A tiny random Qwen2 with a BPE tokenizer trained on its prompts and the prompt files, once, in
    ``directory``; then a ``zcpo train`` config per name (TP1, embedded engine, a checkpoint per step,
    run directory ``directory/name/run``); returns the configs' paths."""
    import json

    import yaml
    from transformers import Qwen2ForCausalLM

    from megatron_zcpo.data.records import PromptRecord
    from megatron_zcpo.recipe.demo_assets import DemoSpec, _hf_config, train_tokenizer

    model_dir = directory / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    rows = {"train": addition_rows(256, seed=0), "eval": addition_rows(32, seed=1)}
    records = [
        PromptRecord(uid=str(i), messages=[{"role": "user", "content": row["prompt"]}], answer=row["answer"])
        for i, row in enumerate(rows["train"] + rows["eval"])
    ]
    spec = DemoSpec(vocab_size=300)
    tokenizer = train_tokenizer(spec, records)
    torch.manual_seed(0)
    Qwen2ForCausalLM(_hf_config(spec, tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    for split, split_rows in rows.items():
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in split_rows))
    config = {
        "model": {"path": str(model_dir)},
        "parallel": {"tensor": 1},
        "train": {
            "steps": 2,
            "bf16": bf16,
            "mini_batches": 2,
            "micro_batch_tokens": 1024,
            "optimizer": {"lr": 1e-4, "warmup_steps": 0},
        },
        "algorithm": {"name": "zcpo", "beta": 1.0},
        "rollout": {
            "prompts_per_step": 8,
            "samples_per_prompt": 4,
            "max_new_tokens": 8,
            "dynamic_sampling": {"drop_tied_groups": False},
        },
        "data": {"train_files": [str(directory / "train.jsonl")], "max_prompt_length": 64},  # 128 positions
        "eval": {
            "data": {"train_files": [str(directory / "eval.jsonl")]},
            "num_prompts": 8,
            "k": 2,
            "at_start": False,
            "at_end": False,
        },
        "reward": {"num_workers": 1},
        "checkpoint": {"every": 1, "keep_last": 2},
        "logging": {"console": "plain", "tensorboard": False},
    }
    paths = []
    for name in names:
        (directory / name).mkdir(exist_ok=True)
        config["logging"]["run_dir"] = str(directory / name / "run")
        paths.append(directory / name / "config.yaml")
        paths[-1].write_text(yaml.safe_dump(config))
    return paths


def _zcpo_train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    """``zcpo train config overrides`` in a child process (its output is echoed)."""
    done = subprocess.run(
        [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(config), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=420,
    )
    print(done.stdout[-4000:] + done.stderr[-4000:], flush=True)
    return done


def _trained_steps(run_dir: Path) -> Dict[int, dict]:
    """{step: metrics} of the trained steps of a run's metrics.jsonl."""
    import json

    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    records = [json.loads(line) for line in lines]
    return {r["step"]: r for r in records if "rollout/reward_mean" in r}


def _convert_on_rank(rank, world_size, hf_dir, ckpt_dir):
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron
    from megatron_zcpo.megatron.initialize import setup_megatron

    setup_megatron()
    convert_hf_to_megatron(hf_dir, ckpt_dir)


GPU_ONLY = ("TE layer spec model", "bf16 training on the GPU", "bench_token_stats --gpu", "measured peak memory")


def render(rows: List[CheckRow]) -> str:
    """The final table, one row per check."""
    header = ("check", "status", "measured", "expected", "s")
    cells = [header] + [(r.check, r.status, r.measured, r.expected, f"{r.seconds:.0f}") for r in rows]
    widths = [max(len(str(row[i])) for row in cells) for i in range(len(header))]
    return "\n".join(" | ".join(str(value).ljust(width) for value, width in zip(row, widths)) for row in cells)


def run_checks(out: Path, size: str, on_gpu: bool) -> List[CheckRow]:
    """Every check this machine can run, in order (later ones need the earlier ones' results)."""
    check = GpuCheck(out, size, on_gpu)
    if on_gpu:  # first, on a GPU no other check has warmed or fragmented: its targets are asserted
        check.run("bench_token_stats --gpu", check.bench)
    if check.run("convert HF -> Megatron", check.convert).status != "ok":
        return check.rows
    if check.run("log-probs + 2 steps", check.train).status == "ok" or hasattr(check, "trained"):
        if on_gpu:
            check.run("TE layer spec model", check.te_spec)
        check.run("planner peak memory", check.memory)
    check.run("--verify", check.verify)
    check.run("zcpo train + resume", check.train_end_to_end)
    if not on_gpu:
        for name in GPU_ONLY:
            check.skip(name, "no GPU")
    return check.rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", choices=sorted(MODEL_SIZES), help="model size (default: small on a GPU, tiny without)"
    )
    parser.add_argument("--out", help="working directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from megatron_zcpo.utils.devices import has_cuda

    on_gpu = has_cuda()
    size = args.size or ("small" if on_gpu else "tiny")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as scratch:
        rows = run_checks(Path(args.out or scratch), size, on_gpu)
    print(f"\n# gpu_check: model {size}, {time.perf_counter() - started:.0f} s\n" + render(rows))
    if any(row.status == "FAILED" for row in rows):
        return EXIT_FAILED
    if not on_gpu:
        print("no GPU: skipped " + ", ".join(row.check for row in rows if row.status == "skipped"))
        return EXIT_NO_GPU
    return EXIT_OK


if __name__ == "__main__":  # dist_checkpointing's writer re-imports __main__ in a spawned process
    sys.exit(main())
