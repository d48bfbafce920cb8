"""What torchao's low-bit optimizers (recipes/optim_low_bit.py) need beyond the optimizer itself."""

from __future__ import annotations

from ..core import rules
from ..core.rules import TORCHAO_OPTIMIZERS, Rule


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


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    # First: the specific reason reads before the generic 'does not implement' one.
    Rule(lambda r: r.optimizer in TORCHAO_OPTIMIZERS and r.sharding.startswith("zero"),
         # Measured on 2 processes: tiny GPT-2 kept all state in 32 bits under ZeRO-1/2/3 (loss identical
         # to torch AdamW's); at width 256 one of ZeRO-2's two partitions was quantized.
         lambda r: f"{r.flag('optimizer')} under DeepSpeed ZeRO-{r.sharding[-1]}: torchao's optimizer would step "
                   "DeepSpeed's flat fp32 partitions (one per parameter group and process), quantized only when a "
                   "partition's size is a multiple of its block size and otherwise silently kept in 32 bits, beside "
                   "DeepSpeed's own fp32 master copy",
         lambda r: "use DDP or FSDP2 with torchao's optimizers (accelerate_configs/multi_cpu.yaml, fsdp.yaml, "
                   "fsdp_offload.yaml), or bitsandbytes' 8-bit under ZeRO-1/2: recipes/combined.py --optim "
                   "adamw_bnb_8bit"),
)
rules.register(*RULES, fields=dict(), first=True)
