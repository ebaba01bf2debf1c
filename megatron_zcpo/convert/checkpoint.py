"""Megatron dist checkpoints (torch_dist) written and read one tensor at a time, and the two conversions.

A converted checkpoint directory holds megatron-core's ``torch_dist`` files (``metadata.json``,
``common.pt``, ``.metadata``, ``__0_0.distcp``), ``model_config.json`` (the :class:`ModelConfig`)
and ``hf/`` (the original config.json, tokenizer files and generation_config.json, copied
through for the way back). Tensors are stored under megatron-core's own sharded keys at TP=1
(layers stacked on a leading axis), with the true vocabulary: megatron marks vocabulary tensors
``allow_shape_mismatch``, so one checkpoint loads at any TP/PP and every layout pads its own.

Neither direction builds a real model. The TP=1/PP=1 GPTModel is built on the meta device only
for megatron-core's description of the checkpoint (keys, offsets, SwiGLU split); each stored
piece is tagged with the global parameter it is a view of. Writing, torch.distributed.checkpoint's
planner asks for one piece at a time and gets it from the Hugging Face shards then; reading, one
parameter's pieces are loaded at a time. Memory stays at a few tensors for any model size.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from megatron_zcpo.checkpoint.io import read_model_config, write_model_config
from megatron_zcpo.convert import deepseek, fp8, hf_checkpoint, mapping
from megatron_zcpo.convert.output_dir import atomic_output_dir
from megatron_zcpo.megatron.model import ModelConfig, pipeline_stage_layers

HF_FILES_DIR = "hf"
# DeepSeek-V3's multi-token-prediction layers, when kept: carried in hf/ as these shards (Hugging
# Face names, bf16), not part of the Megatron model, written back after its tensors.
MTP_FILE_PREFIX = "mtp"
MTP_CHOICES = ("drop", "keep")


# ----------------------------------------------------------------------------- the TP=1 layout


@dataclasses.dataclass
class _StoredPiece:
    """One ShardedTensor of the TP=1 layout and where it sits in its global parameter."""

    template: object  # megatron ShardedTensor without data
    parameter: str  # global Megatron name (mapping / weights naming)
    size: Tuple[int, ...]
    stride: Tuple[int, ...]
    storage_offset: int

    def view_of(self, full: torch.Tensor) -> torch.Tensor:
        """This piece's view of the global tensor ``full`` (true vocabulary)."""
        return full.as_strided(self.size, self.stride, self.storage_offset)


def _require_single_process() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not (dist.is_initialized() and ps.model_parallel_is_initialized()) or dist.get_world_size() != 1:
        raise RuntimeError(
            "checkpoint conversion runs in one process: call "
            "megatron_zcpo.megatron.initialize.setup_megatron() without torchrun first"
        )


def _tp1_layout(model: ModelConfig, lora=None):
    """megatron-core's TP=1/PP=1 sharded state dict of ``model``, as data-less templates (with
    ``lora``, a LoraConfig: of its adapters alone, as a LoRA training checkpoint stores them).

    Returns ``(sharded_state_dict, pieces)``: the nested dict (factories applied, vocabulary
    tensors cut to the true vocabulary) and one :class:`_StoredPiece` per ShardedTensor in it,
    keyed by ``(key, global_offset)`` as torch.distributed.checkpoint indexes write items.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    from megatron_zcpo.megatron.lora import apply_lora, is_adapter_name
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import VOCAB_TENSORS, named_global_parameters

    _require_single_process()
    with torch.device("meta"):
        gpt = build_gpt_model(model, transformer_config(model, use_cpu_initialization=True), use_te=False)
    if lora is not None:
        apply_lora(gpt, lora, seed=0)  # meta adapters: only their shapes and keys are read
    parameters = {}
    for name, param in named_global_parameters(gpt, adapters=lora is not None):
        parameters[id(param)] = name
        shape = tuple(param.shape)
        if name in VOCAB_TENSORS:
            shape = (model.vocab_size,) + shape[1:]
        if lora is None and shape != mapping.megatron_tensor_shape(name, model):
            raise RuntimeError(
                f"megatron-core parameter {name!r} has shape {shape}, the mapping expects "
                f"{mapping.megatron_tensor_shape(name, model)}: convert/mapping.py is out of date"
            )
    sharded = gpt.sharded_state_dict()
    if lora is not None:
        sharded = {key: value for key, value in sharded.items() if is_adapter_name(key)}
    apply_factories(sharded)
    pieces: Dict[Tuple[str, Tuple[int, ...]], _StoredPiece] = {}

    def describe(value):
        if not isinstance(value, ShardedTensor):
            return value
        base = value.data if value.data._base is None else value.data._base  # SwiGLU halves are views
        view = value.data
        changes = {"data": None}
        if value.allow_shape_mismatch:  # the (padded) vocabulary: store the true one
            view = view[: model.vocab_size]
            changes.update(local_shape=tuple(view.shape), global_shape=tuple(view.shape))
        template = dataclasses.replace(value, **changes)
        pieces[(template.key, tuple(template.global_offset))] = _StoredPiece(
            template, parameters[id(base)], tuple(view.shape), tuple(view.stride()), view.storage_offset()
        )
        return template

    dict_list_map_inplace(describe, sharded)
    return sharded, pieces


# ----------------------------------------------------------------------------- writing


def _streaming_save_strategy(resolve: Callable[[str, Tuple[int, ...]], torch.Tensor]):
    """A torch_dist save strategy whose tensors come from ``resolve(key, global_offset)`` one at a time.

    megatron-core's own strategy stages every tensor before writing (it is built for async
    saves); this one hands torch.distributed.checkpoint's planner a resolver instead, so its
    serial writer asks for one piece, writes it and drops it.
    """
    from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.planner import WriteItemType

    class StreamingSavePlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            piece = resolve(write_item.index.fqn, tuple(write_item.index.offset))
            return piece.reshape(write_item.tensor_data.chunk.sizes)  # layer-stacked: [1, ...]

    class StreamingSaveStrategy(SaveShardedStrategy):
        @property
        def can_handle_sharded_objects(self):
            return True

        def save(self, sharded_state_dict, checkpoint_dir):
            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, keep_only_main_replica=True)
            save(
                mcore_to_pyt_state_dict(by_key, is_loading=False),
                storage_writer=FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1),
                planner=StreamingSavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False),
            )

    return StreamingSaveStrategy("torch_dist", 1)


def save_streaming_checkpoint(
    ckpt_dir: str | os.PathLike,
    model: ModelConfig,
    global_tensor: Callable[[str], torch.Tensor],
    describe_tensor: Callable[[str], torch.Tensor],
) -> None:
    """Write a torch_dist checkpoint of ``model`` whose tensors are produced on demand.

    ``global_tensor(name)`` returns one global Megatron tensor (true vocabulary, the dtype to
    store); it is called when the writer reaches that tensor's pieces, about once per tensor.
    ``describe_tensor(name)`` returns a meta tensor of the same shape and dtype (for planning).
    Also writes ``model_config.json``. Needs :func:`setup_megatron` in a single process.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    sharded, pieces = _tp1_layout(model)
    planned: Dict[str, torch.Tensor] = {}
    for piece in pieces.values():
        if piece.parameter not in planned:
            planned[piece.parameter] = describe_tensor(piece.parameter)
            expected = mapping.megatron_tensor_shape(piece.parameter, model)
            if tuple(planned[piece.parameter].shape) != expected:
                raise ValueError(
                    f"Megatron tensor {piece.parameter!r}: described shape "
                    f"{tuple(planned[piece.parameter].shape)}, the model needs {expected}"
                )

    def with_meta_data(value):
        if not isinstance(value, ShardedTensor):
            return value
        piece = pieces[(value.key, tuple(value.global_offset))]
        dtype = planned[piece.parameter].dtype
        return dataclasses.replace(
            piece.template, data=torch.empty(piece.size, dtype=dtype, device="meta"), dtype=dtype
        )

    dict_list_map_inplace(with_meta_data, sharded)
    last: Dict[str, torch.Tensor] = {}  # the SwiGLU halves of one tensor are written back to back

    def resolve(key: str, offset: Tuple[int, ...]) -> torch.Tensor:
        piece = pieces[(key, offset)]
        if piece.parameter not in last:
            last.clear()
            full = global_tensor(piece.parameter)
            expected = planned[piece.parameter]
            if full.shape != expected.shape or full.dtype != expected.dtype:
                raise ValueError(
                    f"Megatron tensor {piece.parameter!r}: got {tuple(full.shape)} {full.dtype}, "
                    f"planned {tuple(expected.shape)} {expected.dtype}"
                )
            last[piece.parameter] = full.contiguous()
        return piece.view_of(last[piece.parameter])

    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(sharded, str(ckpt_dir), sharded_strategy=_streaming_save_strategy(resolve))
    write_model_config(ckpt_dir, model)


# ----------------------------------------------------------------------------- reading


def read_checkpoint_tensors(
    ckpt_dir: str | os.PathLike, model: Optional[ModelConfig] = None, lora=None
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Global Megatron tensors of a torch_dist checkpoint, one at a time, in model order.

    Works for any checkpoint of this model's parameters under megatron-core's sharded keys,
    whatever TP/PP saved it (padded vocabularies are cut to ``model.vocab_size``). ``model``
    defaults to :func:`read_model_config`; with ``lora`` (a LoraConfig) the LoRA adapters of a
    LoRA training checkpoint instead. Yields ``(name, tensor)`` in the stored dtype.
    Raises ``KeyError`` naming a tensor the checkpoint lacks. Needs :func:`setup_megatron` in
    a single process.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistLoadShardedStrategy

    model = model or read_model_config(ckpt_dir)
    _, pieces = _tp1_layout(model, lora)
    stored = dist_checkpointing.load_tensors_metadata(str(ckpt_dir))
    by_parameter: Dict[str, List[_StoredPiece]] = {}
    for piece in pieces.values():
        if piece.template.key not in stored:
            raise KeyError(f"checkpoint {ckpt_dir} has no tensor {piece.template.key!r} (Megatron {piece.parameter!r})")
        by_parameter.setdefault(piece.parameter, []).append(piece)
    strategy = TorchDistLoadShardedStrategy()
    names = list(by_parameter) if lora is not None else mapping.megatron_tensor_names(model)
    for name in names:
        parts = by_parameter[name]
        shape = _global_shape(parts) if lora is not None else mapping.megatron_tensor_shape(name, model)
        full = torch.empty(shape, dtype=stored[parts[0].template.key].dtype)
        targets = [_single_piece_target(piece, full) for piece in parts]
        loaded = dist_checkpointing.load(
            {i: request for i, (request, _) in enumerate(targets)},
            str(ckpt_dir),
            sharded_strategy=strategy,
            validate_access_integrity=False,
        )
        for i, (_, target) in enumerate(targets):
            target.copy_(loaded[i])  # a no-op when megatron loaded in place, as it does
        yield name, full


def _global_shape(parts: List[_StoredPiece]) -> Tuple[int, ...]:
    """The shape of the global parameter ``parts`` tile (an adapter's: [r, in] or [out, r], fc1's B
    in two halves along its rows)."""
    rows = sum(part.size[0] for part in parts)
    return (rows,) + tuple(parts[0].size[1:])


def _single_piece_target(piece: _StoredPiece, full: torch.Tensor):
    """``(load request, target view)`` reading one piece straight into its place in ``full``.

    The request is the piece as an irregular shard of the whole stored tensor: megatron
    describes layer-stacked pieces (``prepend_axis_num`` > 0) as cells of a regular grid whose
    other cells belong to other ranks, and in a one-process world every cell would count as
    local. The explicit shape (``[1, ...]`` at the layer's offset, no grid) asks
    torch.distributed.checkpoint for exactly this piece.
    """
    template = piece.template
    local_shape = (1,) * template.prepend_axis_num + tuple(template.local_shape)
    target = piece.view_of(full).view(local_shape)  # pieces are row blocks: always a view
    request = dataclasses.replace(
        template, data=target, dtype=full.dtype, local_shape=local_shape, prepend_axis_num=0, axis_fragmentations=None
    )
    return request, target


# ----------------------------------------------------------------------------- conversions


# Where a run keeps its checkpoints (recipe/config.py: checkpoint.dir defaults to <run_dir>/checkpoints)
# and its resolved config (recipe/training.py writes <run_dir>/config.yaml).
RUN_CHECKPOINTS_DIR = "checkpoints"
RUN_CONFIG_FILE = "config.yaml"


def megatron_checkpoint_dir(path: str | os.PathLike) -> Optional[Path]:
    """The model-checkpoint directory at ``path``: itself, a training step's ``weights/``, or the
    newest complete step's ``weights/`` of a checkpoint root or of a run directory (its
    ``checkpoints/``); None when ``path`` is not a Megatron model checkpoint (e.g. a Hugging Face
    directory)."""
    from megatron_zcpo.checkpoint.io import MODEL_CONFIG_FILE, find_latest

    path = Path(path)
    steps = [find_latest(root) for root in (path, path / RUN_CHECKPOINTS_DIR)]
    for candidate in (path, path / "weights", *(step / "weights" for step in steps if step is not None)):
        if (candidate / MODEL_CONFIG_FILE).is_file():
            return candidate
    return None


def require_megatron_checkpoint(path: str | os.PathLike) -> Path:
    """:func:`megatron_checkpoint_dir`, or ``FileNotFoundError`` saying what to pass."""
    found = megatron_checkpoint_dir(path)
    if found is None:
        raise FileNotFoundError(
            f"{path} is not a Megatron checkpoint: pass a converted checkpoint (the directory with "
            f"model_config.json), a training step (<run_dir>/{RUN_CHECKPOINTS_DIR}/step_XXXXXXXX or its "
            f"weights/), a checkpoint directory or a run directory (its newest complete step is used)"
        )
    return found


def hf_files_of(checkpoint: str | os.PathLike) -> Optional[Path]:
    """The Hugging Face files (config.json, tokenizer) that belong with a Megatron model checkpoint:
    a converted checkpoint's ``hf/``, else, for a training step's ``weights/``, the tokenizer (or
    the ``model.path``, its ``hf/`` when converted) of the run that saved it, read from the run
    directory's config.yaml; None when neither is there."""
    import yaml

    checkpoint = Path(checkpoint)
    if (checkpoint / HF_FILES_DIR).is_dir():
        return checkpoint / HF_FILES_DIR
    run_config = checkpoint.absolute().parent.parent.parent / RUN_CONFIG_FILE  # <run>/checkpoints/step_N/weights
    if not run_config.is_file():
        return None
    model = (yaml.safe_load(run_config.read_text()) or {}).get("model") or {}
    for key in ("tokenizer", "path"):
        if model.get(key):
            source = Path(model[key])
            source = source / HF_FILES_DIR if (source / HF_FILES_DIR).is_dir() else source
            if (source / hf_checkpoint.CONFIG_FILE).is_file() or any(
                (source / name).is_file() for name in hf_checkpoint.ASSET_FILES
            ):
                return source
    return None


def model_config_at(path: str | os.PathLike) -> ModelConfig:
    """The architecture stored at ``path``: a Megatron model checkpoint or a Hugging Face directory."""
    checkpoint = megatron_checkpoint_dir(path)
    if checkpoint is not None:
        return read_model_config(checkpoint)
    return mapping.model_config_from_hf(hf_checkpoint.read_hf_config(path))


def _mtp_names(source, hf_config: dict, mtp: Optional[str], hf_dir) -> List[str]:
    """The multi-token-prediction tensors of ``source`` (DeepSeek-V3's ``model.layers.{L + j}.*``);
    ``ValueError`` when it has some and ``mtp`` does not say whether to drop or keep them."""
    if mtp is not None and mtp not in MTP_CHOICES:
        raise ValueError(f"mtp={mtp!r}: choose one of {MTP_CHOICES}")
    names = [name for name in source.names() if deepseek.mtp_layer_of(name, hf_config) is not None]
    if names and mtp is None:
        layers = hf_config.get(deepseek.MTP_LAYERS)
        raise ValueError(
            f"{hf_dir} has {layers} multi-token-prediction layer(s) (config.json {deepseek.MTP_LAYERS}={layers}: "
            f"{names[0]}, ...), which the policy does not use: pass --mtp drop (the converted model and its way "
            f"back have none) or --mtp keep (carried through unchanged, not trained: SGLang's speculative decoding)"
        )
    return names


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike, ckpt_dir: str | os.PathLike, *, overwrite: bool = False, mtp: Optional[str] = None
) -> ModelConfig:
    """Convert a Hugging Face model directory into a Megatron checkpoint loadable at any TP/PP.

    Reads config.json and the safetensors shards one tensor at a time (blockwise-FP8 weights
    dequantised to bf16, :mod:`megatron_zcpo.convert.fp8`), checks every name and shape first (meta
    tensors, no data read, nothing written yet), then writes ``ckpt_dir`` (see the module docstring)
    whole or not at all (:func:`~megatron_zcpo.convert.output_dir.atomic_output_dir`: a non-empty
    ``ckpt_dir`` is refused unless ``overwrite``). DeepSeek-V3's multi-token-prediction layers must be
    dropped or kept (``mtp`` "drop" / "keep", :func:`_mtp_names`); kept ones go to ``hf/`` unchanged
    (:data:`MTP_FILE_PREFIX`). Raises naming the offending tensor: ``KeyError`` when one is missing,
    ``ValueError`` on a shape mismatch or a tensor the mapping does not know. Returns the model
    config. Writing needs :func:`setup_megatron` in a single process.
    """
    hf_config = hf_checkpoint.read_hf_config(hf_dir)
    model = mapping.model_config_from_hf(hf_config)
    with fp8.open_hf_weights(hf_dir, hf_config) as source:
        mtp_names = _mtp_names(source, hf_config, mtp, hf_dir)
        known = set(mapping.hf_tensor_names(model)) | set(mtp_names)
        unknown = [
            name for name in source.names() if name not in known and not mapping.is_ignored_hf_tensor(name, model)
        ]
        if unknown:
            raise ValueError(
                f"{hf_dir}: tensor(s) {unknown[:8]} have no Megatron counterpart in a "
                f"{model.family} model (a different architecture?)"
            )
        # Every name, shape and dtype is checked on meta tensors before anything is written.
        planned = {
            name: mapping.hf_to_megatron_tensor(name, source.meta, model)
            for name in mapping.megatron_tensor_names(model)
        }
        files_config = fp8.dequantized_config(hf_config)
        if mtp_names and mtp == "drop":
            files_config[deepseek.MTP_LAYERS] = 0
        with atomic_output_dir(ckpt_dir, overwrite=overwrite, source=hf_dir) as out:
            save_streaming_checkpoint(
                out,
                model,
                global_tensor=lambda name: mapping.hf_to_megatron_tensor(name, source.tensor, model),
                describe_tensor=planned.__getitem__,
            )
            hf_checkpoint.write_hf_config(out / HF_FILES_DIR, files_config)
            hf_checkpoint.copy_hf_assets(hf_dir, out / HF_FILES_DIR)
            if mtp_names and mtp == "keep":
                hf_checkpoint.write_safetensors_shards(
                    out / HF_FILES_DIR,
                    ((name, source.tensor(name)) for name in mtp_names),
                    file_prefix=MTP_FILE_PREFIX,
                    write_index=False,
                )
    return model


def kept_mtp_tensors(hf_files: Optional[Path]) -> Iterator[Tuple[str, torch.Tensor]]:
    """The multi-token-prediction tensors a conversion kept in ``hf_files`` (none when it has none),
    one at a time."""
    from safetensors import safe_open

    if hf_files is None:
        return
    for path in sorted(hf_files.glob(f"{MTP_FILE_PREFIX}-*.safetensors")):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():  # noqa: SIM118 -- safe_open is not iterable
                yield name, shard.get_tensor(name)


def _set_dtype_field(config: dict, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    key = "dtype" if "dtype" in config else "torch_dtype"  # transformers>=5 / <5 spelling
    config[key] = name


def convert_megatron_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: Optional[torch.dtype] = None,
    max_shard_bytes: int = hf_checkpoint.DEFAULT_MAX_SHARD_BYTES,
    model: Optional[ModelConfig] = None,
    overwrite: bool = False,
    hf_files: Optional[str | os.PathLike] = None,
) -> ModelConfig:
    """Convert a Megatron checkpoint into a Hugging Face model directory.

    ``ckpt_dir``: a model checkpoint, a training step, a checkpoint root or a run directory
    (:func:`megatron_checkpoint_dir`). Streams the checkpoint one tensor at a time into sharded
    safetensors with an index (at most one shard of ``max_shard_bytes`` in memory), cast to
    ``dtype`` when given (else the stored dtype), and writes config.json from the model config (on
    top of the original one when known) plus the tokenizer and generation files of ``hf_files``
    (default :func:`hf_files_of`: the converted checkpoint's ``hf/`` or the training run's model).
    ``out_dir`` is written whole or not at all (:func:`~megatron_zcpo.convert.output_dir.atomic_output_dir`:
    a non-empty one is refused unless ``overwrite``). ``model`` defaults to the checkpoint's
    ``model_config.json``. Multi-token-prediction layers kept by the conversion (``hf_files``'
    :data:`MTP_FILE_PREFIX` shards) are written after the model's tensors, unchanged. Needs
    :func:`setup_megatron` in a single process.
    """
    ckpt_dir = require_megatron_checkpoint(ckpt_dir)
    model = model or read_model_config(ckpt_dir)
    hf_files = Path(hf_files) if hf_files is not None else hf_files_of(ckpt_dir)
    has_config = hf_files is not None and (hf_files / hf_checkpoint.CONFIG_FILE).is_file()
    base = hf_checkpoint.read_hf_config(hf_files) if has_config else None
    stored_dtypes: set = set()

    def stored_tensors() -> Iterator[Tuple[str, torch.Tensor]]:
        for name, tensor in read_checkpoint_tensors(ckpt_dir, model):
            stored_dtypes.add(tensor.dtype)
            yield name, tensor

    with atomic_output_dir(out_dir, overwrite=overwrite, source=ckpt_dir) as out:
        stream = itertools.chain(
            mapping.megatron_to_hf_stream(stored_tensors(), model, dtype), kept_mtp_tensors(hf_files)
        )
        hf_checkpoint.write_safetensors_shards(out, stream, max_shard_bytes)
        config = mapping.hf_config_from_model_config(model, base)
        written = {dtype} if dtype is not None else stored_dtypes
        if len(written) == 1:
            _set_dtype_field(config, written.pop())
        hf_checkpoint.write_hf_config(out, config)
        if hf_files is not None:
            hf_checkpoint.copy_hf_assets(hf_files, out)
    return model


def check_parallel_layout(
    model: ModelConfig,
    tensor_parallel: int,
    pipeline_parallel: int,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> None:
    """Raise ``ValueError`` naming the field when ``model`` cannot be split ``tensor_parallel`` x
    ``pipeline_parallel`` (with the first / last stage's layer counts when given: uneven stages) and
    its experts ``expert_parallel`` x ``expert_tensor_parallel`` (None: as TP)."""
    for field in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "shared_expert_intermediate_size"):
        if getattr(model, field) % tensor_parallel:
            raise ValueError(
                f"{field}={getattr(model, field)} is not divisible by tensor parallelism {tensor_parallel}"
            )
    tool_flags = ("--pp", "--first-stage-layers", "--last-stage-layers")
    pipeline_stage_layers(model.num_layers, pipeline_parallel, first_stage_layers, last_stage_layers, tool_flags)
    expert_tensor_parallel = expert_tensor_parallel or tensor_parallel
    if not model.is_moe:
        if expert_parallel != 1:
            raise ValueError(f"expert parallelism {expert_parallel}: the {model.family} model has no experts")
        return
    if model.num_experts % expert_parallel:
        raise ValueError(
            f"num_experts={model.num_experts} is not divisible by expert parallelism {expert_parallel}: "
            f"each expert-parallel rank must hold the same number of whole experts"
        )
    if model.moe_intermediate_size % expert_tensor_parallel:
        raise ValueError(
            f"moe_intermediate_size={model.moe_intermediate_size} is not divisible by expert tensor "
            f"parallelism {expert_tensor_parallel}"
        )
