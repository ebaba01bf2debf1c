"""GPU smoke test of the SGLang rollout path on one cluster node (needs sglang, sglang-router, CUDA).

    python tools/sglang_smoke.py --model-path /ckpt/Qwen2.5-0.5B-Instruct --tp-size 1 --num-servers 2 \
        [--weight-sync distributed|disk --weight-dir /shared/tmp] [--quantization fp8] [--router]

1. launches the servers (and the router) with megatron_zcpo's launcher and waits for health; runs
   the client's start-up check against the real servers (their /get_server_info: context length,
   deterministic inference, version) and checks that a request without the job's API key gets 401;
2. samples 256 prompts x 4 (random token ids) and reports tokens/s;
3. checks SGLang's log-probs against a teacher-forced Hugging Face forward on this node's last GPU;
4. pushes the checkpoint's own weights as version 1 (NCCL broadcast from the last GPU, or disk),
   checks the served version and that greedy outputs are unchanged, and reports the push time;
5. with ``--quantization fp8``: first exports an FP8 copy with nvidia-modelopt (calibrated on
   random tokens), serves it with ``--quantization modelopt_fp8`` and pushes FP8 weights; step 3
   then measures the rollout/trainer mismatch that importance sampling corrects.
Prints one JSON line of measurements last; exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request

import torch


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory (bf16)")
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--num-servers", type=int, default=1)
    parser.add_argument("--router", action="store_true")
    parser.add_argument("--weight-sync", choices=("distributed", "disk"), default="distributed")
    parser.add_argument("--weight-dir", default=None, help="directory for --weight-sync disk (default: a temp dir)")
    parser.add_argument("--quantization", choices=("fp8",), default=None)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--log-dir", default="sglang_smoke_logs")
    parser.add_argument(
        "--logprob-tolerance",
        type=float,
        default=0.05,
        help="max mean |SGLang - HF| log-prob (bf16 kernels differ); fp8 reports only",
    )
    return parser.parse_args(argv)


def _export_fp8(model_path: str, out_dir: str, device: str) -> str:
    """An FP8 (modelopt, per-tensor, calibrated) copy of ``model_path`` for --quantization modelopt_fp8."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16).to(device)
    calibration = torch.randint(0, model.config.vocab_size, (16, 256), device=device)
    mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop=lambda m: m(input_ids=calibration))
    export_hf_checkpoint(model, export_dir=out_dir)
    AutoTokenizer.from_pretrained(model_path).save_pretrained(out_dir)
    return out_dir


def _hf_logprob_gap(model_path: str, results, temperature: float, device: str) -> float:
    """Mean |SGLang log-prob - teacher-forced HF log-prob| over the sampled tokens of ``results``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.bfloat16).to(device).eval()
    gaps = []
    for samples in results[:16]:
        for completion in samples[:1]:
            sequence = torch.tensor([completion.prompt_ids + completion.output_ids], device=device)
            with torch.no_grad():
                logits = model(input_ids=sequence).logits[0, len(completion.prompt_ids) - 1 : -1].float()
            targets = torch.tensor(completion.output_ids, device=device)[:, None]
            expected = torch.log_softmax(logits / temperature, -1).gather(-1, targets)[:, 0]
            gaps.append((expected.cpu() - torch.tensor(completion.output_logprobs)).abs())
    del model
    torch.cuda.empty_cache()
    return torch.cat(gaps).mean().item()


def main(argv=None) -> int:
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint, read_hf_config
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.rollout.sglang.server import SGLangLauncher, SGLangServerConfig, launch_sglang

    args = _parse(argv)
    gpus = torch.cuda.device_count()
    if gpus < args.tp_size * args.num_servers + 1:
        raise SystemExit(
            f"need {args.tp_size * args.num_servers} GPUs for the servers plus one for the pusher, have {gpus}"
        )
    pusher = f"cuda:{gpus - 1}"  # the "trainer" side: HF reference forward and NCCL source
    torch.cuda.set_device(pusher)
    report = {
        "tp_size": args.tp_size,
        "num_servers": args.num_servers,
        "weight_sync": args.weight_sync,
        "quantization": args.quantization,
    }
    scratch = tempfile.mkdtemp(prefix="sglang_smoke_")
    served_path = args.model_path
    if args.quantization == "fp8":
        start = time.monotonic()
        served_path = _export_fp8(args.model_path, os.path.join(scratch, "fp8"), pusher)
        report["fp8_export_s"] = round(time.monotonic() - start, 1)
    config = SGLangServerConfig(
        model_path=served_path,
        tp_size=args.tp_size,
        num_servers=args.num_servers,
        nodes=["127.0.0.1"],
        gpus_per_node=gpus - 1,
        router=args.router,
        log_dir=args.log_dir,
        quantization="modelopt_fp8" if args.quantization == "fp8" else None,
    )
    start = time.monotonic()
    engine = launch_sglang(
        SGLangLauncher(config),
        weight_sync=args.weight_sync,
        weight_dir=args.weight_dir or scratch,
        master_address="127.0.0.1",
        quantization=args.quantization,
    )
    report["startup_s"] = round(time.monotonic() - start, 1)
    failures = []
    try:
        report["server_facts"] = [vars(fact) for fact in engine.check_servers(256, args.max_new_tokens)]
        unkeyed = urllib.request.Request(engine.config.server_urls[0] + "/get_server_info")
        try:
            urllib.request.urlopen(unkeyed, timeout=30)
            failures.append("a request without the API key was served")
        except urllib.error.HTTPError as error:
            report["status_without_key"] = error.code
        vocab = read_hf_config(args.model_path)["vocab_size"]
        gen = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(0, vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(16, 256, (args.prompts,), generator=gen)
        ]
        params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=args.max_new_tokens, seed=1)
        start = time.monotonic()
        results = engine.generate(prompts, params, n=args.samples)
        elapsed = time.monotonic() - start
        tokens = sum(len(c.output_ids) for samples in results for c in samples)
        report.update(rollout_tokens=tokens, rollout_s=round(elapsed, 2), tokens_per_s=round(tokens / elapsed))
        report["mean_abs_logprob_gap_vs_hf"] = _hf_logprob_gap(args.model_path, results, params.temperature, pusher)
        if args.quantization is None and report["mean_abs_logprob_gap_vs_hf"] > args.logprob_tolerance:
            failures.append("log-probs disagree with Hugging Face")

        greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
        before = [c.output_ids for [c] in engine.generate(prompts[:32], greedy)]
        with SafetensorsCheckpoint(args.model_path) as checkpoint:
            stream = ((name, checkpoint.tensor(name).to(pusher, torch.bfloat16)) for name in checkpoint.names())
            start = time.monotonic()
            engine.update_weights(stream, version=1)
            report["push_s"] = round(time.monotonic() - start, 2)
        report["served_version"] = engine.weight_version()
        after = [c.output_ids for [c] in engine.generate(prompts[:32], greedy)]
        report["greedy_unchanged_after_push"] = sum(a == b for a, b in zip(before, after)) / len(before)
        if report["served_version"] != 1:
            failures.append("served version is not 1 after the push")
        if args.quantization is None and report["greedy_unchanged_after_push"] < 0.9:
            failures.append("pushing the same weights changed greedy outputs")
    finally:
        engine.shutdown()
    report["failures"] = failures
    print(json.dumps(report))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
