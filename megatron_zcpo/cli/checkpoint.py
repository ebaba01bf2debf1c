"""``zcpo checkpoint verify``: check training checkpoints file by file, without a model or a GPU."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import List


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "checkpoint", help="inspect training checkpoints", description="Inspect training checkpoints without training."
    )
    actions = parser.add_subparsers(dest="action", required=True)
    verify = actions.add_parser(
        "verify",
        help="check checkpoints against their manifests (sizes, checksums) and the library's index",
        description="Check a training checkpoint (step_XXXXXXXX), every checkpoint of a checkpoint directory, "
        "or of a run directory (its checkpoints/): every file's size and CRC-32 against the "
        "checkpoint's manifest, the byte ranges the checkpoint library's index reads, and that the "
        "state files read back. Exit code 1 when one is damaged.",
    )
    verify.add_argument("path", help="a step_XXXXXXXX directory, a checkpoint directory or a run directory")
    verify.add_argument(
        "--quick", action="store_true", help="what every resume checks: sizes and the library's index, no checksums"
    )
    parser.set_defaults(func=run)


def checkpoints_at(path: Path) -> List[Path]:
    """The checkpoint directories ``path`` names: itself when it is one, else the ``step_*`` directories
    of ``path`` or of ``path/checkpoints`` (damaged ones moved aside included), oldest first."""
    from megatron_zcpo.checkpoint.io import STEP_PREFIX, TRAINER_STATE
    from megatron_zcpo.checkpoint.manifest import MANIFEST

    if any((path / name).exists() for name in (MANIFEST, TRAINER_STATE, "weights")):
        return [path]
    root = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir() and not p.name.endswith((".tmp", ".discarded")))


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.checkpoint.manifest import CheckpointDamagedError
    from megatron_zcpo.checkpoint.verify import verify_checkpoint
    from megatron_zcpo.planning.planner import format_bytes

    path = Path(args.path)
    if not path.exists():
        raise SystemExit(f"zcpo checkpoint verify: {path} does not exist")
    found = checkpoints_at(path)
    if not found:
        raise SystemExit(f"zcpo checkpoint verify: no checkpoints (step_XXXXXXXX directories) in {path}")
    checked = "sizes and the library's index" if args.quick else "sizes, CRC-32 checksums, the library's index"
    damaged = 0
    for checkpoint in found:
        try:
            report = verify_checkpoint(checkpoint, full=not args.quick)
        except CheckpointDamagedError as error:
            damaged += 1
            print(f"{checkpoint.name}: DAMAGED: {error.file}: {error.reason}")
            continue
        what = (
            f"{report['files']} files, {format_bytes(report['bytes'])}, {checked}"
            if report["manifest"]
            else "no manifest (written before manifests): the library's index and the state files checked"
        )
        print(f"{checkpoint.name}: intact (step {report['step']}, run {report['run_id'] or 'unknown'}; {what})")
    print(f"{len(found) - damaged} of {len(found)} checkpoint(s) intact in {path}")
    return 1 if damaged else 0
