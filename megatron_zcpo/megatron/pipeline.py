"""Run policy (and reference) stages through megatron-core's pipeline schedules on micro-batches.

Design: the fused vocab-parallel op needs the final hidden states and the output-layer weight,
not logits, so the GPTModel's output layer is switched to hand its input through
(:func:`install_hidden_state_head`). With pipeline parallelism the last stage must see the
policy's AND the reference's hidden states of the same micro-batch for the exact KL; rather than
running the reference pipeline first and parking its hidden states (a [tokens, hidden] tensor
per micro-batch for the whole rollout), :class:`PolicyWithReference` runs both models' stages as
ONE pipeline model: stage outputs are concatenated along the hidden dimension, so every p2p
message carries both activations and the last stage receives both at once. Memory stays at one
micro-batch in flight per stage; the cost is twice the p2p volume, which is small next to the
forward compute of two models. :class:`ModelChunks` is what a pass runs: this rank's policy and
reference chunks and how to call them.
"""

from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch

from megatron_zcpo.megatron.lora import AdaptersOffReference
from megatron_zcpo.megatron.offload import HostOffload
from megatron_zcpo.utils.devices import compute_device
from megatron_zcpo.utils.runtime import unwrap


def _hidden_state_forward(layer, input_, weight=None, runtime_gather_output=None):
    # The fused op (megatron_zcpo.ops.fused_token_stats) consumes the full-sequence hidden states
    # and this rank's vocabulary shard, and all-reduces the hidden-state gradient over TP itself
    # (what ColumnParallelLinear's copy_to_tensor_model_parallel_region would do). With sequence
    # parallelism the gather's backward must therefore only split, not reduce-scatter again.
    if layer.sequence_parallel:
        from megatron.core.tensor_parallel import mappings

        input_ = mappings.gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False)
    return input_, None


def install_hidden_state_head(model) -> None:
    """Make the last stage of ``model`` return final hidden states [b, s, h] instead of logits.

    Idempotent; a no-op on stages without the output layer. The loss must reduce the gradient
    w.r.t. those hidden states across tensor-parallel ranks (the fused op does).
    """
    gpt = unwrap(model)
    layer = getattr(gpt, "output_layer", None)
    if layer is not None and not getattr(layer, "_zcpo_hidden_head", False):
        layer.forward = types.MethodType(_hidden_state_forward, layer)
        layer._zcpo_hidden_head = True


def output_weight(model) -> torch.Tensor:
    """This rank's vocabulary shard of the output-layer weight [V_local, h] (the embedding when tied)."""
    gpt = unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class PolicyWithReference(torch.nn.Module):
    """One pipeline stage of the policy and of the frozen reference, scheduled as one model.

    ``forward`` returns ``cat([policy_out, reference_out], dim=-1)``: [s, b, 2h] between stages,
    [b, s, 2h] hidden states on the last stage. The reference runs without autograd.

    To megatron's schedules and ``finalize_model_grads`` it is the policy's model chunk: the
    gradient-buffer calls (``finish_grad_sync``, ``start_grad_sync``, ``scale_gradients``,
    ``zero_grad_buffer``, ``no_sync``, ``ddp_config``) go to the policy's DDP, and ``module``
    leads ``get_attr_wrapped_model`` to the policy's GPTModel (its tied embedding's gradient is
    all-reduced between the first and last pipeline stages). The frozen reference has no gradients.
    A LoRA policy's reference (:class:`~megatron_zcpo.megatron.lora.AdaptersOffReference`) is the
    policy's own stage: it keeps its input activation and hands it over when it runs.
    """

    def __init__(self, policy, reference):
        super().__init__()
        self.policy = policy
        self.reference = reference
        # What megatron's schedules look up on the model they are given.
        self.config = unwrap(policy).config
        self.model_type = unwrap(policy).model_type
        self.hidden_size = self.config.hidden_size

    @property
    def module(self):
        """The policy's DDP wrapper (what megatron unwraps to find the GPTModel's attributes)."""
        return self.policy

    @property
    def ddp_config(self):
        return self.policy.ddp_config

    def no_sync(self):
        return self.policy.no_sync()

    def start_grad_sync(self, *unused) -> None:
        self.policy.start_grad_sync(*unused)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        self.policy.finish_grad_sync(force_all_reduce=force_all_reduce)

    def scale_gradients(self, scaling_factor: float) -> None:
        self.policy.scale_gradients(scaling_factor)

    def zero_grad_buffer(self) -> None:
        self.policy.zero_grad_buffer()

    def set_input_tensor(self, input_tensor) -> None:
        if isinstance(input_tensor, (list, tuple)):
            input_tensor = input_tensor[0]
        if input_tensor is None:
            policy_in = reference_in = None
        else:
            policy_in, reference_in = input_tensor.split(self.hidden_size, dim=-1)
        unwrap(self.policy).set_input_tensor(policy_in)
        reference = self.reference if isinstance(self.reference, AdaptersOffReference) else unwrap(self.reference)
        reference.set_input_tensor(reference_in)

    def forward(self, input_ids, position_ids, attention_mask, **kwargs):
        policy_out = self.policy(input_ids, position_ids, attention_mask, **kwargs)
        with torch.no_grad():
            reference_out = self.reference(input_ids, position_ids, attention_mask, **kwargs)
        return torch.cat([policy_out, reference_out.detach()], dim=-1)


@dataclass
class ModelChunks:
    """This rank's model chunks a pass runs: the trained policy and the frozen reference.

    ``policy``: megatron-core's DDP around this pipeline stage's GPTModel (in a Float16Module under
    bf16), with the hidden-state head installed; ``reference``: the frozen reference's stage;
    ``forward_kwargs``: extra keywords of every forward call ({"fp32_output": False} under bf16);
    ``reference_offload``: the reference's host copy when it lives off the GPU between uses, else None;
    ``around_forward(micro_batch, pass_name)``: a context manager every pass's forward of a
    micro-batch runs inside (routing replay of MoE models, megatron_zcpo.training.routing_replay), or None.
    """

    policy: Any
    reference: Any
    forward_kwargs: Dict[str, Any] = field(default_factory=dict)
    reference_offload: Optional[HostOffload] = None
    around_forward: Optional[Callable[[Any, str], ContextManager]] = None

    def forward(self, model, mb, pass_name: str):
        """``model``'s stage forward on micro-batch ``mb`` in pass ``pass_name`` ("experience" / "update"),
        inside :attr:`around_forward` when set."""
        context = self.around_forward(mb, pass_name) if self.around_forward else contextlib.nullcontext()
        with context:
            return model(
                mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **self.forward_kwargs
            )

    @property
    def hidden_size(self) -> int:
        return unwrap(self.policy).config.hidden_size

    def with_reference(self) -> PolicyWithReference:
        """Both models' stages as one pipeline model (see :class:`PolicyWithReference`)."""
        return PolicyWithReference(self.policy, self.reference)

    def place_reference(self, on_device: bool) -> None:
        """Move the reference to the compute device (``on_device``) or back to host memory, when offloaded."""
        if self.reference_offload is None:
            return
        if on_device:
            self.reference_offload.to_device(compute_device())
        else:
            self.reference_offload.to_host()


def run_schedule(
    model,
    micro_batches: List,
    forward_step: Callable,
    *,
    forward_only: bool,
) -> List:
    """Run ``forward_step`` over ``micro_batches`` with megatron-core's pipeline schedule.

    ``forward_step(micro_batch, model) -> (output, loss_func)`` as megatron expects (the
    micro-batch object is handed over instead of a data iterator). Returns the list of loss-func
    reports (non-empty on the last pipeline stage only).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    iterator = iter(micro_batches)
    first = micro_batches[0]
    return get_forward_backward_func()(
        forward_step_func=lambda data_iterator, m: forward_step(next(data_iterator), m),
        data_iterator=iterator,
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=first.tokens.shape[1],
        micro_batch_size=first.tokens.shape[0],
        forward_only=forward_only,
    )
