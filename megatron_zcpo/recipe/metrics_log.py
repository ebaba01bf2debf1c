"""Metric sinks of a run (rank 0): metrics.jsonl, TensorBoard, optional W&B, and the console table."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

# Columns of the per-step console table: (metric key, header, format).
STEP_COLUMNS = (
    ("train/step", "step", "{:>5.0f}"),
    ("rollout/reward_mean", "reward", "{:>7.3f}"),
    ("rollout/accuracy", "acc", "{:>6.3f}"),
    ("rollout/response_length_mean", "len", "{:>6.1f}"),
    ("experience/kl", "KL", "{:>9.2e}"),
    ("experience/entropy", "entropy", "{:>7.3f}"),
    ("coef/coef_abs_mean", "|C|", "{:>6.3f}"),
    ("coef/reward_flip_fraction", "flips", "{:>6.3f}"),
    ("update/clip_high_fraction", "clip+", "{:>6.3f}"),
    ("update/grad_norm", "|g|", "{:>7.3f}"),
    ("time/step", "s/step", "{:>6.1f}"),
)


WANDB_MISSING = "the W&B metric sink needs wandb, an optional extra: pip install megatron-zcpo[wandb]"


def wandb_available() -> bool:
    """Whether the optional ``wandb`` package (the ``wandb`` extra) is installed."""
    import importlib.util

    return importlib.util.find_spec("wandb") is not None


def import_wandb():
    """The ``wandb`` module; ImportError naming the extra to install when it is missing."""
    try:
        import wandb
    except ImportError as error:
        raise ImportError(WANDB_MISSING) from error
    return wandb


def make_console():
    """A rich console; when output is not a terminal (logs, CI) wide enough for the step table."""
    import sys

    from rich.console import Console

    return Console(highlight=False, width=None if sys.stdout.isatty() else 132)


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


class MetricsLogger:
    """Writes every step's metrics to ``run_dir/metrics.jsonl`` (append, resumable; each record
    carries ``run_id`` when given), TensorBoard (``run_dir/tensorboard``) and W&B when configured,
    and prints a per-step table row."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        console: str = "table",
        tensorboard: bool = True,
        wandb_project: Optional[str] = None,
        total_steps: int = 0,
        start_step: int = 0,
        run_name: Optional[str] = None,
        run_id: Optional[str] = None,
    ):
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a")  # noqa: SIM115 -- open for the run, closed by close()
        self.console_mode = console
        self.console = make_console()
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(self.run_dir / "tensorboard"))
        self.wandb = None
        if wandb_project:
            self.wandb = import_wandb().init(
                project=wandb_project, name=run_name or self.run_dir.name, dir=str(self.run_dir)
            )
        self.progress = None
        if console == "table" and total_steps:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(
                TextColumn("[bold]training"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, completed=start_step)
            self.progress.start()
        self._header_printed = False

    def print(self, message: str) -> None:
        if self.console_mode != "quiet":
            self.console.print(message, soft_wrap=True)  # whole lines: logs are read with grep

    def log(self, step: int, metrics: Dict[str, float], *, advance: bool = True) -> None:
        """Record ``metrics`` at ``step`` in every sink; a training step (``advance``) adds a table row."""
        record = {"step": step, "time": time.time(), **{k: float(v) for k, v in metrics.items() if _finite(v)}}
        self.jsonl.write(json.dumps(record if self.run_id is None else {"run_id": self.run_id, **record}) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key not in ("step", "time") and self.writer is not None:
                self.writer.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=step)
        if advance and self.console_mode != "quiet":
            self._row(metrics)
            if self.progress is not None:
                self.progress.advance(self.task)

    def _row(self, metrics: Dict[str, float]) -> None:
        if not self._header_printed:
            self.console.print(
                " ".join(f"{header:>{len(fmt.format(0.0))}}" for _, header, fmt in STEP_COLUMNS), style="bold"
            )
            self._header_printed = True
        cells = []
        for key, _, fmt in STEP_COLUMNS:
            value = metrics.get(key)
            width = len(fmt.format(0.0))
            cells.append(fmt.format(value) if _finite(value) else f"{'-':>{width}}")
        self.console.print(" ".join(cells))

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(run_dir: str | Path) -> List[Dict[str, float]]:
    """All records of ``run_dir/metrics.jsonl`` (a resumed run's repeated steps: the last wins)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    by_key: Dict[tuple, Dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            kind = "eval" if any(k.startswith("eval/") for k in record) else "train"
            by_key[(record.get("step"), kind)] = record
    return [by_key[key] for key in sorted(by_key, key=lambda k: (k[0] is None, k[0] or 0, k[1]))]


def series(records: Sequence[Dict[str, float]], key: str):
    """(steps, values) of ``key`` over ``records``, skipping records without it."""
    pairs = [(r["step"], r[key]) for r in records if key in r and _finite(r[key])]
    return [p[0] for p in pairs], [p[1] for p in pairs]
