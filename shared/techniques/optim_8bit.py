"""bitsandbytes' 8-bit optimizer (recipes/optim_8bit.py, recipes/combined.py --optim adamw_bnb_8bit): its refusals."""

from __future__ import annotations

from ..core import rules
from ..core.rules import Rule


def check_paged(paged: bool, device: str) -> None:
    """Refuse --paged off CUDA (the rule below): bitsandbytes would silently allocate ordinary memory."""
    rules.check_built(paged=paged, device=device)


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.optimizer == "adamw_bnb_8bit" and r.sharding.startswith("zero") and r.offload != "none",
         # Accelerate swaps any optimizer for DeepSpeedCPUAdam under ZeRO offload: 32-bit state, not the 8-bit asked.
         lambda r: f"{r.flag('optimizer')} with ZeRO {r.offload} offload: the offloaded step runs DeepSpeedCPUAdam "
                   "(32-bit state in host memory), so the 8-bit optimizer would silently not be used",
         lambda r: f"drop {r.flag('optimizer')} (offload already moves the state off the device), or drop the "
                   "offload"),
    Rule(lambda r: r.optimizer == "adamw_bnb_8bit" and r.sharding == "fsdp",
         lambda r: f"{r.flag('optimizer')} under FSDP: bitsandbytes' optimizer kernels do not take FSDP2's sharded "
                   "DTensor parameters (NotImplementedError in optimizer_update)",
         lambda r: "use ZeRO-1/2 or DDP with the 8-bit optimizer, or torch AdamW under FSDP"),
    Rule(lambda r: r.paged and r.device not in ("", "cuda"),
         # bitsandbytes would warn and silently allocate ordinary memory: nothing would be paged.
         lambda r: f"--paged needs a CUDA device (unified memory); this run is on {r.device}",
         lambda r: "drop --paged (plain AdamW8bit saves the same state bytes) or run on a CUDA GPU", built=True),
)
rules.register(*RULES, fields=dict(paged=False, device=""))
