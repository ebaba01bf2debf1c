"""The GPU benchmark's harness: checks and timed cases under a time budget, targets, and the verdict.

A target case passes only when it ran (not skipped for the budget), met its target, and every check it
depends on passed (else it is *unchecked*); :meth:`Bench.verdict` lists what failed, and the benchmark
exits non-zero when anything did. Used by ``bench_token_stats_gpu.py``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
BF16_FLOPS = 790e12  # H200 dense bf16 tensor cores
# HBM bandwidth by device name (first match), bytes/s: the H200's targets scale by 4.8 TB/s / this.
BANDWIDTHS = (("H200", 4.8e12), ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12))
DRAM_METRIC = "dram__bytes_read.sum"


def target_scale(device_name: str) -> Optional[float]:
    """Factor on the H200's target times for this GPU (its HBM bandwidth's inverse ratio); None: unknown."""
    for name, bandwidth in BANDWIDTHS:
        if name in device_name:
            return HBM_BYTES_PER_S / bandwidth
    return None


def dram_bytes_read(fn: Callable) -> Optional[float]:
    """DRAM bytes read by one call of ``fn`` (CUPTI's dram__bytes_read.sum summed over its kernels, through
    torch.profiler's per-kernel metrics), or None where the driver, its profiling permission or this torch
    does not give it."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

        config = _ExperimentalConfig(profiler_metrics=[DRAM_METRIC], profiler_measure_per_kernel=True)
        with profile(activities=[ProfilerActivity.CUDA], experimental_config=config) as prof:
            fn()
            torch.cuda.synchronize()
        with tempfile.TemporaryDirectory() as scratch:
            path = os.path.join(scratch, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as trace:
                events = json.load(trace).get("traceEvents", [])
        values = [float(e["args"][DRAM_METRIC]) for e in events if DRAM_METRIC in e.get("args", {})]
        return sum(values) if values else None
    except Exception:  # the counter is optional: the bytes the case must read are printed instead
        return None


class Bench:
    """Runs checks and timed cases, each in its own try, under a time budget; prints as it goes.

    ``timer(fn) -> (ms, peak MiB)``; ``scale``: factor on the targets (None: no target known for this
    device, which fails every target case); ``omit``: checks not to run (their cases are then unchecked).
    """

    def __init__(self, budget_s: float, timer: Callable, scale: Optional[float], omit: Iterable[str] = ()):
        self.started = time.perf_counter()
        self.deadline = self.started + budget_s
        self.timer, self.scale, self.omit = timer, scale, set(omit)
        self.checks: Dict[str, str] = {}  # name -> PASS / FAIL / skipped / omitted
        self.failures: List[str] = []
        self.targets_met: List[str] = []
        self.rows: Dict[str, List[tuple]] = {}

    def out_of_time(self, name: str) -> bool:
        if time.perf_counter() > self.deadline:
            print(f"  {name:<34} skipped: time budget spent", flush=True)
            return True
        return False

    def check(self, name: str, body: Callable[[], tuple]) -> None:
        """body() -> (ok, text)."""
        if name in self.omit:
            self.checks[name] = "omitted"
            print(f"  check {name:<28} omitted (--omit-check)", flush=True)
            return
        if self.out_of_time("check " + name):
            self.checks[name] = "skipped"
            return
        try:
            ok, text = body()
        except Exception as error:
            ok, text = False, f"raised {type(error).__name__}: {error}"
            traceback.print_exc()
        self.checks[name] = "PASS" if ok else "FAIL"
        print(f"  check {name:<28} {self.checks[name]}  {text}", flush=True)
        if not ok:
            self.failures.append(f"check {name} failed")

    def case(
        self,
        table: str,
        name: str,
        fn: Callable,
        read_bytes: float = 0.0,
        flops: float = 0.0,
        peer: bool = False,
        checked_by: Sequence[str] = (),
        target_ms: Optional[float] = None,
        must_read: float = 0.0,
    ) -> None:
        """Time ``fn``. A Triton case names the checks ``checked_by`` it depends on; ``target_ms`` (an H200's,
        scaled) makes it a target case, whose DRAM bytes read are printed against ``must_read``."""
        label = f"{table}: {name}"
        if self.out_of_time(name):
            if checked_by or target_ms is not None:
                self.failures.append(f"{label} skipped (time budget)")
            return
        try:
            ms, peak = self.timer(fn)
        except Exception as error:
            print(f"  {name:<34} ERROR {type(error).__name__}: {str(error)[:300]}", flush=True)
            traceback.print_exc()
            if checked_by or target_ms is not None:
                self.failures.append(f"{label} raised {type(error).__name__}")
            return
        rows = self.rows.setdefault(table, [])
        rows.append((name, ms, peak, read_bytes, flops, peer))
        hbm = f"{read_bytes / (ms * 1e-3) / HBM_BYTES_PER_S:6.1%}" if read_bytes else "     -"
        tensor = f"{flops / (ms * 1e-3) / BF16_FLOPS:6.1%}" if flops else "     -"
        peer_ms = next((r[1] for r in rows if r[5]), None)
        ratio = f"{ms / peer_ms:6.2f}" if peer_ms else "     -"
        print(f"  {name:<34} {ms:9.3f} ms  peak +{peak:8.0f} MiB  HBM {hbm}  bf16 {tensor}  x peer {ratio}", flush=True)
        unchecked = [f"{c} {self.checks.get(c, 'not run')}" for c in checked_by if self.checks.get(c) != "PASS"]
        if unchecked:
            self.failures.append(f"{label} unchecked ({', '.join(unchecked)})")
        if target_ms is not None:
            self._assert_target(label, ms, target_ms)
            counted = dram_bytes_read(fn)
            source = "CUPTI dram__bytes_read" if counted is not None else "counter unavailable; must read"
            read = counted if counted is not None else must_read
            print(
                f"    DRAM read {read / 1e9:.3g} GB ({source}) vs {must_read / 1e9:.3g} GB for one read of the "
                f"inputs: {read / max(must_read, 1.0):.2f}x",
                flush=True,
            )

    def _assert_target(self, label: str, ms: float, target_ms: float) -> None:
        if self.scale is None:
            self.failures.append(f"{label}: no target for this device (HBM bandwidth unknown)")
            print("    target: none known for this device -> FAIL", flush=True)
            return
        limit = target_ms * self.scale
        met = ms <= limit
        print(f"    target <= {limit:.3f} ms: {ms:.3f} ms -> {'met' if met else 'MISSED'}", flush=True)
        if met:
            self.targets_met.append(label)
        else:
            self.failures.append(f"{label} missed its target: {ms:.3f} ms > {limit:.3f} ms")

    def verdict(self) -> int:
        """Print the summary line; 0 when every check passed and every target case was met, checked, run."""
        seconds = time.perf_counter() - self.started
        passed = sum(v == "PASS" for v in self.checks.values())
        if self.failures:
            print(f"\n# token-stats GPU bench: FAIL ({len(self.failures)}): " + "; ".join(self.failures), flush=True)
            print(f"# {passed}/{len(self.checks)} checks passed, {len(self.targets_met)} targets met; {seconds:.0f} s")
            return 1
        print(
            f"\n# token-stats GPU bench: PASS: {passed}/{len(self.checks)} checks passed, targets met: "
            f"{', '.join(self.targets_met)}; {seconds:.0f} s",
            flush=True,
        )
        return 0
