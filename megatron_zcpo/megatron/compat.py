"""The megatron-core internals this package relies on, listed once and checked against the installed release.

Tested release: megatron-core 0.16.1 (the CPU suite runs on it; the Docker image installs it by
default). Every name below is something our code imports, calls with keywords, subclasses,
patches or reads, beyond megatron-core's documented entry points. :func:`check_internals`
resolves each one in the installed megatron-core and checks the keywords we pass, the
positional order we rely on and the attributes we read; ``python -m megatron_zcpo.megatron.compat``
prints the table (the image build runs it, so an image whose megatron-core moved fails to build).

Status against megatron-core 0.19.2 (read from its released wheel, docs/DEVELOPING.md
"megatron-core versions" has the method): every internal below resolves with the same
keywords, positional order and attributes, except those whose ``changed_in_0_19`` note says
otherwise. Behavioural differences the signatures cannot show are in those notes too.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

TESTED_MEGATRON_CORE = "0.16.1"


@dataclass(frozen=True)
class MegatronInternal:
    """One megatron-core name we depend on and how (``module:attr.attr``)."""

    target: str
    used_in: str
    keywords: Tuple[str, ...] = ()
    positional: Tuple[str, ...] = ()
    attributes: Tuple[str, ...] = ()
    cpu_only: bool = False  # reached only through the CPU platform layer (megatron/platform.py)
    changed_in_0_19: str = ""


_TRANSFORMER_CONFIG_KEYWORDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "normalization",
    "layernorm_epsilon",
    "gated_linear_unit",
    "activation_func",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "hidden_dropout",
    "attention_dropout",
    "init_method_std",
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "num_layers_in_first_pipeline_stage",  # uneven pipeline stages (parallel.first/last_stage_layers)
    "num_layers_in_last_pipeline_stage",
    "context_parallel_size",
    "sequence_parallel",
    "params_dtype",
    "bf16",
    "fp16",
    "pipeline_dtype",
    "use_cpu_initialization",
    "bias_activation_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
    "deallocate_pipeline_outputs",
    "variable_seq_lengths",
    "moe_token_dispatcher_type",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "finalize_model_grads_func",
    "no_sync_func",
    # mixture of experts (megatron/model.py: moe_transformer_fields)
    "num_moe_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_dtype",
    "moe_layer_freq",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_grouped_gemm",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    # DeepSeekMoE's router (megatron/deepseek.py: deepseek_router_fields)
    "moe_router_enable_expert_bias",
    "moe_router_bias_update_rate",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_topk_scaling_factor",
)
_NEW_IN_ISSUE_44 = "not yet read against 0.19.2 (added with DeepSeek-V3 support)"
_SCHEDULE_KEYWORDS = (
    "forward_step_func",
    "data_iterator",
    "model",
    "num_microbatches",
    "seq_length",
    "micro_batch_size",
    "forward_only",
)
_PS = "megatron.core.parallel_state:"
_LORA_NOT_READ = "not yet read against 0.19.2 (added with LoRA adapters)"

MEGATRON_INTERNALS: Tuple[MegatronInternal, ...] = (
    # ----- model
    MegatronInternal(
        "megatron.core.transformer.transformer_config:TransformerConfig",
        "megatron/model.py, training/trainer.py",
        keywords=_TRANSFORMER_CONFIG_KEYWORDS,
    ),
    MegatronInternal(
        "megatron.core.models.gpt:GPTModel",
        "megatron/model.py",
        keywords=(
            "config",
            "transformer_layer_spec",
            "vocab_size",
            "max_sequence_length",
            "pre_process",
            "post_process",
            "parallel_output",
            "share_embeddings_and_output_weights",
            "position_embedding_type",
            "rotary_base",
            "rope_scaling",
            "rope_scaling_factor",
        ),
        attributes=("sharded_state_dict", "shared_embedding_or_output_weight", "set_input_tensor"),
    ),
    MegatronInternal(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_with_transformer_engine_spec",
        "megatron/model.py (the GPU layer spec)",
        keywords=("qk_layernorm",),
        changed_in_0_19="now a wrapper over get_gpt_layer_with_transformer_engine_submodules with"
        " the same arguments; the dense layer (fused-norm linear_qkv and"
        " linear_fc1, no pre_mlp_layernorm) has the same parameter names",
    ),
    MegatronInternal(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec",
        "megatron/local_spec.py",
        keywords=("normalization", "qk_layernorm"),
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_layer:TransformerLayerSubmodules",
        "megatron/local_spec.py (te_checkpoint_keys: the local layers' checkpoint keys of the norms TE fuses)",
        attributes=("sharded_state_dict_keys_map",),
        changed_in_0_19="not yet read against 0.19.2",
    ),
    MegatronInternal(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_decoder_block_spec",
        "megatron/model.py (the GPU block spec of MoE models: TE grouped-GEMM experts, moe_layer_freq)",
        keywords=("config", "use_transformer_engine"),
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec",
        "megatron/local_spec.py (MoE layers: SequentialMLP experts)",
        keywords=("num_experts", "moe_grouped_gemm"),
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_config:MLATransformerConfig",
        "megatron/deepseek.py (mla_transformer_fields: multi-latent attention, YaRN)",
        keywords=(
            "multi_latent_attention",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_head_dim",
            "qk_pos_emb_head_dim",
            "v_head_dim",
            "rope_type",
            "rotary_base",
            "rotary_scaling_factor",
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
        ),
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.models.gpt.gpt_layer_specs:get_gpt_layer_local_spec",
        "megatron/local_spec.py (MLA layers)",
        keywords=("multi_latent_attention",),
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.transformer.multi_latent_attention:MLASelfAttentionSubmodules",
        "megatron/local_spec.py (down-projections, latent norms and core attention replaced)",
        attributes=("linear_q_down_proj", "linear_kv_down_proj", "q_layernorm", "kv_layernorm", "core_attention"),
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.transformer.multi_latent_attention:HAVE_TE",
        "megatron/deepseek.py (declare_transformer_engine_absent_to_mla sets it False without TE)",
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.post_training.modelopt.layers:Linear",
        "megatron/local_spec.py (MLA down-projections: one duplicated Linear on every TP rank)",
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.distributed.finalize_model_grads:_update_router_expert_bias",
        "training/trainer.py (finalize_model_grads moves the correction bias when train.moe."
        "expert_bias_update_rate > 0; the routers' local_tokens_per_expert and expert_bias)",
        positional=("model", "config"),
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.router:TopKRouter._maintain_float32_expert_bias",
        "megatron/weights.py (expert_biases_kept_in_float32: the same rule around Float16Module)",
        changed_in_0_19=_NEW_IN_ISSUE_44,
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.router:TopKRouter",
        "training/routing_replay.py (routing replay)",
        attributes=("routing", "set_layer_number"),
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.moe_utils:topk_routing_with_score_function",
        "training/routing_replay.py (calls router_replay.get_replay_topk(scores, topk, num_groups,"
        " group_topk, default_compute_topk))",
        keywords=("router_replay",),
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
        "megatron/platform.py",
        keywords=("as_numpy", "record_stream"),
        cpu_only=True,
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.token_dispatcher:maybe_move_tensor_to_cpu",
        "megatron/platform.py (the all-to-all dispatcher's own reference, patched too)",
        cpu_only=True,
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.moe.moe_utils:RouterGatingLinearFunction.forward",
        "megatron/model.py (te_general_gemm bound to None without Transformer Engine)",
        changed_in_0_19="not yet read against 0.19.2 (added with mixture-of-experts support)",
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_block:TransformerBlockSubmodules",
        "megatron/local_spec.py (the local block spec with a sequence-parallel final norm)",
        keywords=("layer_specs", "layer_norm"),
        changed_in_0_19="not yet read against 0.19.2 (added with the CPU sequence-parallel spec)",
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_block:get_num_layers_to_build",
        "megatron/local_spec.py (layers of this pipeline stage)",
        positional=("config",),
        changed_in_0_19="not yet read against 0.19.2 (added with the CPU sequence-parallel spec)",
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel.layers:ColumnParallelLinear.forward",
        "megatron/pipeline.py (the output layer's forward is replaced: same arguments)",
        positional=("self", "input_", "weight"),
        keywords=("runtime_gather_output",),
        changed_in_0_19="same arguments; GPTModel then multiplies its output by _scale_logits"
        " (MuP; the identity unless use_mup, which we never set)",
    ),
    MegatronInternal(
        "megatron.core.transformer.module:Float16Module", "training/trainer.py (bf16)", positional=("config", "module")
    ),
    MegatronInternal(
        "megatron.core.transformer.module:Float16Module.forward",
        "training/trainer.py (bf16)",
        keywords=("fp32_output",),
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_layer:get_transformer_layer_offset",
        "megatron/weights.py (global layer names under PP)",
        positional=("config",),
    ),
    MegatronInternal(
        "megatron.core.transformer.dot_product_attention:DotProductAttention",
        "megatron/attention.py (built positionally by PackedCausalAttention)",
        positional=(
            "config",
            "layer_number",
            "attn_mask_type",
            "attention_type",
            "attention_dropout",
            "softmax_scale",
            "cp_comm_type",
            "pg_collection",
        ),
    ),
    MegatronInternal(
        "megatron.core.transformer.enums:AttnMaskType", "megatron/attention.py", attributes=("causal", "padding_causal")
    ),
    MegatronInternal(
        "megatron.core.process_groups_config:ProcessGroupCollection.use_mpu_process_groups",
        "megatron/attention.py",
        keywords=("required_pgs",),
    ),
    MegatronInternal(
        "megatron.core.packed_seq_params:PackedSeqParams",
        "training/batch.py (THD micro-batches)",
        keywords=(
            "qkv_format",
            "cu_seqlens_q",
            "cu_seqlens_kv",
            "cu_seqlens_q_padded",
            "cu_seqlens_kv_padded",
            "max_seqlen_q",
            "max_seqlen_kv",
        ),
        changed_in_0_19="adds total_tokens/seq_idx/tokens_per_sample/pad_between_seqs and a"
        " __post_init__ that only acts when total_tokens is given (we never do)",
    ),
    # ----- parallel state, RNG, tensor-parallel mappings
    MegatronInternal(
        _PS + "initialize_model_parallel",
        "megatron/initialize.py",
        keywords=(
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "distributed_timeout_minutes",
            "expert_model_parallel_size",
            "expert_tensor_parallel_size",
        ),
    ),
    MegatronInternal(
        "megatron.core:parallel_state",
        "everywhere (process groups and ranks)",
        attributes=(
            "destroy_model_parallel",
            "model_parallel_is_initialized",
            "is_pipeline_first_stage",
            "is_pipeline_last_stage",
            "get_tensor_model_parallel_rank",
            "get_tensor_model_parallel_world_size",
            "get_tensor_model_parallel_group",
            "get_pipeline_model_parallel_rank",
            "get_pipeline_model_parallel_world_size",
            "get_pipeline_model_parallel_group",
            "get_context_parallel_rank",
            "get_context_parallel_world_size",
            "get_context_parallel_group",
            "get_data_parallel_rank",
            "get_data_parallel_world_size",
            "get_data_parallel_group",
            "get_model_parallel_group",
            "get_expert_model_parallel_rank",
            "get_expert_model_parallel_world_size",
            "get_expert_model_parallel_group",
            "get_expert_tensor_parallel_rank",
            "get_expert_tensor_parallel_world_size",
            "get_expert_tensor_parallel_group",
            "get_expert_data_parallel_rank",
        ),
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel:model_parallel_cuda_manual_seed",
        "megatron/initialize.py (RNG tracker reset)",
        positional=("seed",),
        keywords=("force_reset_rng",),
        changed_in_0_19="adds GTP weight-remat trackers only when that axis is > 1 (never here)",
    ),
    MegatronInternal("megatron.core.tensor_parallel:get_cuda_rng_tracker", "checkpoint/io.py (RNG state save/restore)"),
    MegatronInternal(
        "megatron.core.tensor_parallel.random:CudaRNGStatesTracker",
        "checkpoint/io.py, megatron/platform.py",
        attributes=("get_states", "set_states", "add", "fork", "reset", "is_initialized"),
    ),
    MegatronInternal("megatron.core.tensor_parallel.random:_get_cuda_rng_state", "megatron/platform.py", cpu_only=True),
    MegatronInternal("megatron.core.tensor_parallel.random:_set_cuda_rng_state", "megatron/platform.py", cpu_only=True),
    MegatronInternal(
        "megatron.core:tensor_parallel",
        "training/trainer.py, convert/verify.py, ops/",
        attributes=(
            "vocab_parallel_cross_entropy",
            "gather_from_tensor_model_parallel_region",
            "copy_to_tensor_model_parallel_region",
            "param_is_not_tensor_parallel_duplicate",
        ),
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel.mappings:gather_from_sequence_parallel_region",
        "megatron/pipeline.py, megatron/attention.py",
        positional=("input_", "tensor_parallel_output_grad"),
        keywords=("group",),
    ),
    # ----- LoRA adapters (megatron/lora.py)
    MegatronInternal(
        "megatron.core.tensor_parallel:set_tensor_model_parallel_attributes",
        "megatron/lora.py (the adapters' TP split, read by weights.py and the grad-norm's duplicate test)",
        positional=("tensor", "is_parallel", "dim", "stride"),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel.mappings:copy_to_tensor_model_parallel_region",
        "megatron/lora.py (column-parallel adapter, no SP)",
        positional=("input_",),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel.mappings:reduce_from_tensor_model_parallel_region",
        "megatron/lora.py (row-parallel adapter, no SP)",
        positional=("input_",),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.tensor_parallel.mappings:reduce_scatter_to_sequence_parallel_region",
        "megatron/lora.py (row-parallel adapter under SP)",
        positional=("input_",),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.transformer.mlp:MLP",
        "megatron/lora.py (dense MLPs get fc1/fc2 adapters, MoE layers none)",
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.transformer.mlp:apply_swiglu_sharded_factory",
        "megatron/lora.py (fc1's adapter B saved as [gate; up] halves, like fc1's weight)",
        positional=("original_sh_ten", "sharded_offsets", "singleton_local_shards"),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.transformer.utils:make_sharded_tensors_for_checkpoint",
        "megatron/lora.py (the adapters' sharded state)",
        positional=("state_dict", "prefix", "tensor_parallel_layers_axis_map", "sharded_offsets"),
        keywords=("tp_group", "dp_cp_group"),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    MegatronInternal(
        "megatron.core.transformer.transformer_block:TransformerBlock.forward",
        "megatron/lora.py (the recompute fix's pre-hook reads hidden_states, passed by keyword by GPTModel)",
        keywords=("hidden_states",),
        changed_in_0_19=_LORA_NOT_READ,
    ),
    # ----- schedules, DDP, optimizer
    MegatronInternal(
        "megatron.core.pipeline_parallel:get_forward_backward_func",
        "megatron/pipeline.py, convert/verify.py",
        changed_in_0_19="schedules.py imports the MoE paged-stash op, which imports triton"
        " unconditionally: megatron.core does not import without triton (NGC"
        " images have it; the CPU venv does not)",
    ),
    MegatronInternal(
        "megatron.core.pipeline_parallel.schedules:forward_backward_no_pipelining",
        "megatron/pipeline.py (PP = 1)",
        keywords=_SCHEDULE_KEYWORDS,
    ),
    MegatronInternal(
        "megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_without_interleaving",
        "megatron/pipeline.py (PP > 1)",
        keywords=_SCHEDULE_KEYWORDS,
    ),
    MegatronInternal(
        "megatron.core.distributed:DistributedDataParallel",
        "training/trainer.py",
        positional=("config", "ddp_config", "module"),
        attributes=("no_sync", "zero_grad_buffer"),
    ),
    MegatronInternal(
        "megatron.core.distributed:DistributedDataParallelConfig",
        "training/trainer.py",
        keywords=("grad_reduce_in_fp32", "use_distributed_optimizer"),
    ),
    MegatronInternal(
        "megatron.core.distributed:finalize_model_grads",
        "training/trainer.py (config.finalize_model_grads_func)",
        changed_in_0_19="adds GTP/flextron reductions (inactive here) and scales per-token-loss"
        " gradients without the num_tokens > 0 branch (we do not use per-token loss)",
    ),
    MegatronInternal(
        "megatron.core.optimizer:OptimizerConfig",
        "training/trainer.py",
        keywords=(
            "optimizer",
            "lr",
            "min_lr",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_eps",
            "clip_grad",
            "bf16",
            "params_dtype",
            "use_distributed_optimizer",
        ),
    ),
    MegatronInternal(
        "megatron.core.optimizer:get_megatron_optimizer", "training/trainer.py", positional=("config", "model_chunks")
    ),
    MegatronInternal(
        "megatron.core.optimizer_param_scheduler:OptimizerParamScheduler",
        "training/trainer.py",
        keywords=(
            "optimizer",
            "init_lr",
            "max_lr",
            "min_lr",
            "lr_warmup_steps",
            "lr_decay_steps",
            "lr_decay_style",
            "start_wd",
            "end_wd",
            "wd_incr_steps",
            "wd_incr_style",
        ),
        attributes=("step",),
    ),
    MegatronInternal(
        "megatron.core.optimizer.optimizer:MegatronOptimizer.__init__",
        "megatron/platform.py",
        positional=("self", "optimizer", "config", "init_state_fn"),
        cpu_only=True,
    ),
    MegatronInternal(
        "megatron.core.optimizer.optimizer:Float16OptimizerWithFloat16Params", "megatron/platform.py", cpu_only=True
    ),
    MegatronInternal(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer",
        "megatron/platform.py, checkpoint/io.py",
        attributes=(
            "_build_model_and_main_param_groups",
            "_set_main_param_and_optimizer_states",
            "sharded_state_dict",
            "load_state_dict",
        ),
    ),
    MegatronInternal(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer._set_main_param_and_optimizer_states",
        "megatron/platform.py",
        positional=("self", "model_param", "tensors"),
        cpu_only=True,
    ),
    MegatronInternal(
        "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer.sharded_state_dict",
        "checkpoint/io.py, megatron/platform.py",
        positional=("self", "model_sharded_state_dict", "is_loading"),
        keywords=("metadata",),
    ),
    MegatronInternal(
        "megatron.core.optimizer.clip_grads:clip_grad_by_total_norm_fp32", "megatron/platform.py", cpu_only=True
    ),
    # ----- distributed checkpointing
    MegatronInternal(
        "megatron.core.dist_checkpointing:save",
        "checkpoint/io.py, convert/checkpoint.py",
        positional=("sharded_state_dict", "checkpoint_dir"),
        keywords=("sharded_strategy",),
        changed_in_0_19="BREAKS convert/checkpoint.py: save() silently replaces any strategy that"
        " is not a TorchDistSaveShardedStrategy with the default one, so the"
        " streaming converter's strategy would be ignored",
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing:load",
        "checkpoint/io.py, convert/checkpoint.py",
        positional=("sharded_state_dict", "checkpoint_dir"),
        keywords=("sharded_strategy", "validate_access_integrity"),
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing:load_tensors_metadata",
        "checkpoint/io.py, convert/checkpoint.py",
        positional=("checkpoint_dir",),
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing.mapping:ShardedTensor",
        "convert/checkpoint.py",
        attributes=("key", "global_shape", "global_offset", "local_shape", "axis_fragmentations", "replica_id", "data"),
    ),
    MegatronInternal("megatron.core.dist_checkpointing.mapping:apply_factories", "convert/checkpoint.py"),
    MegatronInternal("megatron.core.dist_checkpointing.dict_utils:dict_list_map_inplace", "convert/checkpoint.py"),
    MegatronInternal(
        "megatron.core.dist_checkpointing.strategies.base:SaveShardedStrategy",
        "convert/checkpoint.py",
        positional=("backend", "version"),
        changed_in_0_19="BREAKS convert/checkpoint.py: strategies/base.py is gone (ImportError)",
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing.strategies.torch:MCoreSavePlanner",
        "convert/checkpoint.py",
        keywords=("dedup_replicated_tensors", "flatten_state_dict"),
        attributes=("resolve_data",),
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing.strategies.torch:_replace_state_dict_keys_with_sharded_keys",
        "convert/checkpoint.py (returns a 3-tuple)",
        keywords=("keep_only_main_replica",),
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing.strategies.torch:mcore_to_pyt_state_dict",
        "convert/checkpoint.py",
        keywords=("is_loading",),
    ),
    MegatronInternal(
        "megatron.core.dist_checkpointing.strategies.torch:TorchDistLoadShardedStrategy", "convert/checkpoint.py"
    ),
)


def resolve(target: str) -> Any:
    """The object ``module:attr.attr`` names (raises ImportError / AttributeError)."""
    module_name, _, path = target.partition(":")
    value: Any = importlib.import_module(module_name)
    for name in path.split("."):
        value = getattr(value, name)
    return value


def _parameters(value: Any) -> List[inspect.Parameter]:
    return list(inspect.signature(value).parameters.values())


def check_internal(internal: MegatronInternal) -> List[str]:
    """Problems with one internal in the installed megatron-core (empty when it matches)."""
    try:
        value = resolve(internal.target)
    except (ImportError, AttributeError) as error:
        return [f"missing: {error}"]
    fields = getattr(value, "__dataclass_fields__", {})
    problems = [
        f"no attribute {name!r}" for name in internal.attributes if not (hasattr(value, name) or name in fields)
    ]
    if internal.keywords or internal.positional:
        parameters = _parameters(value)
        names = [p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        open_ended = any(p.kind is p.VAR_KEYWORD for p in parameters)
        if not open_ended:
            problems += [f"no keyword {name!r}" for name in internal.keywords if name not in names]
        order = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if order[: len(internal.positional)] != list(internal.positional):
            problems.append(f"positional order {order[: len(internal.positional)]} != {list(internal.positional)}")
    return problems


def check_internals(internals: Sequence[MegatronInternal] = MEGATRON_INTERNALS) -> Dict[str, List[str]]:
    """``{target: problems}`` for every internal (an empty list where it matches)."""
    return {internal.target: check_internal(internal) for internal in internals}


def installed_version() -> str:
    """The installed megatron-core's version string."""
    from megatron.core import package_info

    return package_info.__version__


def main() -> int:
    """Print the table for the installed megatron-core; exit status 1 when anything does not match."""
    results = check_internals()
    print(f"megatron-core {installed_version()} (tested: {TESTED_MEGATRON_CORE})")
    for internal in MEGATRON_INTERNALS:
        problems = results[internal.target]
        status = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
        print(f"{status:10s} {internal.target}  [{internal.used_in}]")
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
