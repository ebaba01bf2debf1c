"""GPU check of colocated placement on every GPU of one node: offload, the per-GPU CUDA IPC push, the phase machine.

    python tools/gpu_check_colocation.py [--sglang-python /opt/sglang/bin/python] [--tp-size 2] [--out DIR]

Exit status: 0 every check ran and passed; 1 a check failed; 3 no GPU (the CPU parts ran); 4 passed,
but what one GPU (or a missing SGLang) cannot check was skipped (listed as ``skip`` lines).

1. The trainer's state offload (megatron_zcpo.megatron.offload.TrainingStateOffload) on every GPU: the
   device memory it frees (torch.cuda.memory_allocated before and after, host buffers pinned) and a
   bit-exact round trip.
2. The per-GPU CUDA IPC push (megatron_zcpo.rollout.sglang.update_weight.tensor_ipc, no SGLang in this
   process): a flattened bucket is put on every GPU and serialised there (device UUIDs in the handles).
   The GPUs are split into servers of ``--tp-size`` in order, as the launchers lay them out; each TP
   rank is a process of SGLang's interpreter that sees only its server's GPUs (CUDA_VISIBLE_DEVICES)
   and opens the blob of its own GPU with SGLang's own code (patch_torch + MultiprocessingSerializer),
   which must land on its own device index with the sender's checksum. Control: a TP rank of a server
   that cannot see GPU 0 is handed GPU 0's blob and must refuse it (SGLang's ``Invalid device_uuid``: what
   killed every server but the first when all blobs came from rank 0).
3. The colocated phase machine: ``zcpo train`` for 2 steps on every GPU (data parallel), SGLang servers
   at ``--tp-size`` launched colocated (``--enable-memory-saver``) from ``--sglang-python``, the router in
   front; every step releases, trains, resumes the weights, pushes per GPU and resumes the rest. Passes
   when the run ends with both steps logged, each with its hand-over times (after every push the
   client checks that each server serves the pushed version; a server that does not leaves the run).
On one GPU, 2 and 3 run with one server at TP1: the UUID mapping across other CUDA_VISIBLE_DEVICES, a
server that cannot see the sender's GPU and several servers beside several trainer ranks are not
checked (skip lines say so). Without SGLang's interpreter 2 and 3 are skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU, EXIT_SKIPPED = 0, 1, 3, 4
DEFAULT_SGLANG_PYTHON = "/opt/sglang/bin/python"  # the Dockerfile's SGLang venv
TENSORS = {
    "a.weight": (torch.bfloat16, (256, 512)),
    "b.weight": (torch.bfloat16, (512,)),
    "c.scale": (torch.float32, (64, 64)),
}
Row = Tuple[str, Optional[bool], str]  # (check, passed or None when skipped, detail)


def check_offload(device: str) -> Row:
    """An offload round trip of a model trained one Adam step on ``device``."""
    from megatron_zcpo.megatron.offload import TRAINING_PARTS, TrainingStateOffload

    on_cuda = device.startswith("cuda")
    if on_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 1024, device=device)).sum().backward()
    optimizer.step()

    def tensors():
        return [p.detach().clone() for p in model.parameters()] + [
            v.clone() for s in optimizer.state.values() for v in s.values()
        ]

    before = tensors()
    offload = TrainingStateOffload(model, optimizer, pin=on_cuda)
    allocated = torch.cuda.memory_allocated(device) if on_cuda else 0
    freed = offload.offload(TRAINING_PARTS)
    dropped = allocated - torch.cuda.memory_allocated(device) if on_cuda else freed
    offload.onload(TRAINING_PARTS)
    exact = all(a.equal(b) for a, b in zip(before, tensors()))
    ok = exact and dropped >= freed * 0.99
    detail = f"{freed / 2**20:.1f} MiB offloaded, allocation dropped {dropped / 2**20:.1f} MiB, exact={exact}"
    return f"trainer state offload on {device}", ok, detail


# One TP rank of a server, in SGLang's interpreter: what its scheduler does with serialized_named_tensors.
TP_RANK = """
import json, sys, torch
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
request = json.loads(sys.stdin.read())
torch.cuda.set_device(request["tp_rank"])
monkey_patch_torch_reductions()
try:
    received = MultiprocessingSerializer.deserialize(request["blob"])
    flat = received["flattened_tensor"]
    sums = {m.name: float(flat[m.start_idx:m.end_idx].double().sum()) for m in received["metadata"]}
    print(json.dumps({"device": flat.device.index, "sums": sums}))
except Exception as error:
    print(json.dumps({"error": f"{type(error).__name__}: {error}"}))
"""


def _open_as_tp_rank(sglang_python: str, gpus: List[str], tp_rank: int, blob: str) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
    done = subprocess.run(
        [sglang_python, "-c", TP_RANK],
        input=json.dumps({"tp_rank": tp_rank, "blob": blob}),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if done.returncode:
        return {"error": f"the TP rank's process failed: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def node_gpus() -> List[str]:
    """This node's GPUs as CUDA_VISIBLE_DEVICES names them (indices or UUIDs), in this process's order."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]


def check_ipc_per_gpu(sglang_python: str, tp_size: int) -> List[Row]:
    """Rows of check 2 (see the module docstring)."""
    from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import (
        bucket_payload,
        flattened_buckets,
        release_ipc_blocks,
        serialize_for_server,
    )

    gpus = node_gpus()
    tp = min(tp_size, len(gpus))
    torch.manual_seed(1)
    named = [(name, torch.randn(shape).to(dtype)) for name, (dtype, shape) in TENSORS.items()]
    expected = {name: float(t.double().sum()) for name, t in named}
    [(flat, metadata)] = list(flattened_buckets(iter(named), 1 << 30, "cuda:0"))
    copies = [flat.to(f"cuda:{slot}") for slot in range(len(gpus))]  # each trainer rank's own bucket
    blobs = [serialize_for_server(bucket_payload(copy, metadata)) for copy in copies]
    rows: List[Row] = []
    for server in range(len(gpus) // tp):
        server_gpus = gpus[server * tp : (server + 1) * tp]
        for tp_rank in range(tp):
            got = _open_as_tp_rank(sglang_python, server_gpus, tp_rank, blobs[server * tp + tp_rank])
            ok = got.get("device") == tp_rank and got.get("sums") == expected
            rows.append((f"IPC: server {server} (GPUs {server_gpus}) TP rank {tp_rank}", ok, json.dumps(got)[:300]))
    if len(gpus) // tp > 1:
        blind = gpus[-tp:]
        got = _open_as_tp_rank(sglang_python, blind, 0, blobs[0])
        ok = "Invalid device_uuid" in got.get("error", "")
        rows.append((f"IPC control: GPUs {blind} refuse GPU {gpus[0]}'s handle", ok, json.dumps(got)[:300]))
    else:
        rows.append(("IPC control: a server that cannot see the sender's GPU", None, "needs 2 servers' GPUs"))
    del copies, blobs, flat
    release_ipc_blocks()
    return rows


def check_colocated_run(sglang_python: str, tp_size: int, out: Path) -> Row:
    """Check 3: ``zcpo train`` colocated with SGLang on every GPU of this node for 2 steps."""
    import yaml

    sys.path.insert(0, str(ROOT / "tools"))
    from gpu_check import write_train_runs

    from megatron_zcpo.utils.runtime import free_port

    gpus = len(node_gpus())
    [config_path] = write_train_runs(out, ["colocated"], bf16=True)
    config = yaml.safe_load(config_path.read_text())
    config["rollout"].update(
        engine="sglang",
        placement="colocated",
        sglang={
            "launch": {
                "model_path": config["model"]["path"],
                "tp_size": min(tp_size, gpus),
                "python": sglang_python,
                "nodes": ["127.0.0.1"],
                "gpus_per_node": gpus,
                "base_port": free_port(),
                "port_stride": 10,
                "router_port": free_port(),
                "mem_fraction_static": 0.4,
                "log_dir": str(out / "sglang_logs"),
                "startup_timeout_s": 900,
            }
        },
    )
    config_path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "megatron_zcpo.cli.main", "train", str(config_path), "--nproc", str(gpus)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    print(done.stdout[-3000:] + done.stderr[-3000:], flush=True)
    run_dir = Path(config["logging"]["run_dir"])
    lines = (run_dir / "metrics.jsonl").read_text().splitlines() if (run_dir / "metrics.jsonl").exists() else []
    steps = {r["step"]: r for r in map(json.loads, lines) if "rollout/reward_mean" in r}
    handovers = all(all(f"time/colocate_{p}" in r for p in ("train", "update", "generate")) for r in steps.values())
    ok = done.returncode == 0 and sorted(steps) == [1, 2] and handovers
    detail = f"exit {done.returncode}, steps {sorted(steps)}, hand-over times logged: {handovers}; logs under {out}"
    return f"zcpo train colocated on {gpus} GPU(s), servers at TP{min(tp_size, gpus)}", ok, detail


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sglang-python", default=DEFAULT_SGLANG_PYTHON, help="an interpreter with sglang")
    parser.add_argument("--tp-size", type=int, default=2, help="GPUs per SGLang server (the 7B example's)")
    parser.add_argument("--out", default=None, help="where the run of check 3 goes (default: a temp dir)")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if on_gpu else ["cpu"]
    rows: List[Row] = [check_offload(device) for device in devices]
    has_sglang = Path(args.sglang_python).exists()
    if not on_gpu:
        rows.append(("per-GPU CUDA IPC push, colocated zcpo train", None, "no GPU"))
    elif not has_sglang:
        rows.append(("per-GPU CUDA IPC push, colocated zcpo train", None, f"no SGLang at {args.sglang_python}"))
    else:
        rows += check_ipc_per_gpu(args.sglang_python, args.tp_size)
        out = Path(args.out or tempfile.mkdtemp(prefix="gpu_check_colocation-"))
        rows.append(check_colocated_run(args.sglang_python, args.tp_size, out))
    if on_gpu and len(devices) == 1:
        rows.append(
            (
                "several GPUs",
                None,
                "one GPU: the UUID mapping across other CUDA_VISIBLE_DEVICES, a server that cannot see the "
                "sender's GPU, several servers beside several trainer ranks",
            )
        )
    name = ", ".join(sorted({torch.cuda.get_device_name(i) for i in range(len(devices))})) if on_gpu else "the CPU"
    print(f"# gpu_check_colocation on {len(devices)} x {name}")
    for check, ok, detail in rows:
        print(f"{'skip' if ok is None else 'ok  ' if ok else 'FAIL'} {check}: {detail}")
    if any(ok is False for _, ok, _ in rows):
        return EXIT_FAILED
    if not on_gpu:
        return EXIT_NO_GPU
    return EXIT_SKIPPED if any(ok is None for _, ok, _ in rows) else EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
