"""Activation offloading, measured (shared/techniques/activation_offload.py).

1. threshold: one round trip through the offloader's own hooks (pack: copy to the host; unpack: back) for tensors
   of 256 B to 16 MiB (median of the repeats); fixed = the median of 256 B, 1 KiB and 4 KiB, per_byte = the slope
   from 1 MiB to 16 MiB; the suggested --offload_min_bytes is the size where the fixed cost is as large as the
   bytes' own (fixed / per_byte), rounded up to a power of 2.
2. steps: one model, four settings (none, all, HF checkpointing, checkpointing + checkpointed), each a few
   forward + backward steps: the device's peak memory above the weights (CUDA: max_memory_allocated; CPU: not
   measurable apart, the ledger only), the step time, the ledger's peak host bytes and the copies' host time.
   On a CPU the "host" copy is in the same memory: the ledger says what would leave a GPU, no saving is real.

    python benchmarks/activation_offloading.py                            # GPT-2 124M, bf16, 8 x 1024 on CUDA
    python benchmarks/activation_offloading.py --preset tiny --batch 4 --seq 128 --steps 3   # CPU, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.core.models import AUTO_CLASSES, preset_config  # noqa: E402
from shared.techniques.activation_offload import MIN_BYTES, ActivationOffloader  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def threshold(device: torch.device, repeats: int = 20) -> dict[str, float]:
    """Round-trip seconds per size through the hooks, the fit, and the size where fixed cost = bytes' cost."""
    off = ActivationOffloader(torch.nn.Linear(1, 1), "all", min_bytes=0)
    threads = torch.get_num_threads()
    if device.type == "cpu":  # a loaded shared CPU: a parallel copy waits ~24 ms for its pool's threads at >= 256 KiB
        torch.set_num_threads(1)
    sizes, times = [], []
    for power in range(8, 25, 2):
        n = 2 ** power
        t = torch.randn(n // 4, device=device) * 1.0  # a non-leaf: the offloader moves it
        runs = []
        for _ in range(repeats):
            _sync(device)
            t0 = time.perf_counter()
            back = off._unpack(off._pack(t))
            _sync(device)
            runs.append(time.perf_counter() - t0)
            del back
        sizes.append(n)
        times.append(statistics.median(runs))
    off.close()
    torch.set_num_threads(threads)
    fixed = statistics.median(times[:3])  # 256 B to 4 KiB: the hooks' own cost, the bytes nothing
    per_byte = (times[-1] - times[-3]) / (sizes[-1] - sizes[-3])  # 1 to 16 MiB: the copies' cost a byte
    return {"fixed_s": fixed, "per_byte_s": per_byte, "suggested_min_bytes": 2 ** math.ceil(math.log2(
        max(fixed / per_byte, 1))), "sizes": sizes, "round_trip_s": times}


def steps(args: argparse.Namespace, device: torch.device) -> list[dict]:
    cfg = preset_config("causal-lm", args.preset, vocab_size=50257 if args.preset == "base" else 1000)
    torch.manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=device)
    rows = []
    for name, ckpt, mode in (("none", False, None), ("all", False, "all"), ("checkpointing", True, None),
                             ("checkpointing + checkpointed", True, "checkpointed")):
        model = AUTO_CLASSES["causal-lm"].from_config(cfg).to(device).train()
        if ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off = ActivationOffloader(model, mode, args.min_bytes) if mode else None
        autocast = torch.autocast(device.type, torch.bfloat16) if args.bf16 else contextlib.nullcontext()
        times = []
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.steps):
            model.zero_grad(set_to_none=False)  # gradients allocated once: the peak is the activations'
            _sync(device)
            t0 = time.perf_counter()
            with autocast, off if off is not None else contextlib.nullcontext():
                logits = model(input_ids=ids, use_cache=False).logits
                loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            del logits
            loss.backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base if device.type == "cuda" else None
        ledger = off.ledger.summary() if off else {}
        if off:
            off.close()
        rows.append({"setting": name, "step_s": statistics.median(times[1:] or times), "peak_above_start": peak,
                     "host_peak_bytes": ledger.get("offload_peak_host_bytes", 0),
                     "copy_host_s_per_step": ledger.get("offload_copy_seconds", 0.0) / args.steps})
        del model, off
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="base", choices=("tiny", "base"))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--min_bytes", type=int, default=MIN_BYTES)
    ap.add_argument("--bf16", action="store_true", help="Autocast to bf16 (the default on CUDA).")
    ap.add_argument("--threshold_only", action="store_true", help="Only part 1.")
    ap.add_argument("--out", default=None, help="Write the figures here as JSON.")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.bf16 = args.bf16 or device.type == "cuda"
    result = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "threshold": threshold(device),
              "steps": [] if args.threshold_only else steps(args, device),
              "model": f"GPT-2 {args.preset}, batch {args.batch} x {args.seq}, {'bf16' if args.bf16 else 'fp32'}"}
    for row in result["steps"]:
        row["step_ratio"] = row["step_s"] / result["steps"][0]["step_s"]
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
