"""GPU check of colocated placement's device-side pieces, on one GPU, without SGLang.

    python tools/gpu_check_colocation.py        (exit 0: all ok; 1: a check failed; 3: no GPU, ran on the CPU)

1. The trainer's state offload (megatron_zcpo.megatron.offload.TrainingStateOffload) on a model and
   Adam: the device memory it frees (torch.cuda.memory_allocated before and after, the host buffers
   pinned), and a bit-exact round trip.
2. The tensor transport's bucket (megatron_zcpo.rollout.sglang.update_weight.tensor_ipc): flattened on
   the device, serialized as SGLang's MultiprocessingSerializer does, opened in another process (what a
   server's TP rank does) and checksummed there; then ipc_collect + empty_cache give the block back.
On a CPU the same code runs on host tensors (shared memory instead of CUDA IPC) and the tool exits 3.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
TENSORS = {
    "a.weight": (torch.bfloat16, (256, 512)),
    "b.weight": (torch.bfloat16, (512,)),
    "c.scale": (torch.float32, (64, 64)),
}


def check_offload(device: str):
    """(ok, detail) of an offload round trip of a model trained one Adam step on ``device``."""
    from megatron_zcpo.megatron.offload import TRAINING_PARTS, TrainingStateOffload

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
    offload = TrainingStateOffload(model, optimizer, pin=device == "cuda")
    allocated = torch.cuda.memory_allocated() if device == "cuda" else 0
    freed = offload.offload(TRAINING_PARTS)
    dropped = allocated - torch.cuda.memory_allocated() if device == "cuda" else freed
    offload.onload(TRAINING_PARTS)
    exact = all(a.equal(b) for a, b in zip(before, tensors()))
    ok = exact and dropped >= freed * 0.99
    return ok, f"{freed / 2**20:.1f} MiB offloaded, device allocation dropped {dropped / 2**20:.1f} MiB, exact={exact}"


CHILD = """
import base64, sys, torch
from multiprocessing.reduction import ForkingPickler
import torch.multiprocessing
received = ForkingPickler.loads(base64.b64decode(sys.stdin.read()))
flat = received["flattened_tensor"]
for meta in received["metadata"]:
    t = flat[meta.start_idx:meta.end_idx].reshape(meta.shape).to(meta.dtype)
    print(meta.name, float(t.double().sum()), t.device)
"""


def check_ipc(device: str):
    """(ok, detail): a flattened bucket on ``device`` opened in a child process, checksums compared."""
    from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import flattened_buckets, serialize_for_server

    if device == "cpu":  # host tensors travel as shared-memory files (no fd passing between unrelated processes)
        torch.multiprocessing.set_sharing_strategy("file_system")
    torch.manual_seed(1)
    named = [(name, torch.randn(shape).to(dtype)) for name, (dtype, shape) in TENSORS.items()]
    expected = {name: float(t.double().sum()) for name, t in named}
    buckets = list(flattened_buckets(iter(named), 1 << 30, device))
    got = {}
    for flat, metadata in buckets:
        blob = serialize_for_server({"flattened_tensor": flat, "metadata": metadata})
        child = subprocess.run(
            [sys.executable, "-c", CHILD], input=blob, capture_output=True, text=True, env=dict(os.environ), timeout=300
        )
        if child.returncode:
            return False, f"the receiving process failed: {child.stderr.strip().splitlines()[-1:]}"
        for line in child.stdout.splitlines():
            name, value, _ = line.split(" ", 2)
            got[name] = float(value)
        del flat
        if device == "cuda":
            torch.cuda.ipc_collect()
            torch.cuda.empty_cache()
    ok = got == expected
    return (
        ok,
        f"{len(buckets)} buckets, {len(got)} tensors, checksums {'equal' if ok else f'differ: {got} vs {expected}'}",
    )


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [("trainer state offload", *check_offload(device)), ("tensor IPC bucket", *check_ipc(device))]
    print(f"# gpu_check_colocation on {torch.cuda.get_device_name() if device == 'cuda' else 'the CPU'}")
    for name, ok, detail in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not all(ok for _, ok, _ in rows):
        return EXIT_FAILED
    return EXIT_OK if device == "cuda" else EXIT_NO_GPU


if __name__ == "__main__":
    sys.exit(main())
