"""FSDP2 through Accelerate on a machine without GPUs: the one place this stack needs a shim for it."""

from __future__ import annotations

from accelerate import Accelerator, FullyShardedDataParallelPlugin
from accelerate.state import PartialState
from accelerate.utils import DistributedType

from .errors import LaunchError


def force_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Turn a gloo-backed Accelerator (distributed_type NO, N processes) into a real FSDP2 one.

    Why: Accelerate resolves FSDP only from a GPU distributed type, so on CPU an `FSDP` config runs every process
    as an unsynced full replica. Forcing the type makes prepare() call fully_shard over the gloo group (measured:
    losses match DDP). Accelerate 1.15, torch 2.13.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy

    plugin = plugin if plugin is not None else FullyShardedDataParallelPlugin()  # from the FSDP_* launch env
    if plugin.fsdp_version != 2:
        raise LaunchError("FSDP1 on CPU segfaults when saving a full state dict and fails with offload on this stack. "
                          "Set `fsdp_version: 2` in the accelerate config (see accelerate_configs/fsdp.yaml).")
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        # The default policy pins host memory, which needs a GPU: offload then fails on a CPU-only machine.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    if accelerator.mixed_precision != "no":
        # Accelerate sets the FSDP mixed-precision policy only on its GPU path; unset, bf16 would silently be fp32.
        plugin.set_mixed_precision(accelerator.mixed_precision)
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
