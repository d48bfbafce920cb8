"""Compile the DeepSpeed ops the ZeRO tests use, once, into ~/.cache/torch_extensions (or $TORCH_EXTENSIONS_DIR).

CI runs this before the test suite and caches that directory; otherwise the first test that needs an op compiles it
(and other processes wait on the build lock). Measured on 2 cores: deepspeed_shm_comm (DeepSpeed's CPU collectives,
built by every run on a CPU-only machine) ~1 min, cpu_adam (CPU offload) ~100 s alone, async_io + pin_memory (NVMe
offload; needs `apt-get install libaio-dev`) ~5.5 min; fused_adam about a minute.
    python .ci/build_ds_ops.py
"""

import sys
import time

from deepspeed.accelerator import get_accelerator

# The builders of the machine's accelerator: on CPU-only machines these are DeepSpeed's CPU variants.
# FusedAdamBuilder: the AdamW a DeepSpeed JSON's "optimizer" block builds without "torch_adam" (Accelerate's
# zero_stage2_config.json; tests/test_field_configs.py).
for name in ("ShareMemCommBuilder", "CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is None:  # e.g. no shared-memory comm op on CUDA: NCCL does the collectives
        continue
    if not builder.is_compatible(verbose=True):
        sys.exit(f"{builder.NAME}: cannot be built here (async_io needs `apt-get install libaio-dev`).")
    t0 = time.perf_counter()
    builder.load(verbose=False)
    print(f"{builder.NAME}: ready in {time.perf_counter() - t0:.0f} s", flush=True)
