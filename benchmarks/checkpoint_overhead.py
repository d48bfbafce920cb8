"""What a checkpoint's integrity costs beyond Accelerate's save_state: the manifest each process writes for its own
files (zlib.crc32) and the verification of the checkpoint a resume loads, against SHA-256 on the main process alone
(the manifests before issue 36).

    python benchmarks/checkpoint_overhead.py                 # two GPT-2 sizes, 1 and 2 processes (DDP over gloo)
    python benchmarks/checkpoint_overhead.py --repeats 5

Each configuration is one `accelerate launch` of this file as `--worker`: a GPT-2 of the size asked (built from its
config, random weights), AdamW after one step (so the checkpoint holds the optimizer's two moments), then per repeat
into a fresh directory: save_state (timed), the project's manifest (shared/core/checkpoint.py _write_manifest, every
process hashing the files it wrote) and verify_checkpoint (each process reading back its own files), then the old
way, SHA-256 of every file on the main process, for the manifest and again for the verification. Medians. The files
are read back from the page cache, as they are right after a save. Writes docs/results/checkpoint_overhead.json and
.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SIZES = {"gpt2-16M": (256, 4), "gpt2-57M": (512, 10)}  # name -> (hidden size, layers); vocab 50257


def worker(size: str, repeats: int, out: Path) -> None:
    import torch
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    from shared.core.checkpoint import _sha256, _write_manifest, verify_checkpoint

    torch.set_num_threads(1)
    hidden, layers = SIZES[size]
    accelerator = Accelerator(cpu=True)
    model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=8, n_positions=128))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    ids = torch.randint(0, 50257, (2, 32))
    accelerator.backward(model(input_ids=ids, labels=ids).loss)
    optimizer.step()
    base = Path(tempfile.mkdtemp(prefix="ckpt-overhead-", dir=os.environ.get("BENCH_DIR")))
    base = Path(accelerator.gather_for_metrics([str(base)], use_gather_object=True)[0])  # the main process's
    rows = []
    for i in range(repeats):
        d = base / f"r{i}"
        accelerator.wait_for_everyone()
        t0 = time.perf_counter()
        accelerator.save_state(str(d))
        accelerator.wait_for_everyone()
        t1 = time.perf_counter()
        if accelerator.is_main_process:
            (d / "trainer_state.json").write_text(json.dumps({"step": 1, "micro_batches": 1}))
        accelerator.wait_for_everyone()
        t2 = time.perf_counter()
        _write_manifest(d, accelerator)
        accelerator.wait_for_everyone()
        t3 = time.perf_counter()
        problem = verify_checkpoint(d, accelerator)
        t4 = time.perf_counter()
        assert problem is None, problem
        if accelerator.is_main_process:  # the old way: SHA-256 of every file, on the main process, twice
            files = sorted(p for p in d.rglob("*") if p.is_file() and p.name != "manifest.json")
            t5 = time.perf_counter()
            [_sha256(p) for p in files]
            sha = time.perf_counter() - t5
            rows.append({"save_state_s": t1 - t0, "manifest_s": t3 - t2, "verify_s": t4 - t3, "sha256_once_s": sha,
                         "bytes": sum(p.stat().st_size for p in files)})
        accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.write_text(json.dumps(rows))
        shutil.rmtree(base, ignore_errors=True)
    accelerator.end_training()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--size", default="gpt2-16M", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.size, args.repeats, args.out)
    results = []
    for size in SIZES:
        for processes in (1, 2):
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                config = ["--config_file", str(ROOT / "accelerate_configs" / "multi_cpu.yaml")] if processes == 2 else [
                    "--num_processes", "1"]
                cmd = [sys.executable, "-m", "accelerate.commands.launch", *config, __file__, "--worker", "--size",
                       size, "--repeats", str(args.repeats), "--out", f.name]
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=ROOT)
                rows = json.loads(Path(f.name).read_text())
            med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
            results.append({"model": size, "processes": processes, **med,
                            "manifest_ratio": med["manifest_s"] / med["save_state_s"],
                            "verify_ratio": med["verify_s"] / med["save_state_s"]})
            print(results[-1], flush=True)
    import torch

    machine = f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {platform.python_version()}"
    (ROOT / "docs" / "results" / "checkpoint_overhead.json").write_text(
        json.dumps({"machine": machine, "repeats": args.repeats, "results": results}, indent=1))
    lines = [f"Checkpoint integrity beyond `save_state` ({machine}; median of {args.repeats}; "
             "`python benchmarks/checkpoint_overhead.py`; DDP: the main process writes the whole checkpoint).", "",
             "| model | processes | checkpoint | save_state | crc32 manifest, each save | verify, each resume | "
             "before: SHA-256 manifest on the main process, each save |", "|---|---|---|---|---|---|---|"]
    for r in results:
        save = r["save_state_s"]
        lines.append(f"| {r['model']} | {r['processes']} | {r['bytes'] / 2**20:.0f} MiB | {save:.2f} s | "
                     f"{r['manifest_s']:.2f} s ({r['manifest_s'] / save:.0%}) | {r['verify_s']:.2f} s "
                     f"({r['verify_s'] / save:.0%}) | {r['sha256_once_s']:.2f} s ({r['sha256_once_s'] / save:.0%}) |")
    table = "\n".join(lines) + "\n"
    (ROOT / "docs" / "results" / "checkpoint_overhead.md").write_text(table)
    faults = ROOT / "docs" / "faults.md"
    head, rest = faults.read_text().split("<!-- checkpoint-overhead -->\n", 1)
    faults.write_text(head + "<!-- checkpoint-overhead -->\n" + table + "<!-- /checkpoint-overhead -->"
                      + rest.split("<!-- /checkpoint-overhead -->", 1)[1])
    print(table)


if __name__ == "__main__":
    main()
