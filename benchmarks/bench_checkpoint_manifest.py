"""What a checkpoint manifest costs: checksumming at save time (CRC-32, what megatron_zcpo writes,
against SHA-256 and against the write itself), and the quick check every resume runs against the
full check of ``zcpo checkpoint verify``.

A synthetic checkpoint: ``--ranks`` shard files of ``--mib-per-rank`` MiB written with
torch.distributed.checkpoint (its FileSystemWriter, fsynced, as megatron-core's torch_dist does),
plus a trainer state and a manifest. Checksums run right after the write, from the page cache, as
each rank's do at save time. Prints seconds, GB/s and ratios, and the peak resident memory.

    python benchmarks/bench_checkpoint_manifest.py --ranks 8 --mib-per-rank 64
"""

from __future__ import annotations

import argparse
import hashlib
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _timed(function):
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8, help="shard files (one per rank)")
    parser.add_argument("--mib-per-rank", type=int, default=64)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()

    import torch.distributed.checkpoint as dcp

    from megatron_zcpo.checkpoint.manifest import describe_files, write_manifest
    from megatron_zcpo.checkpoint.verify import verify_checkpoint

    root = Path(tempfile.mkdtemp(prefix="zcpo-bench-manifest-", dir=args.dir))
    checkpoint = root / "step_00000001"
    try:
        elements = args.mib_per_rank * 2**20 // 4
        state = {f"rank{r}": torch.randn(elements) for r in range(args.ranks)}
        # one file per tensor, as one file per rank: a planner-free save of a dict of tensors
        write_s, _ = _timed(
            lambda: dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(
                    str(checkpoint / "weights"), single_file_per_rank=False, sync_files=True
                ),
                no_dist=True,
            )
        )
        torch.save({"step": 1, "world_size": args.ranks}, checkpoint / "trainer_state.pt")
        files = sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*") if p.is_file())
        total = sum((checkpoint / f).stat().st_size for f in files)
        crc_s, described = _timed(lambda: describe_files(checkpoint, files))
        sha_s, _ = _timed(lambda: [_sha256(checkpoint / f) for f in files])
        write_manifest(checkpoint, described, step=1, run_id="bench", world_size=args.ranks)
        quick_s, _ = _timed(lambda: verify_checkpoint(checkpoint))
        full_s, _ = _timed(lambda: verify_checkpoint(checkpoint, full=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = total / 1e9
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"synthetic checkpoint: {len(files)} files, {gb:.2f} GB ({args.ranks} shard files of {args.mib_per_rank} MiB)"
    )
    print(f"{'step':<44}{'s':>8}{'GB/s':>8}{'vs write':>10}")
    for name, seconds in (
        ("write (torch.distributed.checkpoint, fsync)", write_s),
        ("CRC-32 + fsync of every file (at save)", crc_s),
        ("SHA-256 of every file (not used)", sha_s),
        ("quick verify (every resume)", quick_s),
        ("full verify (zcpo checkpoint verify)", full_s),
    ):
        print(f"{name:<44}{seconds:>8.3f}{gb / seconds:>8.2f}{seconds / write_s:>10.3f}")
    print(
        f"SHA-256 / CRC-32: {sha_s / crc_s:.2f}x; full / quick verify: {full_s / quick_s:.0f}x; "
        f"peak resident memory {peak_mib:.0f} MiB (the tensors themselves: {gb * 1e3 / 1.048576:.0f} MiB)"
    )


if __name__ == "__main__":
    main()
