"""Weight push through a shared filesystem: safetensors shards, then ``/update_weights_from_disk`` on every server."""

from __future__ import annotations

import os
import shutil
from typing import Iterable, Optional, Tuple

import torch


class DiskWeightUpdate:
    """Writes each version under ``config.weight_dir`` (``<group_name>-v<version>``) and has the servers
    reload it; the previous version's directory is removed once the servers serve the new one."""

    def __init__(self, http, config):
        """http: the engine's SGLangHTTP; config: its SGLangEngineConfig (weight_dir, group_name, update_timeout_s)."""
        self.http = http
        self.config = config
        self._last_weight_dir: Optional[str] = None

    def push(self, stream: Iterable[Tuple[str, torch.Tensor]], version: int) -> None:
        """Write ``stream`` (HF name, tensor) as safetensors shards and have every server load them as ``version``."""
        from megatron_zcpo.convert.hf_checkpoint import write_safetensors_shards

        directory = os.path.join(self.config.weight_dir, f"{self.config.group_name}-v{int(version)}")
        write_safetensors_shards(directory, stream)
        payload = {"model_path": directory, "weight_version": str(int(version))}
        self.http.run(self.http.on_all_servers("POST", "/update_weights_from_disk", payload,
                                               timeout=self.config.update_timeout_s))
        if self._last_weight_dir and self._last_weight_dir != directory:
            shutil.rmtree(self._last_weight_dir, ignore_errors=True)
        self._last_weight_dir = directory

    def close(self) -> None:
        """Nothing to leave (the last version's files stay for the servers)."""
