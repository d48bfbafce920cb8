"""What torchao's low-bit optimizers (recipes/optim_low_bit.py) need beyond the optimizer itself."""

from __future__ import annotations


def compile_each_shard_apart() -> None:
    """Turn off AOTAutograd's on-disk cache for this process, for torchao's compiled optimizer step under FSDP2.

    That cache keys a graph by a hash which, for tensor subclasses without `_stable_hash_for_caching` (FSDP2's
    DTensor parameters, torchao's quantized state), leaves out the local shard's shape. Two processes with uneven
    shards (21 and 20 rows of a 41-row tensor) then share one key: the second loads the first one's graph and
    fails inside the step (`AssertionError: expected size 21==20`, or `wrong number of dimensions`). Measured
    2026-12-01 with torch 2.13, torchao 0.18: fails with the cache warm, trains with it off. Inductor's own graph
    cache (plain tensors, full shapes in the key) still applies.
    """
    from torch._functorch import config

    config.enable_autograd_cache = False
