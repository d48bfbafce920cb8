"""Bad input fails before any training step, with a message that names the problem and the fix.

This table is the source of docs/bad_inputs.md: `python tests/test_bad_inputs.py > docs/bad_inputs.md`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _csv(tmp: Path, rows: int = 40) -> Path:
    from shared.data import sentiment_dataset

    d = sentiment_dataset(rows, seed=1)
    path = tmp / "train.csv"
    path.write_text("review,sentiment\n" + "".join(f"{t},{y}\n" for t, y in zip(d["text"], d["label"], strict=True)))
    return path


def _empty_csv(tmp: Path) -> Path:
    path = tmp / "empty.csv"
    path.write_text("text,label\n")
    return path


def _folder(tmp: Path, classes=("a", "b"), images: bool = True, name: str = "imgs") -> Path:
    import numpy as np
    from PIL import Image

    for c in classes:
        (tmp / name / c).mkdir(parents=True, exist_ok=True)
        if images:
            for i in range(4):
                Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp / name / c / f"{i}.png")
    return tmp / name


def _checkpoint_dir(tmp: Path) -> Path:
    path = tmp / "half_written"
    path.mkdir()
    (path / "model.safetensors").write_bytes(b"partial")
    return path


@dataclass
class Case:
    id: str
    problem: str
    argv: list
    says: list[str]  # fragments of the message: the problem, then the fix
    recipe: str = "baseline"
    setup: object = None  # tmp -> extra argv
    env: dict = field(default_factory=dict)  # what `accelerate launch --config_file ...` would set


CASES = [
    Case("unknown-task", "a task that does not exist", ["--task", "translation"],
         ["invalid choice: 'translation'", "choose from"]),
    Case("missing-train-file", "a training file that does not exist", ["--train_file", "missing.csv"],
         ["--train_file 'missing.csv' does not exist", "Pass an existing path"]),
    Case("unknown-file-type", "a file type no loader reads", [],
         ["unknown file type", "Use one of"], setup=lambda t: ["--train_file", _write(t / "data.xlsx", "x")]),
    Case("txt-for-classification", "plain text (no labels) for a classification task", [],
         ["serves --task causal-lm only", "Use csv, json/jsonl or parquet"],
         setup=lambda t: ["--train_file", _write(t / "a.txt", "hello\n")]),
    Case("image-dir-for-text", "an image folder for a text task", ["--train_dir", "."],
         ["--train_dir/--validation_dir are image folders", "use them with --task image-classification"]),
    Case("two-data-sources", "two data sources at once", ["--dataset_name", "glue"],
         ["Pass one data source", "--dataset_name"], setup=lambda t: ["--train_file", _csv(t)]),
    Case("validation-without-train", "a validation file without a training file", [],
         ["--validation_file needs --train_file"], setup=lambda t: ["--validation_file", _csv(t)]),
    Case("missing-model-dir", "a model directory that does not exist", ["--model_name_or_path", "./no/such/model"],
         ["does not exist", "leave it unset to build a model from --model_preset"]),
    Case("unreachable-hub-model", "a hub id that cannot be fetched (offline, or a typo)",
         ["--model_name_or_path", "no-such-org/no-such-model"],
         ["Could not load 'no-such-org/no-such-model'", "pass a local directory"]),
    Case("missing-text-column", "a text column that is not in the data", ["--text_column", "body"],
         ["--text_column 'body' is not a column", "review", "Pass --text_column with one of them"],
         setup=lambda t: ["--train_file", _csv(t)]),
    Case("missing-label-column", "no label column under any usual name", ["--text_column", "review"],
         ["Found no label column among", "Pass --label_column"],
         setup=lambda t: ["--train_file", _write(t / "nolabel.csv", "review,stars\nnice film,5\nbad film,1\n")]),
    Case("empty-dataset", "a training file with a header and no rows", [],
         ["is empty"], setup=lambda t: ["--train_file", _empty_csv(t)]),
    Case("batch-larger-than-data", "a global batch larger than the training set",
         ["--per_device_train_batch_size", "64", "--text_column", "review", "--label_column", "sentiment"],
         ["is larger than the training set", "Lower --per_device_train"],
         setup=lambda t: ["--train_file", _csv(t, rows=40)]),
    Case("no-class-folders", "an image folder without class subfolders", ["--task", "image-classification"],
         ["holds no class subfolders", "Lay images out as"], setup=lambda t: ["--train_dir", _write_dir(t / "flat")]),
    Case("no-images", "class folders without images", ["--task", "image-classification"],
         ["holds no images"], setup=lambda t: ["--train_dir", _folder(t, images=False)]),
    Case("unknown-validation-class", "validation classes the training folder lacks", ["--task", "image-classification"],
         ["has classes ['c'] that the training folder lacks"],
         setup=lambda t: ["--train_dir", _folder(t), "--validation_dir", _folder(t, ("a", "c"), name="val")]),
    Case("zero-batch", "a batch size of 0", ["--per_device_train_batch_size", "0"],
         ["--per_device_train_batch_size must be at least 1"]),
    Case("accumulation-in-plain-recipe", "gradient accumulation asked of a recipe that does not accumulate",
         ["--gradient_accumulation_steps", "4"],
         ["does not accumulate gradients", "Use recipes/gradient_accumulation.py"]),
    Case("sequence-beyond-positions", "a sequence length beyond the model's position embeddings",
         ["--task", "causal-lm", "--max_seq_length", "512"],
         ["exceeds the model's 128 positions", "Pass --max_seq_length 128"]),
    Case("missing-tracker", "a tracker that is not installed", ["--report_to", "wandb"],
         ["--report_to wandb: not installed", "pip install wandb"]),
    Case("missing-checkpoint", "a checkpoint directory that does not exist", ["--resume_from_checkpoint", "nowhere"],
         ["--resume_from_checkpoint 'nowhere' does not exist", "or 'latest'"]),
    Case("partial-checkpoint", "a checkpoint whose save never finished", [],
         ["is not a complete checkpoint: no manifest.json", "'latest' to take the newest complete one"],
         setup=lambda t: ["--resume_from_checkpoint", _checkpoint_dir(t)]),
    Case("deepspeed-fp16-on-cpu", "fp16 under DeepSpeed on a machine without a GPU (DeepSpeed refuses it)",
         ["--mixed_precision", "fp16"], ["fp16", "Use --mixed_precision bf16"], recipe="zero"),
    Case("deepspeed-conflicting-accumulation", "accumulation 4 in the DeepSpeed JSON, 2 on the command line",
         ["--gradient_accumulation_steps", "2"], ["4 from the DeepSpeed JSON", "2 from --gradient_accumulation_steps"],
         recipe="zero", setup=lambda t: ["--deepspeed_config", _ds_json(t, gradient_accumulation_steps=4)]),
    Case("nvme-without-path", "NVMe offload without a directory to swap to", ["--offload", "nvme"],
         ["to nvme needs a directory", "pass --nvme_path DIR"], recipe="zero3_offload"),
    Case("paged-optimizer-without-cuda", "a paged 8-bit optimizer on a machine without CUDA", ["--paged"],
         ["--paged needs a CUDA device", "Drop --paged"], recipe="optim_8bit"),
    Case("merge-without-adapter", "merging an adapter that the run is told not to save", ["--merge", "--no_save_model"],
         ["--no_save_model skips saving it", "Drop one of them"], recipe="qlora"),
    Case("fsdp-single-process", "FSDP with one process: nothing to shard over", [],
         ["recipes/fsdp.py needs at least 2 processes", "accelerate_configs/fsdp.yaml"], recipe="fsdp"),
    Case("microbatches-not-dividing", "a pipeline batch that micro-batches do not divide",
         ["--per_device_train_batch_size", "6", "--n_microbatches", "4"],
         ["not divisible by --n_microbatches", "pick a batch size that is a multiple of it"],
         recipe="pipeline_parallel"),
    Case("quantized-without-lora", "quantized (frozen) base weights and nothing to train", ["--load_in", "4bit"],
         ["quantized base weights are frozen", "Add --lora"], recipe="combined"),
    Case("8bit-optimizer-under-zero-offload", "an 8-bit optimizer under ZeRO offload (DeepSpeed would swap it for "
         "its 32-bit CPU Adam)", ["--optim", "adamw_8bit"], ["would silently not be used", "Drop --optim adamw_8bit"],
         recipe="combined", env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu"}),
    Case("nvme-offload-under-zero2", "NVMe optimizer offload under ZeRO-2 (DeepSpeed would keep it in CPU memory)",
         [], ["to nvme under ZeRO stage 2", "Use ZeRO-3 for NVMe offload"], recipe="zero",
         setup=lambda t: ["--nvme_path", t / "nvme", "--deepspeed_config", _ds_json(t, zero_optimization={
             "stage": 2, "offload_optimizer": {"device": "nvme"}})]),
    Case("impossible-sparsity", "a pruning target of 150%", ["--target_sparsity", "1.5"],
         ["--target_sparsity must be in [0, 1)"], recipe="pruning"),
    Case("pruning-past-the-end", "a pruning schedule that ends after training does", ["--pruning_end_step", "9"],
         ["--pruning_end_step <= training steps"], recipe="pruning"),
]


def _ds_json(tmp: Path, **values) -> Path:
    import json

    config = json.loads((Path(__file__).resolve().parents[1] / "accelerate_configs/ds_config_zero3_auto.json")
                        .read_text())
    config.update(values)
    path = tmp / "ds.json"
    path.write_text(json.dumps(config))
    return path


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _write_dir(path: Path) -> Path:
    path.mkdir()
    (path / "x.png").write_bytes(b"")
    return path


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_fast_with_the_fix(case, tmp_path, capsys, monkeypatch):
    from tests.conftest import run_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    argv = [*case.argv, *(case.setup(tmp_path) if case.setup else [])]
    with pytest.raises(SystemExit) as exc:
        run_recipe(case.recipe, tmp_path / "out", *argv, "--max_train_steps", 2)
    message = f"{exc.value.code}\n{capsys.readouterr().err}"
    for fragment in case.says:
        assert fragment in message, f"{case.id}: {fragment!r} not in {message[-1500:]!r}"
    assert not (tmp_path / "out" / "results.json").exists()
    assert not list((tmp_path / "out").glob("checkpoints/step_*")), "it trained before failing"


def test_docs_table_is_current():
    docs = Path(__file__).resolve().parents[1] / "docs" / "bad_inputs.md"
    assert docs.read_text() == table(), "regenerate: python tests/test_bad_inputs.py > docs/bad_inputs.md"


def table() -> str:
    lines = ["# Bad input: what each case says", "",
             "Each case fails before any training step; `tests/test_bad_inputs.py` runs every row and checks that the "
             "message names the problem and the fix. This page is generated from that table.", "",
             "| case | problem | recipe | the message says |", "|---|---|---|---|"]
    for c in CASES:
        says = " ... ".join(f"`{s}`" for s in c.says).replace("|", "\\|")
        lines.append(f"| {c.id} | {c.problem} | {c.recipe} | {says} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
