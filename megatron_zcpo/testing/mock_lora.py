"""The mock SGLang server's LoRA serving (``--enable-lora``): adapters loaded by name, ``/generate`` with ``lora_path``.

Mixed into :class:`megatron_zcpo.testing.mock_server.MockSGLangServer`. Behaviour and messages follow
SGLang 0.5.3.post3 and 0.5.23 as :mod:`megatron_zcpo.rollout.sglang.api` lists them: a loaded name
is refused again, an adapter above ``--max-lora-rank`` or outside ``--lora-target-modules`` is
refused, every LoRA request to a server without ``--enable-lora`` is refused, unloading an unknown
name is refused, a ``/generate`` naming an adapter that is not loaded is refused (0.5.23 reloads
one it had loaded before, from its path). Each answer is ``{success, error_message,
loaded_adapters: {name: path}}``, 200 or 400. A ``/generate`` runs on the base merged with the
named adapter (W + (alpha/r) B A, when the backend is an embedded engine holding weights), and a
full weight push skips the adapted projections, as SGLang's renamed ``base_layer`` weights make it.
``/load_lora_adapter_from_tensors`` (0.5.23) reads one blob: a ForkingPickler dump of {PEFT name: tensor}.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from megatron_zcpo.rollout.sglang.api import PINNED_RELEASE

_PEFT_PREFIX = "base_model.model."


class LoraEndpoints:
    """State and handlers of LoRA serving; :meth:`_init_lora` from the server's constructor.

    ``loaded_adapters`` {name: path} as the server holds them; ``lora_requests`` the ``lora_path``
    of every /generate (None: the base), for tests."""

    def _init_lora(self, enable_lora: bool, max_lora_rank: Optional[int], lora_target_modules: Sequence[str]) -> None:
        self.enable_lora, self.max_lora_rank = enable_lora, max_lora_rank
        self.lora_target_modules = list(lora_target_modules)
        self.loaded_adapters: Dict[str, str] = {}
        self.lora_requests: List[Optional[str]] = []
        self._ever_loaded: Dict[str, str] = {}  # 0.5.23's lora_ref_cache: name -> path
        self._updates: Dict[str, Dict[str, torch.Tensor]] = {}  # name -> {HF weight name: W + s B A}
        self._base: Optional[Dict[str, torch.Tensor]] = None  # the adapted projections' base weights
        self._serving: Optional[str] = None  # the adapter the backend's weights hold now
        self._lora_lock = threading.Lock()
        self._handlers.update(
            {
                "/load_lora_adapter": self._load_lora_adapter,
                "/unload_lora_adapter": self._unload_lora_adapter,
                "/load_lora_adapter_from_tensors": self._load_lora_adapter_from_tensors,
            }
        )

    def lora_server_info(self) -> dict:
        """The LoRA fields of ``/get_server_info`` (ServerArgs's)."""
        return {
            "enable_lora": self.enable_lora or None,
            "max_lora_rank": self.max_lora_rank,
            "lora_target_modules": self.lora_target_modules or None,
        }

    def _lora_answer(self, success: bool, message: Optional[str] = None):
        from aiohttp import web

        error = message if message is not None else ("" if self.release == PINNED_RELEASE else None)
        body = {"success": success, "error_message": error, "loaded_adapters": dict(self.loaded_adapters)}
        return web.json_response(body, status=200 if success else 400)

    def _not_enabled(self) -> Optional[str]:
        return None if self.enable_lora else "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."

    async def _load_lora_adapter(self, request):
        body = await request.json()
        refusal = self._not_enabled()
        if refusal is None:
            try:
                refusal = await self._blocking(self._load_adapter, body["lora_name"], body["lora_path"], None, None)
            except (OSError, ValueError, KeyError) as err:
                refusal = f"Failed to load LoRA adapter {body['lora_name']}: {err}"
        return self._lora_answer(refusal is None, refusal)

    async def _load_lora_adapter_from_tensors(self, request):
        from multiprocessing.reduction import ForkingPickler

        body = await request.json()
        refusal = self._not_enabled()
        if refusal is None:
            blobs = body["serialized_named_tensors"]
            tensors = ForkingPickler.loads(base64.b64decode(blobs[0], validate=True))
            refusal = await self._blocking(
                self._load_adapter, body["lora_name"], "__tensor__", dict(tensors), body["config_dict"]
            )
        return self._lora_answer(refusal is None, refusal)

    async def _unload_lora_adapter(self, request):
        body = await request.json()
        refusal = self._not_enabled()
        name = body["lora_name"]
        if refusal is None and name not in self.loaded_adapters:
            refusal = f"LoRA with name {name} does not exist. Loaded LoRAs: {list(self.loaded_adapters)}"
        if refusal is None:
            with self._lora_lock:
                del self.loaded_adapters[name]
                self._updates.pop(name, None)
        return self._lora_answer(refusal is None, refusal)

    def _load_adapter(
        self, name: str, path: str, tensors: Optional[Dict[str, torch.Tensor]], config: Optional[dict]
    ) -> Optional[str]:
        """Load adapter ``name`` from the PEFT folder ``path`` (or ``tensors`` + ``config``); the refusal or None."""
        if name in self.loaded_adapters:
            return f"Failed to load LoRA adapter {name} because it is already loaded"
        if tensors is None:
            from safetensors.torch import load_file

            config = json.loads((Path(path) / "adapter_config.json").read_text())
            tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        modules = set(config["target_modules"])
        if (self.max_lora_rank is not None and config["r"] > self.max_lora_rank) or not modules <= set(
            self.lora_target_modules
        ):
            return (
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA memory pool "
                "configuration. Please ensure that the LoRA adapter's rank is within the configured "
                "`--max-lora-rank` and that the target modules are included in `--lora-target-modules`."
            )
        with self._lora_lock:
            self.loaded_adapters[name] = path
            self._ever_loaded[name] = path
            self._updates[name] = self._merged(tensors, config["lora_alpha"] / config["r"])
        return None

    def _merged(self, tensors: Dict[str, torch.Tensor], scaling: float) -> Dict[str, torch.Tensor]:
        """{HF weight name: W + scaling B A} of every adapted projection (empty without backend weights)."""
        base = self._base_weights()
        merged = {}
        for key, a in tensors.items():
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len(_PEFT_PREFIX) : -len(".lora_A.weight")]
            b = tensors[key.replace(".lora_A.", ".lora_B.")]
            if module + ".weight" in base:
                weight = base[module + ".weight"]
                merged[module + ".weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
        return merged

    def _base_weights(self) -> Dict[str, torch.Tensor]:
        """The adapted projections' base weights (taken from the backend once, before any adapter)."""
        if self._base is None:
            model = getattr(self.backend, "model", None)
            state = {} if model is None else model.state_dict()
            self._base = {
                name: tensor.detach().clone()
                for name, tensor in state.items()
                if any(f".{module}." in name for module in self.lora_target_modules)
            }
        return self._base

    def lora_refusal(self, body: dict) -> Optional[str]:
        """Why a /generate naming ``body["lora_path"]`` must be refused (reloading, on 0.5.23, an adapter
        loaded once before), or None; records the request's adapter."""
        name = body.get("lora_path")
        self.lora_requests.append(name)
        if name is None:
            return None
        if not self.enable_lora:
            return (
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )
        if name in self.loaded_adapters:
            return None
        if self.release == PINNED_RELEASE:
            return f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: {list(self.loaded_adapters)}."
        if name not in self._ever_loaded:
            return (
                f"Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: {list(self._ever_loaded)}."
            )
        try:
            refusal = self._load_adapter(name, self._ever_loaded[name], None, None)
        except (OSError, ValueError, KeyError) as err:
            refusal = f"Failed to implicitly load LoRA adapter {name}: {err}"
        return refusal

    def serve_adapter(self, name: Optional[str]) -> None:
        """Have the backend's weights hold ``name``'s merged projections (None: the base); under the backend lock."""
        if name == self._serving or not hasattr(self.backend, "model"):
            return
        weights = dict(self._base_weights())
        weights.update(self._updates.get(name, {}) if name is not None else {})
        self.backend.update_weights(weights.items(), self.backend.weight_version())
        self._serving = name

    def skips_under_lora(self, name: str) -> bool:
        """Whether a pushed base weight ``name`` is passed over (an adapted projection under ``--enable-lora``)."""
        return self.enable_lora and any(f".{module}." in name for module in self.lora_target_modules)
