"""Every common flag's verdict on resume (shared/core/checkpoint.py's FIXED, APPLIED, LAYOUT, FREE; any other flag,
a recipe's own among them, is refused), as the table in docs/faults.md. tests/test_faults.py holds the page to it.
    python -m shared.tools.resume_flags           # print the table
    python -m shared.tools.resume_flags --write   # rewrite it in docs/faults.md
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..core import checkpoint
from ..core.args import parse_args

DOCS = Path(__file__).resolve().parents[2] / "docs" / "faults.md"
MARK, END = "<!-- resume-flags -->\n", "<!-- /resume-flags -->"

WHY = {  # a flag's own reason where its verdict's general one does not say enough
    "learning_rate": "the schedulers' base rate is rewritten after loading; the new rate from the resumed step",
    "lr_scheduler_type": "the schedule is rebuilt from the flags and continues at the resumed step",
    "num_warmup_steps": "as the schedule",
    "max_train_steps": "the schedule's length, and where the run ends",
    "num_train_epochs": "as --max_train_steps, where it sets the step count",
    "weight_decay": "written into the loaded optimizer's decayed groups (load_state brings the old value back)",
    "max_grad_norm": "read at every step (DeepSpeed: its config, built from the flags)",
    "mixed_precision": "the optimizer and loss-scaler state are the precision's (fp16: scaler.pt; ZeRO bf16: its "
                       "bf16_* files); the value Accelerate resolved is recorded and compared",
    "seed": "the data order and the dropout streams restored with the RNG states are the seed's",
    "train_file": "recorded with its content (size and crc32; first and last 4 MB of files over 64 MB)",
    "validation_file": "as --train_file (the label set is read from both)",
    "train_dir": "as --train_file, every file under it",
    "validation_dir": "as --train_dir",
    "torch_compile": "how the same model runs; the checkpoint holds the plain module's state",
    "attn_implementation": "refused: another kernel computes other activations for the same weights",
    "dataloader_num_workers": "the seedable sampler gives the same batches with any number of workers",
    "trust_remote_code": "permission to run the model's code; the model itself is --model_name_or_path's",
}
GENERAL = {
    "refused": "the checkpoint's state depends on it: refused before loading, naming both values",
    "applied": "applied from the resumed step, reported in results.json `resume_changes`, and a new branch",
    "layout": "resharded where the recipe can, if the global batch (per device x processes x accumulation) stays "
              "([resharding.md](resharding.md)); else refused with the batch that keeps it",
    "free": "not part of the training state (saving, logging, evaluation, how the run is launched)",
}


def verdict(flag: str) -> str:
    if flag in checkpoint.APPLIED:
        return "applied"
    if flag in checkpoint.LAYOUT:
        return "layout"
    if flag in checkpoint.FREE:
        return "free"
    return "refused"


def common_flags() -> list[str]:
    return sorted(k for k in vars(parse_args([])) if k != "explicit_flags")


def table() -> str:
    rows = ["| flag | on resume | why |", "|---|---|---|"]
    for flag in common_flags():
        rows.append(f"| `--{flag}` | {verdict(flag)} | {WHY.get(flag, GENERAL[verdict(flag)])} |")
    rows.append("| a recipe's own flag (`--lora_r`, `--zero_stage`, `--init_loss_scale`, ...) | refused | not known "
                "to apply on resume: any change is named and refused |")
    rows.append(f"| the process count (the launch) | layout | {GENERAL['layout']} |")
    rows.append("| the sharding (the launch config: DDP or one process, FSDP, ZeRO stage 1/2/3) | refused | each "
                "reads other files (one model and optimizer, DCP shards, per-stage partitions), which neither "
                "Accelerate nor DeepSpeed converts in place: refused before loading, naming both and the launch "
                "config to resume under |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite the table in docs/faults.md")
    if not p.parse_args(argv).write:
        print(table(), end="")
        return
    page = DOCS.read_text()
    head, rest = page.split(MARK, 1)
    DOCS.write_text(head + MARK + table() + END + rest.split(END, 1)[1])


if __name__ == "__main__":
    main()
