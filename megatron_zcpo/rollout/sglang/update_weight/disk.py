"""Weight push through a shared filesystem: safetensors shards, then ``/update_weights_from_disk`` on every server.

Under pipeline parallelism every stage's lead writes its own shards (``push_part``) into the
version's directory and one engine indexes them and has the servers reload (``commit``).
"""

from __future__ import annotations

import os
import shutil
from typing import Dict, Iterable, Optional, Sequence, Tuple

import torch


class DiskWeightUpdate:
    """Writes each version under ``config.weight_dir`` (``weights-v<version>``) and has the servers
    reload it; the previous version's directory is removed once the servers serve the new one."""

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (weight_dir, update_timeout_s)."""
        self.http = http
        self.config = config
        self._last_weight_dir: Optional[str] = None
        self.pushed = {"bytes": 0, "tensors": 0, "buckets": 0}  # totals over this transport's pushes
        self._last_version: Optional[int] = None

    def push(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``stream`` (HF name, tensor) as safetensors shards and have every server load them as ``version``."""
        self.commit(version, [self.push_part(stream, version)])

    def push_part(
        self, stream: Iterable[Tuple[str, torch.Tensor]], version: int, file_prefix: str = "model"
    ) -> Dict[str, str]:
        """Write one share as ``<file_prefix>-*.safetensors`` into the version's directory; its weight map."""
        from megatron_zcpo.convert.hf_checkpoint import write_safetensors_shards

        def counted(tensors):
            for name, tensor in tensors:
                self.pushed["bytes"] += tensor.numel() * tensor.element_size()
                self.pushed["tensors"] += 1
                yield name, tensor

        return write_safetensors_shards(
            self._directory(version), counted(stream), file_prefix=file_prefix, write_index=False
        )

    def commit(self, version: int, weight_maps: Sequence[Optional[Dict[str, str]]] = ()) -> None:
        """Index the shares' files and have every server load them as ``version``."""
        from megatron_zcpo.convert.hf_checkpoint import write_safetensors_index

        directory = self._directory(version)
        write_safetensors_index(directory, {k: v for part in weight_maps if part for k, v in part.items()})
        payload = {"model_path": directory, "weight_version": str(int(version))}
        # A server lost meanwhile leaves the rotation; the others load the new version.
        self.http.run(
            self.http.on_servers_in_rotation(
                "POST", "/update_weights_from_disk", payload, timeout=self.config.update_timeout_s
            )
        )
        if self._last_weight_dir and self._last_weight_dir != directory:
            shutil.rmtree(self._last_weight_dir, ignore_errors=True)
        self._last_weight_dir, self._last_version = directory, int(version)

    async def resync(self, url: str) -> bool:
        """Have the server at ``url`` load the current version again (a returning server, mid-rollout).

        Runs on the HTTP loop. Returns whether it now serves that version (False before any push).
        """
        if self._last_weight_dir is None:
            return False
        payload = {"model_path": self._last_weight_dir, "weight_version": str(self._last_version)}
        await self.http.request(
            "POST", url + "/update_weights_from_disk", payload, timeout=self.config.update_timeout_s
        )
        return True

    def _directory(self, version: int) -> str:
        # not named after group_name: every stage's engine (its own group) writes into it
        return os.path.join(self.config.weight_dir, f"weights-v{int(version)}")

    def close(self) -> None:
        """Nothing to leave (the last version's files stay for the servers)."""
