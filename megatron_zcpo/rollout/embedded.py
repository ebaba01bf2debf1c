"""In-process rollout engine: batched KV-cache sampling with a Hugging Face model (CPU default, tests)."""

from __future__ import annotations

import inspect
import re
import threading
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch

from megatron_zcpo.rollout.engine import (
    Completion,
    RolloutEngine,
    RolloutError,
    RolloutInterrupted,
    SamplingParams,
    validate_prompts,
)
from megatron_zcpo.rollout.memory import KV_CACHE, WEIGHTS, EngineMemory


def filter_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the probabilities that top-k and top-p exclude (not renormalised).

    probs: [B, V]. top-k keeps the ``top_k`` most likely tokens (``top_k`` <= 0: all); top-p keeps
    the smallest most-likely set whose mass reaches ``top_p`` (the most likely token always
    stays). Both filters are measured on ``probs`` itself and a token must pass both, as in
    SGLang's PyTorch sampler, so the order of the two does not matter. Returns [B, V].
    """
    vocab = probs.shape[-1]
    if (top_k <= 0 or top_k >= vocab) and top_p >= 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if 0 < top_k < vocab:
        drop[:, top_k:] = True
    if top_p < 1.0:
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop |= mass_before > top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row and return it with its log-prob (see :class:`Completion`).

    logits: [B, V] (any float dtype, computed in fp32). Greedy when ``params.temperature`` is 0.
    Otherwise draws from softmax(logits / T) filtered by top-k/top-p, with the exponential race
    (argmax p_v / E_v, E_v ~ Exp(1)), which is exact categorical sampling and vectorised.
    Returns (tokens [B] int64, logprobs [B] fp32), log-probs of the unfiltered distribution.
    """
    logits = logits.float()
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logits.argmax(dim=-1)
    else:
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        probs = filter_top_k_top_p(logprobs.exp(), params.top_k, params.top_p)
        race = torch.empty_like(probs).exponential_(generator=generator)
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad prompts into a batch.

    Returns (input_ids [B, P] int64, attention_mask [B, P] int64 with 0 on padding,
    position_ids [B, P] int64 counting from 0 at each prompt's first real token, 0 on padding).
    """
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return input_ids, attention_mask, position_ids


def build_hf_causal_lm(model_config, dtype: torch.dtype = torch.float32, device=None) -> torch.nn.Module:
    """An untrained transformers causal LM (Qwen2 / Qwen3 / Llama) with ``model_config``'s architecture, eval mode."""
    import transformers

    from megatron_zcpo.convert.mapping import hf_config_from_model_config

    hf_config = transformers.AutoConfig.for_model(**hf_config_from_model_config(model_config))
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    return model.to(device=device or "cpu", dtype=dtype).eval()


_PER_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight$")


def _row_routing(
    prefill: torch.Tensor, decode: List[torch.Tensor], row: int, prompt_length: int, output_length: int
) -> torch.Tensor:
    """One completion's experts, int32 [prompt + output - 1, layers * k]: its prompt tokens (the last
    ``prompt_length`` of its left-padded prefill row [T, layers, k]), then every output token but
    the last (decode step s fed output token s)."""
    steps = [step[row, 0] for step in decode[: output_length - 1]]
    routing = torch.cat([prefill[prefill.shape[0] - prompt_length :], *[s.unsqueeze(0) for s in steps]])
    return routing.reshape(routing.shape[0], -1)


class EmbeddedEngine(RolloutEngine):
    """Samples in this process from a transformers model holding the pushed policy weights.

    Weights arrive through :meth:`update_weights` with Hugging Face names (the same stream the
    SGLang push sends, from :func:`megatron_zcpo.rollout.weight_sync.iter_hf_weights`).
    Prompts are left-padded and decoded together with a KV cache, ``max_batch_size`` rows
    (prompts x samples) at a time; each prompt is prefilled once per batch and its cache copied
    to its samples (what SGLang's prefix cache does for a group). ``quantization="fp8"`` rounds every pushed linear weight to
    FP8 E4M3 with a per-tensor scale (what an FP8 SGLang server holds), to exercise quantised
    rollouts and the trainer's importance-sampling correction on a CPU. ``memory_saver``: the engine
    releases and resumes its "weights" and "kv_cache" like an SGLang server launched with
    ``--enable-memory-saver`` (released weights are freed and come back as NaN until pushed again;
    generating or loading into released memory raises :class:`~megatron_zcpo.rollout.memory.MemoryPhaseError`),
    so colocated placement runs its phases on a CPU. ``record_routed_experts``
    (mixture-of-experts models): each completion carries the experts every input token was routed
    to, as SGLang's ``return_routed_experts`` returns them (:attr:`Completion.routed_experts`).
    """

    def __init__(
        self,
        model_config,
        *,
        dtype: torch.dtype = torch.float32,
        device=None,
        max_batch_size: int = 256,
        seed: int = 0,
        quantization: Optional[str] = None,
        pad_token_id: int = 0,
        record_routed_experts: bool = False,
        memory_saver: bool = False,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if quantization not in (None, "fp8"):
            raise ValueError(f"quantization must be None or 'fp8', got {quantization!r}")
        self.model_config = model_config
        self.device = torch.device(device or "cpu")
        self.model = build_hf_causal_lm(model_config, dtype, self.device)
        self.max_batch_size = max_batch_size
        self.quantization = quantization
        self.pad_token_id = pad_token_id
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self._seed = seed
        self._async = None  # the AsyncBatcher of submit(), started on first use
        self._interrupted = threading.Event()  # interrupt_generation(): generate() stops between decode steps
        # Tied embeddings appear under both names here; either name loads the shared tensor.
        self._targets: Dict[str, torch.Tensor] = dict(self.model.state_dict(keep_vars=True))
        self._loaded: Set[str] = set()
        self._version = -1
        forward_args = inspect.signature(self.model.forward).parameters
        # transformers 5 renamed past_key_values to cache; older releases lack logits_to_keep.
        self._cache_kwarg = "cache" if "cache" in forward_args else "past_key_values"
        self._last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward_args else {}
        self._routing: Optional[Dict[int, torch.Tensor]] = None  # layer -> the last forward's experts [B*T, k]
        if record_routed_experts:
            self._record_routers()
        self.memory: Optional[EngineMemory] = None
        if memory_saver:
            self._weight_sizes = [storage.nbytes() for storage in self._weight_storages()]
            self.memory = EngineMemory(
                "embedded", [0], {WEIGHTS: sum(self._weight_sizes), KV_CACHE: 0}, tags=(WEIGHTS, KV_CACHE)
            )

    def _record_routers(self) -> None:
        """Hook every MoE router (transformers' ``model.layers.{i}.mlp.gate``: (logits, weights, experts))."""
        if not getattr(self.model_config, "is_moe", False):
            raise ValueError(f"record_routed_experts: the {self.model_config.family} model has no routers")
        self._routing = {}
        for name, module in self.model.named_modules():
            parts = name.split(".")
            if len(parts) == 5 and parts[:2] == ["model", "layers"] and parts[3:] == ["mlp", "gate"]:
                layer = int(parts[2])
                module.register_forward_hook(lambda _m, _i, out, layer=layer: self._routing.__setitem__(layer, out[2]))

    # -- memory saver (colocated placement) ----------------------------------------------------

    def _weight_storages(self) -> List[torch.UntypedStorage]:
        found: Dict[int, torch.UntypedStorage] = {}
        for parameter in self.model.parameters():
            storage = parameter.untyped_storage()
            found.setdefault(storage._cdata, storage)
        return list(found.values())

    def memory_tags(self) -> Tuple[str, ...]:
        return self.memory.tags if self.memory is not None else ()

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Release ``tags`` (see :class:`EmbeddedEngine`): the parameters' storages shrink to 0 bytes."""
        if self.memory is None:
            super().release_memory(tags)
        if WEIGHTS in self.memory.release(tags):
            for storage in self._weight_storages():
                storage.resize_(0)
            self._loaded = set()  # the content is gone: every tensor must be pushed again

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """Resume ``tags``; resumed weights hold NaN until the next push."""
        if self.memory is None:
            super().resume_memory(tags)
        if WEIGHTS in self.memory.resume(tags):
            for storage, size in zip(self._weight_storages(), self._weight_sizes):
                storage.resize_(size)
            for parameter in self.model.parameters():
                parameter.data.fill_(float("nan"))

    # -- weights -----------------------------------------------------------------------------

    @torch.no_grad()
    def update_weights(self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Copy each (Hugging Face name, tensor) into the model; see :meth:`RolloutEngine.update_weights`.

        Raises ``KeyError`` naming a tensor the model does not have and ``ValueError`` naming
        one whose shape differs.
        """
        if self.quantization == "fp8":
            from megatron_zcpo.rollout.quantization import fake_quantize_fp8_hf_weights

            named_hf_tensors = fake_quantize_fp8_hf_weights(named_hf_tensors)
        if self.memory is not None:
            self.memory.require("update_weights")
        if self._async is not None:  # no decode step may read a half-loaded model
            self._async.pause()
        try:
            self._load(named_hf_tensors)
        finally:
            if self._async is not None:
                self._async.resume()
        self._version = int(version)

    def _load(self, named_hf_tensors: Iterable[Tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_hf_tensors:
            name, target = self._target_of(name)
            if target is None:
                raise KeyError(
                    f"pushed tensor {name!r} is not a parameter of the embedded {self.model_config.family} model"
                )
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"pushed tensor {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}"
                )
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
            self._loaded.add(name)

    def _target_of(self, name: str):
        """(name, tensor to copy into) of a pushed Hugging Face tensor. transformers>=5 keeps an MoE
        layer's experts fused (``mlp.experts.gate_up_proj`` [E, 2F, H], ``down_proj`` [E, H, F]);
        a pushed expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` is its slice of those."""
        target = self._targets.get(name)
        match = _PER_EXPERT.match(name) if target is None else None
        if match is None:
            return name, target
        prefix, expert, projection = match.group(1), int(match.group(2)), match.group(3)
        fused_name = prefix + ("down_proj" if projection == "down" else "gate_up_proj")
        fused = self._targets.get(fused_name)
        if fused is None:
            return name, None
        if projection == "down":
            return fused_name, fused[expert]
        half = fused.shape[1] // 2
        return fused_name, fused[expert, :half] if projection == "gate" else fused[expert, half:]

    def weight_version(self) -> int:
        return self._version

    def _check_loaded(self) -> None:
        if self.model is None:
            raise RolloutError("the embedded engine was shut down")
        loaded = {id(self._targets[name]) for name in self._loaded}
        missing = sorted(name for name, tensor in self._targets.items() if id(tensor) not in loaded)
        if missing:
            raise RolloutError(f"embedded engine has not received weights for {missing[:5]} ({len(missing)} tensors)")

    # -- sampling ----------------------------------------------------------------------------

    @torch.inference_mode()
    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams, n: int = 1, affinity=None
    ) -> List[List[Completion]]:
        """Sample ``n`` responses per prompt; see :meth:`RolloutEngine.generate` and :class:`Completion`
        (``affinity`` changes nothing: one model in this process).

        With ``params.seed`` set, the result depends only on the seed, the prompts, ``n``, the
        weights and ``max_batch_size``.
        """
        if self.memory is not None:
            self.memory.require("generate")
        self._check_loaded()
        self._raise_if_interrupted()
        params.validate(self.model_config.vocab_size)
        validate_prompts(prompts, n, self.model_config.vocab_size)
        context = self.model_config.max_position_embeddings
        for row, prompt in enumerate(prompts):
            if len(prompt) >= context:
                raise ValueError(f"prompt {row} has {len(prompt)} tokens; the model's context is {context}")
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(int(params.seed))
        # Rows are prompt-major (the n samples of a prompt are consecutive); each batch of rows
        # prefills every prompt it holds once and copies the prompt's KV cache to its samples.
        owners = [p for p in range(len(prompts)) for _ in range(n)]
        completions: List[Completion] = []
        for start in range(0, len(owners), self.max_batch_size):
            batch_owners = owners[start : start + self.max_batch_size]
            completions += self._generate_batch(
                [list(prompts[p]) for p in batch_owners], batch_owners, params, generator
            )
        return [completions[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _routed(self, rows: int) -> Optional[torch.Tensor]:
        """The last forward's experts as int32 [rows, T, num_layers, k] (zeros for dense layers), or None."""
        if self._routing is None:
            return None
        top_k, layers = self.model_config.num_experts_per_tok, self.model_config.num_layers
        first = next(iter(self._routing.values()))
        tokens = first.shape[0] // rows
        out = torch.zeros(rows, tokens, layers, top_k, dtype=torch.int32)
        for layer, experts in self._routing.items():
            out[:, :, layer] = experts.reshape(rows, tokens, top_k).cpu().int()
        return out

    def _forward(self, input_ids, attention_mask, position_ids, cache):
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            position_ids=position_ids.to(self.device),
            use_cache=True,
            **{self._cache_kwarg: cache},
            **self._last_logits_only,
        )
        return out.logits[:, -1], getattr(out, self._cache_kwarg)

    def _prefill(self, rows: List[List[int]], owners: List[int]):
        """Prefill the batch ``rows`` (token ids; ``owners[i]`` names row i's input, equal owners are
        consecutive and share one prefill). Returns (logits [B, V], cache, attention_mask [B, P],
        next_position [B, 1], expand [B]: row -> its row in the prefill batch, prefill routing or None)."""
        batch = len(rows)
        owner = torch.tensor(owners)
        first = torch.ones(batch, dtype=torch.bool)
        first[1:] = owner[1:] != owner[:-1]
        expand = torch.cumsum(first.long(), 0) - 1  # row -> its prompt's row in the prefill batch
        unique_rows = [r for r, is_first in zip(rows, first.tolist()) if is_first]
        input_ids, attention_mask, position_ids = left_pad(unique_rows, self.pad_token_id)
        logits, cache = self._forward(input_ids, attention_mask, position_ids, None)
        prefill_routing = self._routed(len(unique_rows))  # [unique rows, padded prompt, layers, k] or None
        if len(unique_rows) < batch:
            cache.batch_select_indices(expand.to(self.device))
            logits, attention_mask, position_ids = (
                logits[expand.to(logits.device)],
                attention_mask[expand],
                position_ids[expand],
            )
        return logits, cache, attention_mask, position_ids[:, -1:] + 1, expand, prefill_routing

    def _decode_step(self, tokens: torch.Tensor, attention_mask, next_position, cache):
        """Feed one sampled token per row [B]; returns (logits [B, V], cache, attention_mask, next_position)."""
        attention_mask = torch.cat([attention_mask, torch.ones(len(tokens), 1, dtype=torch.long)], dim=1)
        logits, cache = self._forward(tokens[:, None], attention_mask, next_position, cache)
        return logits, cache, attention_mask, next_position + 1

    def _generate_batch(
        self, rows: List[List[int]], owners: List[int], params: SamplingParams, generator
    ) -> List[Completion]:
        """Sample the batch ``rows`` (token ids; ``owners[i]`` names row i's prompt, equal owners are
        consecutive and share one prefill)."""
        batch = len(rows)
        context = self.model_config.max_position_embeddings
        budgets = torch.tensor([min(params.max_new_tokens, context - len(r)) for r in rows])
        stop_ids = torch.tensor(params.stop_token_ids or [-1], dtype=torch.long)
        logits, cache, attention_mask, next_position, expand, prefill_routing = self._prefill(rows, owners)
        decode_routing = []  # per step [batch, 1, layers, k]: the routing of that step's sampled token
        tokens_out, logprobs_out = [], []
        lengths = torch.zeros(batch, dtype=torch.long)
        stopped = torch.zeros(batch, dtype=torch.bool)
        finished = torch.zeros(batch, dtype=torch.bool)
        for _ in range(int(budgets.max())):
            self._raise_if_interrupted()
            tokens, logprobs = sample_next_tokens(logits, params, generator)
            tokens, logprobs = tokens.cpu(), logprobs.cpu()
            tokens_out.append(tokens)
            logprobs_out.append(logprobs)
            lengths += (~finished).long()
            stopped |= ~finished & torch.isin(tokens, stop_ids)
            finished |= stopped | (lengths >= budgets)
            if bool(finished.all()):
                break
            # Finished rows keep decoding (cheaper than reshaping the cache); their tokens are cut off.
            logits, cache, attention_mask, next_position = self._decode_step(
                tokens, attention_mask, next_position, cache
            )
            if prefill_routing is not None:
                decode_routing.append(self._routed(batch))
        all_tokens = torch.stack(tokens_out, dim=1).tolist()
        all_logprobs = torch.stack(logprobs_out, dim=1).tolist()
        return [
            Completion(
                prompt_ids=rows[i],
                output_ids=all_tokens[i][: int(lengths[i])],
                output_logprobs=all_logprobs[i][: int(lengths[i])],
                finish_reason="stop" if bool(stopped[i]) else "length",
                weight_version=self._version,
                routed_experts=None
                if prefill_routing is None
                else _row_routing(prefill_routing[int(expand[i])], decode_routing, i, len(rows[i]), int(lengths[i])),
            )
            for i in range(batch)
        ]

    def interrupt_generation(self) -> None:
        """From any thread: :meth:`generate` raises :class:`RolloutInterrupted` before its next decode step
        (a step of the whole batch: milliseconds on a small model), and at once until :meth:`clear_interrupt`."""
        self._interrupted.set()

    def clear_interrupt(self) -> None:
        self._interrupted.clear()

    def _raise_if_interrupted(self) -> None:
        if self._interrupted.is_set():
            raise RolloutInterrupted("the embedded engine's generation was interrupted (a stop request)")

    # -- asynchronous requests (rollout.mode=async) --------------------------------------------

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams, n: int = 1):
        """Sample ``n`` responses to one prompt on the engine's scheduler thread; see
        :meth:`RolloutEngine.submit` and :mod:`megatron_zcpo.rollout.embedded_async`."""
        if self._routing is not None:
            raise RolloutError("asynchronous requests do not record routed experts (train.routing_replay)")
        if self.memory is not None:
            self.memory.require("generate")
        self._check_loaded()
        params.validate(self.model_config.vocab_size)
        validate_prompts([prompt_ids], n, self.model_config.vocab_size)
        if len(prompt_ids) >= self.model_config.max_position_embeddings:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens; the model's context is {self.model_config.max_position_embeddings}"
            )
        if self._async is None:
            from megatron_zcpo.rollout.embedded_async import AsyncBatcher

            self._async = AsyncBatcher(
                self, torch.Generator(device=self.device).manual_seed(self._seed), sample_next_tokens
            )
        return self._async.submit(prompt_ids, params, n)

    def pause_generation(self) -> None:
        """Hold the asynchronous requests (returns once no decode step runs); they keep their tokens."""
        if self._async is not None:
            self._async.pause()

    def continue_generation(self) -> None:
        """Continue the held requests from their tokens, with the weights the engine holds now."""
        if self._async is not None:
            self._async.resume()

    def abort_requests(self, futures=None) -> int:
        """End every asynchronous request now (or those of ``futures``, futures of :meth:`submit`): each
        future resolves with the tokens it has ("abort")."""
        return self._async.abort(futures) if self._async is not None else 0

    def shutdown(self) -> None:
        """Drop the model (frees its memory); the engine cannot generate afterwards."""
        if self._async is not None:
            self._async.close()
            self._async = None
        self.model = None
        self._targets, self._loaded = {}, set()
