"""The output layer's GEMMs inside the fused token statistics: float32 logits without low-precision rounding."""

from __future__ import annotations

from contextlib import contextmanager

import torch

HAS_MM_OUT_DTYPE = "dtype" in torch.ops.aten.mm.overloads()


@contextmanager
def _exact_fp32_matmul():
    """float32 GEMMs in full float32 (no TF32 or bf16 internals) for the duration, restored afterwards."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class OutputProjection:
    """Logit tiles hidden @ weight[first:last].T in the compute dtype with no low-precision rounding.

    hidden: [N, H]; weight: [V_local, H], of which the first ``valid_columns`` rows are used. On
    CUDA, bf16/fp16 operands with a float32 output (each product is exact, sums in fp32); else the
    operands are upcast (the weight once per call) and multiplied in full float32 (no TF32).
    Gradient GEMMs follow Megatron's precision instead: bf16 operands for the hidden gradient, and
    a float32 weight-gradient accumulator (TF32 where the user allows it) on the tiled path, bf16
    operands and output with float32 accumulation on the whole-shard path.
    """

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, valid_columns: int, dtype: torch.dtype):
        self.dtype = dtype
        self.native = (
            hidden.is_cuda
            and HAS_MM_OUT_DTYPE
            and hidden.dtype == weight.dtype
            and hidden.dtype in (torch.bfloat16, torch.float16)
            and dtype == torch.float32
        )
        self.weight = weight[:valid_columns]
        # Upcast once per call (not per tile) where the GEMMs cannot take low-precision operands.
        self.hidden = hidden if self.native else hidden.to(self.dtype)
        self.upcast_weight = self.weight if self.native else self.weight.to(self.dtype)

    @property
    def gradient_dtype(self) -> torch.dtype:
        """dtype of a whole logit gradient fed to :meth:`shard_gradients` (the operands' on CUDA)."""
        return self.weight.dtype if self.native else self.dtype

    def logits_into(self, start: int, stop: int, first: int, last: int, out: torch.Tensor) -> None:
        """out [n, last - first] = hidden[start:stop] @ weight[first:last].T."""
        if self.native:
            torch.mm(self.hidden[start:stop], self.weight[first:last].t(), self.dtype, out=out)
        else:
            with _exact_fp32_matmul():
                torch.mm(self.hidden[start:stop], self.upcast_weight[first:last].t(), out=out)

    def hidden_grad(self, grad_logits: torch.Tensor, first: int, last: int) -> torch.Tensor:
        """[n, H] compute dtype: grad_logits [n, last - first] @ weight[first:last]."""
        if self.native:
            return torch.mm(grad_logits.to(self.weight.dtype), self.weight[first:last], self.dtype)
        return grad_logits @ self.upcast_weight[first:last]

    def weight_grad(self, grad_logits: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """[last - first, H] compute dtype: grad_logits.T @ hidden[start:stop]."""
        return grad_logits.t() @ self.hidden[start:stop].to(self.dtype)

    def shard_gradients(self, grad_logits: torch.Tensor, weight_grad_out: torch.Tensor) -> torch.Tensor:
        """Both gradients of the whole shard from grad_logits [N, valid_columns] in :attr:`gradient_dtype`.

        Returns the hidden gradient [N, H] in the compute dtype; writes grad_logits.T @ hidden into
        ``weight_grad_out`` [valid_columns, H] (the weight's dtype): on CUDA one bf16-operand GEMM
        with float32 accumulation and no float32 [V_local, H] temporary.
        """
        hidden_grad = self.hidden_grad(grad_logits, 0, grad_logits.shape[1])
        if self.native:
            torch.mm(grad_logits.t(), self.hidden, out=weight_grad_out)
        else:
            weight_grad_out.copy_(self.weight_grad(grad_logits, 0, grad_logits.shape[0]))
        return hidden_grad
