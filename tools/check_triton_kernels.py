"""Compile every Triton kernel variant of the token statistics for a GPU architecture, without a GPU.

    python tools/check_triton_kernels.py [--arch 90] [--quick]

The op runs on small CPU tensors with each kernel shape the GPU launcher may pick forced in turn,
and every launch is compiled (Triton's front end, ptxas) for ``sm_<arch>`` instead of run: what
Triton's interpreter accepts but the compiler rejects (types of loop-carried values, constexpr
use, language features of another Triton release) fails here. Prints one line per variant with
ptxas's registers and spill bytes; exit status 1 when a variant fails to compile.
``--quick`` compiles one shape per kernel (the test suite's check).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels must be real JIT functions here
    os.environ["TRITON_INTERPRET"] = "0"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64", torch.int32: "i32"}


def _signature(kernel, args, kwargs):
    """Triton signature, constexprs and alignment attributes of a launch, specialised as a launch would."""
    signature, constexprs, attrs = {}, {}, {}
    values = list(args) + [kwargs[n] for n in kernel.arg_names[len(args) :]]
    for index, (name, value) in enumerate(zip(kernel.arg_names, values)):
        aligned = False
        if name in kwargs and kernel.params[index].is_constexpr:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0
        else:
            signature[name] = "fp32"
        if aligned:  # what Triton's launcher marks for pointers / integers divisible by 16 (vector loads)
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _ptxas_report(ptx: str, arch: int) -> tuple:
    """(registers, spill bytes) from ptxas -v on the kernel's PTX."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as source:
        source.write(ptx)
    try:
        log = subprocess.run(
            [get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", source.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    finally:
        os.unlink(source.name)
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return registers, spills


class Compiler:
    """Stands in for ``launch_kernel``: compiles each distinct launch once and records the outcome."""

    def __init__(self, arch: int):
        self.arch, self.seen, self.failures = arch, set(), 0

    def __call__(self, kernel, grid, *args, **kwargs):
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        num_warps = kwargs.pop("num_warps")
        signature, constexprs, attrs = _signature(kernel, args, kwargs)
        key = (kernel.fn.__name__, tuple(signature.items()), tuple(constexprs.items()), num_warps)
        if key in self.seen:
            return
        self.seen.add(key)
        flags = ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in constexprs.items())
        started = time.perf_counter()
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs, attrs),
                target=GPUTarget("cuda", self.arch, 32),
                options={"num_warps": num_warps},
            )
            registers, spills = _ptxas_report(compiled.asm["ptx"], self.arch)
            status = "ok" if spills == 0 else "spills"
            detail = f"{registers} registers, {spills} spill bytes"
        except Exception as error:  # report every variant, then fail
            status, detail = (
                "FAILED",
                f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}",
            )
        self.failures += status == "FAILED"
        z_type = signature[kernel.arg_names[0]]
        print(
            f"{status:6} {kernel.fn.__name__} z={z_type} warps={num_warps} {flags}: {detail} "
            f"({time.perf_counter() - started:.1f} s)",
            flush=True,
        )


def exercise(quick: bool) -> None:
    """Run both paths of the op (forward, backward; logits and fused) over the variants the GPU can take."""
    from megatron_zcpo.ops import token_stats_triton as backend
    from megatron_zcpo.ops.token_stats_kernels import resolve_tiling

    rows, columns, hidden_size = 8, 320, 16  # a multiple of 16 columns, as Megatron pads the vocabulary
    targets = torch.arange(rows) * 7 % columns
    forward_shapes = backend.FORWARD_CANDIDATES[:1] if quick else backend.FORWARD_CANDIDATES
    backward_shapes = backend.BACKWARD_CANDIDATES[:1] if quick else backend.BACKWARD_CANDIDATES
    temperatures = [(1.0, 1.0), (0.7, 1.0)] if quick else [(1.0, 1.0), (0.7, 1.0), (1.3, 0.6)]
    for forward in forward_shapes:
        for backward in backward_shapes:
            with backend.forced_configs(forward, backward):
                for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
                    z = torch.zeros(rows, columns, dtype=dtype)
                    hidden = torch.zeros(rows, hidden_size, dtype=dtype)
                    weight = torch.zeros(columns, hidden_size, dtype=dtype)
                    for with_ref in (False, True):
                        for temperature, kl_temperature in temperatures if with_ref else temperatures[:1]:
                            tiling = resolve_tiling(
                                columns,
                                targets,
                                group=None,
                                vocab_size=None,
                                chunk_size=4,
                                vocab_chunk_size=None,
                                temperature=temperature,
                                kl_temperature=kl_temperature,
                                dtype=torch.float32,
                                with_ref=with_ref,
                                device=z.device,
                            )
                            ref = z if with_ref else None
                            results = backend.logits_forward(z, ref, targets, tiling)
                            grads = (torch.ones(rows), torch.ones(rows), torch.ones(rows) if with_ref else None)
                            backend._backward(
                                torch.empty_like(z), targets, results.saved, grads, tiling, logits=z, ref_logits=ref
                            )
                            results, cache = backend.fused_forward(
                                hidden,
                                weight,
                                hidden if with_ref else None,
                                weight if with_ref else None,
                                targets,
                                tiling,
                                keep_cache=True,
                            )
                            backend._backward(
                                torch.empty(rows, columns, dtype=dtype),
                                targets,
                                results.saved,
                                grads,
                                tiling,
                                cache=cache,
                            )
                            if not quick:  # the backward of logprob alone (the update without entropy or KL)
                                backend._backward(
                                    torch.empty_like(z),
                                    targets,
                                    results.saved,
                                    (grads[0], None, None),
                                    tiling,
                                    cache=cache,
                                )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    parser.add_argument("--quick", action="store_true", help="one kernel shape each (the test suite's check)")
    args = parser.parse_args(argv)
    import triton

    from megatron_zcpo.ops import token_stats_triton as backend

    compiler = Compiler(args.arch)
    backend.launch_kernel = compiler
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache_dir:
        os.environ["TRITON_CACHE_DIR"] = cache_dir
        exercise(args.quick)
    print(
        f"# triton {triton.__version__}, sm_{args.arch}: {len(compiler.seen)} variants, {compiler.failures} failed, "
        f"{time.perf_counter() - started:.0f} s"
    )
    return 1 if compiler.failures else 0


if __name__ == "__main__":
    sys.exit(main())
