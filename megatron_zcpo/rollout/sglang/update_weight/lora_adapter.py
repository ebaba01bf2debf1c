"""LoRA adapter push (``model.lora.push: adapter``): a PEFT folder per version, ``/load_lora_adapter`` on every server.

SGLang serves an adapter by name, refuses a name it holds and has no way to replace an adapter in
place (:mod:`megatron_zcpo.rollout.sglang.api`), so every version gets a name of its own,
``zcpo-lora-<run>-v<version>`` (``<run>``: drawn once per client, so a resumed run that pushes a
version again never meets the name its previous process left on the servers): the servers load the
new one (from ``weight_dir/lora-v<version>``, a directory they read), then unload every older one
of ours they hold and its folder is removed. Requests name the current adapter (``lora_path``), so
none runs on an old one. The base stays as the servers loaded it: nothing else is pushed.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Dict, Iterable, Optional, Tuple

import torch

ADAPTER_PREFIX = "zcpo-lora"


@dataclass(frozen=True)
class ServedAdapter:
    """The adapter the servers serve: its name, weight version and folder."""

    name: str
    version: int
    path: str


class LoraAdapterUpdate:
    """Loads each version's adapter into the servers in rotation; ``current`` the one they serve."""

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (weight_dir, update_timeout_s)."""
        if not config.weight_dir:
            raise ValueError(
                "rollout.sglang.client.weight_dir must be set: the servers load each LoRA adapter from a folder there"
            )
        self.http, self.config = http, config
        self.run = uuid.uuid4().hex[:8]
        self.current: Optional[ServedAdapter] = None
        self.pushed = {"bytes": 0, "tensors": 0, "buckets": 0}  # totals over this transport's pushes

    def push(self, named_peft_tensors: Iterable[Tuple[str, torch.Tensor]], adapter_config: dict, version: int) -> int:
        """Write the adapter as version ``version``'s PEFT folder and have every server in rotation serve it;
        returns the bytes written."""
        from megatron_zcpo.convert.peft import write_peft_adapter

        tensors = list(named_peft_tensors)
        adapter = ServedAdapter(
            f"{ADAPTER_PREFIX}-{self.run}-v{int(version)}",
            int(version),
            os.path.join(self.config.weight_dir, f"lora-v{int(version)}"),
        )
        if os.path.isdir(adapter.path):  # a re-push of the version (a resumed run): never a half-old folder
            shutil.rmtree(adapter.path)
        written = write_peft_adapter(adapter.path, tensors, adapter_config)
        self.pushed["bytes"] += written
        self.pushed["tensors"] += len(tensors)
        self.pushed["buckets"] += 1
        loaded = self.http.run(
            self.http.on_servers_in_rotation(
                "POST",
                "/load_lora_adapter",
                {"lora_name": adapter.name, "lora_path": adapter.path},
                timeout=self.config.update_timeout_s,
            )
        )
        previous, self.current = self.current, adapter
        self.http.run(self._unload_older(loaded))
        if previous is not None and previous.path != adapter.path:
            shutil.rmtree(previous.path, ignore_errors=True)
        return written

    async def _unload_older(self, loaded: Dict[str, dict]) -> None:
        """On each server, unload every adapter of ours but the current one (its load answer lists them)."""
        for url, answer in loaded.items():
            for name in (answer or {}).get("loaded_adapters") or {}:
                if name.startswith(ADAPTER_PREFIX) and name != self.current.name:
                    await self.http.request(
                        "POST", url + "/unload_lora_adapter", {"lora_name": name}, timeout=self.config.update_timeout_s
                    )

    async def resync(self, url: str) -> bool:
        """Have the server at ``url`` (a returning one) serve the current adapter; False before any push."""
        from megatron_zcpo.rollout.sglang.http import SGLangHTTPError

        if self.current is None:
            return False
        try:
            answer = await self.http.request(
                "POST",
                url + "/load_lora_adapter",
                {"lora_name": self.current.name, "lora_path": self.current.path},
                timeout=self.config.update_timeout_s,
            )
        except SGLangHTTPError as err:  # it kept the current adapter while it was out of rotation
            if "already loaded" not in str(err):
                raise
            return True
        await self._unload_older({url: answer})
        return True
