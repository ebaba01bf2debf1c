"""Weight transports from the trainer into SGLang servers, one module per transport.

Each transport has ``push(named_hf_tensors, version)`` (the whole model from one sender),
``push_part(named_hf_tensors, version, file_prefix)`` (one pipeline stage's share, from that
stage's lead), ``commit(version, weight_maps)`` (serve the version once all shares are in),
``close()`` and ``pushed`` (byte/tensor/bucket totals); the engine
(:class:`megatron_zcpo.rollout.sglang.client.SGLangEngine`) picks one from ``weight_sync`` and
flushes and verifies the servers afterwards (see :func:`megatron_zcpo.recipe.weight_push.push_weights`).
"""

from megatron_zcpo.rollout.sglang.update_weight.disk import DiskWeightUpdate
from megatron_zcpo.rollout.sglang.update_weight.distributed import DistributedWeightUpdate
from megatron_zcpo.rollout.sglang.update_weight.tensor_ipc import TensorIPCWeightUpdate

__all__ = ["DiskWeightUpdate", "DistributedWeightUpdate", "TensorIPCWeightUpdate", "weight_update_for"]


def weight_update_for(http, config):
    """The transport ``config.weight_sync`` names ("distributed", "disk" or "tensor") over ``http`` (SGLangHTTP)."""
    if config.weight_sync == "tensor":
        return TensorIPCWeightUpdate(http, config)
    return DiskWeightUpdate(http, config) if config.weight_sync == "disk" else DistributedWeightUpdate(http, config)
