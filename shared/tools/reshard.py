"""A ZeRO checkpoint (recipes/zero.py) as DeepSpeed's universal checkpoint, which resumes on any process count.

    python -m shared.tools.reshard outputs/zero-causal-lm/checkpoints/step_00000004
    accelerate launch --config_file accelerate_configs/zero2.yaml --num_processes 1 recipes/zero.py ... \\
        --per_device_train_batch_size 8 \\
        --resume_from_checkpoint outputs/zero-causal-lm/checkpoints/step_00000004_universal

ZeRO keeps each process's slice of the fp32 weights and optimizer state in its own file, so a checkpoint loads only
on the process count that wrote it. DeepSpeed's ds_to_universal (deepspeed/checkpoint/ds_to_universal.py) merges
the slices into one file per parameter; a recipe then loads them with DeepSpeed's `load_universal` (set by
techniques/deepspeed_setup.py load_universal_checkpoints when it finds one). The converted checkpoint is written
beside the original (<checkpoint>_universal, atomically, with its manifest); the original is left as it was.
FSDP2 and tensor-parallel checkpoints need no conversion: torch.distributed.checkpoint reshards them on load.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from ..core.checkpoint import MANIFEST, _write_manifest, verify_checkpoint

ZERO_DIR = "pytorch_model"  # Accelerate's save_state: DeepSpeed's checkpoint of the first model, by tag


def to_universal(checkpoint: Path, workers: int = 1) -> Path:
    """<checkpoint>_universal: the checkpoint with its ZeRO slices merged by ds_to_universal, manifest rewritten."""
    from deepspeed.checkpoint import ds_to_universal

    problem = verify_checkpoint(checkpoint)
    if problem:
        raise SystemExit(f"{checkpoint} is not a complete checkpoint: {problem}. Convert a complete one.")
    if not list((checkpoint / ZERO_DIR).glob("*optim_states.pt")):
        raise SystemExit(f"{checkpoint} holds no ZeRO checkpoint ({ZERO_DIR}/*optim_states.pt): only recipes/zero.py "
                         "checkpoints need converting; FSDP2 and tensor-parallel ones reshard as they load.")
    final = checkpoint.with_name(f"{checkpoint.name}_universal")
    tmp = final.with_name(f".tmp_{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(checkpoint, tmp, ignore=lambda d, names: [ZERO_DIR, MANIFEST] if Path(d) == checkpoint else [])
    options = argparse.Namespace(input_folder=str(checkpoint / ZERO_DIR), output_folder=str(tmp / ZERO_DIR),
                                 num_extract_workers=workers, num_merge_workers=workers, keep_temp_folder=False,
                                 # the universal_checkpoint_info Megatron-DeepSpeed writes; DeepSpeed's default
                                 # for a model without tensor or pipeline parallel
                                 strict=True, inject_missing_state=True)
    try:
        ds_to_universal.main(options)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer to the folder it wrote
    _write_manifest(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", type=Path, help="A checkpoint directory of recipes/zero.py (checkpoints/step_N).")
    p.add_argument("--workers", type=int, default=1, help="Processes that extract and merge the slices.")
    args = p.parse_args(argv)
    print(f"wrote {to_universal(args.checkpoint, args.workers)}")


if __name__ == "__main__":
    main(sys.argv[1:])
