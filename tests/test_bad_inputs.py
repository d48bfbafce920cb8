"""Bad input fails before any training step, with a message that names the problem and the fix.

This table is the source of docs/bad_inputs.md: `python tests/test_bad_inputs.py > docs/bad_inputs.md`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from shared.core.errors import RecipeError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _csv(tmp: Path, rows: int = 40) -> Path:
    from shared.tasks.text_classification import sentiment_dataset

    d = sentiment_dataset(rows, seed=1)
    path = tmp / "train.csv"
    path.write_text("review,sentiment\n" + "".join(f"{t},{y}\n" for t, y in zip(d["text"], d["label"], strict=True)))
    return path


def _empty_csv(tmp: Path) -> Path:
    path = tmp / "empty.csv"
    path.write_text("text,label\n")
    return path


def _folder(tmp: Path, classes=("a", "b"), images: bool = True, name: str = "imgs", n: int = 4,
            broken: bool = False) -> Path:
    import numpy as np
    from PIL import Image

    for c in classes:
        (tmp / name / c).mkdir(parents=True, exist_ok=True)
        if images:
            for i in range(n):
                Image.fromarray(np.zeros((8, 8, 3), dtype=np.uint8)).save(tmp / name / c / f"{i}.png")
    if broken:
        (tmp / name / classes[0] / "broken.png").write_bytes(b"not a png")
    return tmp / name


_CHAT = [{"role": "user", "content": "reverse : a b"}, {"role": "assistant", "content": "b a"}]
_ROWS = [(f"good film number {i}" if i % 2 else f"bad movie number {i}", i % 2) for i in range(40)]


def _table(tmp: Path, rows=None, header: str = "text,label", name: str = "train.csv") -> Path:
    path = tmp / name
    path.write_text(header + "\n" + "".join(f"{a},{b}\n" for a, b in (rows if rows is not None else _ROWS)))
    return path


def _jsonl(tmp: Path, records: list[dict], name: str = "train.jsonl") -> Path:
    import json

    path = tmp / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _bad_jsonl(tmp: Path) -> Path:
    path = _jsonl(tmp, [{"text": a, "label": b} for a, b in _ROWS], name="bad.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:5]) + "{oops\n" + "".join(lines[5:]))
    return path


def _latin1_csv(tmp: Path) -> Path:
    path = tmp / "latin1.csv"
    path.write_bytes(("text,label\n" + "".join(f"caf\xe9 {a},{b}\n" for a, b in _ROWS)).encode("latin-1"))
    return path


def _image_file(path: Path, kind: str) -> Path:
    """One image file as a user's folder may hold it: whole, cut short by an interrupted copy, or empty."""
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    pixels = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)  # noise: no tiny JPEG
    Image.fromarray(pixels).save(buf, format="JPEG" if path.suffix == ".jpg" else "PNG")
    raw = buf.getvalue()
    path.write_bytes({"whole": raw, "truncated": raw[:len(raw) * 2 // 3], "empty": b""}[kind])
    return path


def _huge_png(path: Path, width: int = 15000, height: int = 13000) -> Path:
    """A PNG declaring 195 megapixels (a whole slide, a satellite tile): its header alone is what PIL's guard reads."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


def _bad_image_folder(tmp: Path, split: str, kind: str, name: str) -> list:
    """--train_dir and --validation_dir of good images, one bad file in the `split` folder."""
    train, val = _folder(tmp), _folder(tmp, name="val")
    target = {"train": train, "val": val}[split] / "a" / name
    _huge_png(target) if kind == "huge" else _image_file(target, kind)
    return ["--train_dir", train, "--validation_dir", val]


def _joined_csv(tmp: Path, name: str = "joined.csv") -> Path:
    """Two csv files joined with `cat`: the second's header is a row of the data."""
    first, second = _table(tmp, _ROWS[:20], name="a.csv").read_text(), _table(tmp, _ROWS[20:], name="b.csv").read_text()
    return _write(tmp / name, first + second)


def _pandas_json(tmp: Path, orient: str | None = None) -> Path:
    """What pandas writes by default (orient="columns") or with orient="index": a dict of dicts, not records."""
    import pandas as pd

    path = tmp / "frame.json"
    df = pd.DataFrame({"text": [a for a, _ in _ROWS], "label": [b for _, b in _ROWS]})
    df.to_json(path) if orient is None else df.to_json(path, orient=orient)
    return path


def _dataset_dir(tmp: Path) -> Path:
    (tmp / "ds").mkdir()
    _table(tmp / "ds", name="test.csv")
    return tmp / "ds"


def _model_dir(tmp: Path, kind: str, tokenizer: bool = True) -> Path:
    """A local model directory as a user has one: config.json (and a tokenizer), no weights needed to refuse."""
    from transformers import BertConfig, ViTConfig

    from shared.core.data import build_word_tokenizer

    path = tmp / f"{kind}-model"
    config = {"vit": ViTConfig, "bert": BertConfig}[kind](hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=64)
    config.save_pretrained(path)
    if tokenizer:
        build_word_tokenizer(["a b c"], "text-classification").save_pretrained(path)
    return path


def _classifier_dir(tmp: Path, labels: int = 3) -> Path:
    """A fine-tuned classifier as a user has one: config.json of `labels` labels, its weights and its tokenizer."""
    from transformers import BertConfig, BertForSequenceClassification

    from shared.core.data import build_word_tokenizer

    path = tmp / f"classifier-{labels}"
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                        num_labels=labels)
    BertForSequenceClassification(config).save_pretrained(path)
    build_word_tokenizer([t for t, _ in _ROWS], "text-classification").save_pretrained(path)
    return path


def _cut_weights(tmp: Path) -> Path:
    """A model directory whose model.safetensors was copied half-way (an interrupted copy or download)."""
    path = _classifier_dir(tmp, labels=2)
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    return path


def _finished_checkpoint(tmp: Path) -> Path:
    from tests.conftest import run_recipe

    run_recipe("baseline", tmp / "done", "--max_train_steps", 4, "--checkpointing_steps", 4, "--no_save_model")
    return tmp / "done" / "checkpoints" / "step_00000004"


def _saved_at_batch_4(tmp: Path, recipe: str) -> Path:
    from tests.conftest import run_recipe

    run_recipe(recipe, tmp / "saved", "--max_train_steps", 2, "--checkpointing_steps", 2,
               "--per_device_train_batch_size", 4, "--no_save_model")
    return tmp / "saved" / "checkpoints" / "step_00000002"


def _made(path: Path) -> Path:
    path.mkdir(parents=True)
    return path


def _line_from(tmp: Path, start: Path) -> Path:
    """A run folder whose branch 1 began at `start` (--resume_from_checkpoint of another run's checkpoint) and was
    killed before its first checkpoint: checkpoints/lineage.json as the run wrote it, no step_N."""
    import json

    (tmp / "out" / "checkpoints").mkdir(parents=True)
    (tmp / "out" / "checkpoints" / "lineage.json").write_text(json.dumps([
        {"branch": 0, "parent": None, "from_step": None},
        {"branch": 1, "parent": 0, "from_step": 2, "from": str(start), "changes": {}}]))
    return tmp / "out"


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
    out: object = None  # tmp -> the --output_dir (default tmp/out)
    env: dict = field(default_factory=dict)  # what `accelerate launch --config_file ...` would set
    # The fix followed: the argv (and recipe, env) the message says to use; with the setup's argv it must pass every
    # start-up check (test_following_the_fix_passes_the_checks). None: a fix of the data, or of another launch.
    fix: list | None = None
    fix_recipe: str = ""
    fix_env: dict = field(default_factory=dict)


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
         ["--model_name_or_path 'no-such-org/no-such-model': could not load the config",
          "the hub did not serve it", "pass a local directory"]),
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
         ["--per_device_train_batch_size: must be at least 1"]),
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
    Case("deepspeed-optimizer-without-kernel", "a DeepSpeed JSON optimizer whose kernel this machine lacks (Lamb "
         "on CPU: a raw 'This op had not been implemented on CPU backend' from prepare())", [],
         ["optimizer Lamb in the DeepSpeed JSON", "FusedLambBuilder kernel", "Use AdamW"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, optimizer={"type": "Lamb", "params": {"lr": "auto"}})]),
    Case("deepspeed-optimizer-untested-under-zero", "a torch.optim optimizer in a DeepSpeed JSON under ZeRO (a raw "
         "AssertionError 'untested ZeRO Optimizer' from prepare())", [],
         ["optimizer SGD in the DeepSpeed JSON", "under ZeRO stage 3", '"zero_allow_untested_optimizer": true'],
         recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, optimizer={"type": "SGD", "params": {"lr": "auto"}})]),
    Case("deepspeed-adagrad-zero2", "Adagrad in a DeepSpeed JSON under ZeRO-1/2 without optimizer offload (a raw "
         "IndexError from DeepSpeed's first backward)", [],
         ["optimizer Adagrad in the DeepSpeed JSON", "under ZeRO stage 2 without optimizer offload",
          "offload_optimizer device cpu"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, optimizer={"type": "Adagrad", "params": {"lr": "auto"}},
                                                         zero_optimization={"stage": 2})]),
    Case("deepspeed-optimizer-unknown", "a DeepSpeed JSON optimizer neither DeepSpeed nor torch.optim has (a raw "
         "AttributeError from prepare())", [],
         ["optimizer sgd in the DeepSpeed JSON", "nor a class of torch.optim", "exact case: SGD"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, optimizer={"type": "sgd", "params": {"lr": "auto"}})]),
    Case("deepspeed-json-malformed", "a DeepSpeed JSON with a trailing comma (a raw JSONDecodeError traceback before)",
         [], ["--deepspeed_config", "could not load the DeepSpeed JSON (JSONDecodeError", "python -m json.tool"],
         recipe="zero", setup=lambda t: ["--deepspeed_config", _write(t / "ds.json", '{"zero_optimization": '
                                                                      '{"stage": 3},}')]),
    Case("deepspeed-json-missing", "a DeepSpeed JSON that does not exist", ["--deepspeed_config", "no_such_ds.json"],
         ["--deepspeed_config 'no_such_ds.json': could not load the DeepSpeed JSON: it does not exist",
          "Pass an existing path"], recipe="zero"),
    Case("deepspeed-json-folder", "a folder passed as the DeepSpeed JSON", [],
         ["could not load the DeepSpeed JSON: it is a folder, and a file is expected", "Pass one of its files",
          "ds.json"], recipe="zero", setup=lambda t: ["--deepspeed_config", _ds_json(t).parent]),
    Case("deepspeed-json-from-accelerate-config", "the accelerate config's deepspeed_config_file naming a JSON that "
         "is not there", [], ["deepspeed_config_file (the accelerate config) 'missing_ds.json'", "does not exist"],
         recipe="zero", env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": "missing_ds.json"}),
    Case("nvme-without-path", "NVMe offload without a directory to swap to", ["--offload", "nvme"],
         ["to nvme needs a directory", "pass --nvme_path DIR"], recipe="zero3_offload"),
    Case("disk-offload-without-dir", "activation offloading to disk without a directory for the files",
         ["--offload_to", "disk", "--offload_mode", "checkpointed"],
         ["needs --offload_dir and --offload_mode checkpointed", "Pass --offload_dir DIR"],
         recipe="activation_offloading",
         fix=["--offload_to", "disk", "--offload_mode", "checkpointed", "--offload_dir", "outputs/activations"]),
    Case("paged-optimizer-without-cuda", "a paged 8-bit optimizer on a machine without CUDA", ["--paged"],
         ["--paged needs a CUDA device", "Drop --paged"], recipe="optim_8bit"),
    Case("merge-without-adapter", "merging an adapter that the run is told not to save", ["--merge", "--no_save_model"],
         ["--no_save_model skips saving it", "Drop one of them"], recipe="qlora"),
    Case("fsdp-single-process", "FSDP with one process: nothing to shard over", [],
         ["recipes/fsdp.py needs at least 2 processes", "accelerate_configs/fsdp.yaml"], recipe="fsdp"),
    Case("hsdp-single-process", "HSDP replicas asked of one process", ["--dp_replicate_size", "2"],
         ["--dp_replicate_size 2 with one process", "Launch R x S processes: accelerate_configs/hsdp.yaml"],
         recipe="fsdp"),
    Case("hsdp-sizes-not-filling", "HSDP sizes whose product is not the process count (4 launched)",
         ["--dp_replicate_size", "2", "--dp_shard_size", "3"],
         ["--dp_replicate_size 2 --dp_shard_size 3 with 4 processes", "Pass sizes whose product is 4"],
         recipe="fsdp", env={"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "WORLD_SIZE": "4"}),
    Case("microbatches-not-dividing", "a pipeline batch that micro-batches do not divide",
         ["--per_device_train_batch_size", "6", "--n_microbatches", "4"],
         ["not divisible by --n_microbatches", "Pick a batch size that is a multiple of it"],
         recipe="pipeline_parallel"),
    Case("quantized-without-lora", "quantized (frozen) base weights and nothing to train", ["--load_in", "4bit"],
         ["quantized base weights are frozen", "Add --lora"], recipe="combined"),
    Case("8bit-optimizer-under-zero-offload", "an 8-bit optimizer under ZeRO offload (DeepSpeed would swap it for "
         "its 32-bit CPU Adam)", ["--optim", "adamw_bnb_8bit"], ["would silently not be used",
                                                                 "Drop --optim adamw_bnb_8bit"],
         recipe="combined", env={"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "2",
                                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "cpu",
                                 "ACCELERATE_CONFIG_DS_FIELDS": ""}),  # as accelerate launch sets it
    Case("selective-without-checkpointing", "a selective checkpointing policy with checkpointing off",
         ["--checkpointing_policy", "selective"], ["--gradient_checkpointing is off", "Add --gradient_checkpointing"],
         recipe="combined", fix=["--checkpointing_policy", "selective", "--gradient_checkpointing"]),
    Case("optimizer-in-backward-under-ddp", "the optimizer step in backward under DDP (it would step before the "
         "gradients are averaged)", ["--optimizer_in_backward", "--max_grad_norm", "0"],
         ["before the processes' gradients are averaged", "Launch one process"], recipe="combined",
         env={"WORLD_SIZE": "2"}),
    Case("nvme-offload-under-zero2", "NVMe optimizer offload under ZeRO-2 (DeepSpeed would keep it in CPU memory)",
         [], ["to nvme under ZeRO stage 2", "Use ZeRO-3 for NVMe offload"], recipe="zero",
         setup=lambda t: ["--nvme_path", t / "nvme", "--deepspeed_config", _ds_json(t, zero_optimization={
             "stage": 2, "offload_optimizer": {"device": "nvme"}})]),
    # ---- names of earlier versions: refused at parse time with today's name (shared/core/args.py RENAMED_*)
    Case("old-optim-adamw_8bit", "--optim adamw_8bit: bitsandbytes' in combined.py, torchao's in optim_low_bit.py",
         ["--optim", "adamw_8bit"], ["'adamw_8bit' is an old name", "adamw_bnb_8bit (bitsandbytes)",
                                     "adamw_torchao_8bit (torchao)"], recipe="optim_low_bit"),
    Case("old-optim-adamw_8bit-combined", "--optim adamw_8bit where only bitsandbytes' 8-bit AdamW is offered",
         ["--optim", "adamw_8bit"], ["'adamw_8bit' is an old name", "pass adamw_bnb_8bit (bitsandbytes)"],
         recipe="combined"),
    Case("old-optim-bnb_adamw_8bit", "--optim bnb_adamw_8bit, the old name of bitsandbytes' 8-bit AdamW",
         ["--optim", "bnb_adamw_8bit"], ["'bnb_adamw_8bit' is an old name", "pass adamw_bnb_8bit"],
         recipe="optim_low_bit"),
    Case("old-optim-adamw8bit", "--optim adamw8bit, the planner's old name of bitsandbytes' 8-bit AdamW",
         ["--optim", "adamw8bit"], ["'adamw8bit' is an old name", "pass adamw_bnb_8bit"], recipe="combined"),
    Case("old-optim-adamw_4bit", "--optim adamw_4bit, the old name of torchao's 4-bit AdamW",
         ["--optim", "adamw_4bit"], ["'adamw_4bit' is an old name", "pass adamw_torchao_4bit (torchao)"],
         recipe="optim_low_bit"),
    Case("old-optim-adamw_fp8", "--optim adamw_fp8, the old name of torchao's FP8 AdamW",
         ["--optim", "adamw_fp8"], ["'adamw_fp8' is an old name", "pass adamw_torchao_fp8 (torchao)"],
         recipe="optim_low_bit"),
    Case("old-flag-bits", "qlora.py's old --bits 4", ["--bits", "4"], ["--bits was renamed", "pass --load_in 4bit"],
         recipe="qlora"),
    Case("old-flag-bits-8", "qlora.py's old --bits 8, to combined.py", ["--bits", "8"],
         ["--bits was renamed", "pass --load_in 8bit"], recipe="combined"),
    Case("impossible-sparsity", "a pruning target of 150%", ["--target_sparsity", "1.5"],
         ["--target_sparsity: must be less than 1"], recipe="pruning"),
    Case("pruning-past-the-end", "a pruning schedule that ends after training does", ["--pruning_end_step", "9"],
         ["--pruning_end_step <= training steps"], recipe="pruning"),
    # ---- the data's content: labels
    Case("empty-label-cell", "an empty label cell (it would become a class named 'None')", [],
         ["label column 'label' has 1 empty cell(s), row 40", "Fill or drop those rows"],
         setup=lambda t: ["--train_file", _table(t, [*_ROWS[:-1], ("nice one", "")])]),
    Case("class-only-in-validation", "a class that occurs only in validation (its head row would never train)", [],
         ["validation labels [7] never occur in the training data", "Add training examples of them"],
         setup=lambda t: ["--train_file", _table(t),
                          "--validation_file", _table(t, [*_ROWS[:9], ("odd", 7)], name="v.csv")]),
    Case("one-class", "a training set of one class (accuracy 1.0, nothing learned)", [],
         ["holds one class (0)", "Add examples of the other classes"],
         setup=lambda t: ["--train_file", _table(t, [(f"text {i}", 0) for i in range(40)])]),
    Case("one-class-image-folder", "an image folder with one class folder (was called a 'label column' holding "
         "class 0, with a --label_column fix)", ["--task", "image-classification"],
         ["holds one class folder ('a')", "<class_name>/ per class"],
         setup=lambda t: ["--train_dir", _folder(t, classes=("a",), n=8)]),
    Case("free-text-labels", "--label_column naming a free-text column (a classifier of 36 classes seen once)",
         ["--label_column", "comment"], ["36 different values in 36 training rows", "Pass --label_column naming"],
         setup=lambda t: ["--train_file", _table(t, [(f"text {i}", f"comment {i}") for i in range(40)],
                                                  header="text,comment")]),
    Case("negative-label", "a negative label (GLUE test splits mark unlabelled rows with -1)", [],
         ["has negative labels (row 40, e.g. -1)", "Drop those rows"],
         setup=lambda t: ["--train_file", _table(t, [*_ROWS[:-1], ("x", -1)])]),
    Case("fractional-label", "fractional labels: a regression target (STS-B) for a classifier", [],
         ["holds fractions (row 2", "Pass --label_column naming a column of classes"],
         setup=lambda t: ["--train_file", _table(t, [(f"t {i}", i / 10) for i in range(40)])]),
    Case("multi-label", "a list of labels per row (multi-label targets)", [],
         ["holds list values", "not multi-label targets"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": f"t {i}", "label": [i % 2, 1]} for i in range(40)])]),
    Case("repeated-header-row", "two csv files joined with `cat`, the header repeated mid-file (a class named "
         "'label' would train)", [], ["training data repeats its header row at row 21", "Delete those rows"],
         setup=lambda t: ["--train_file", _joined_csv(t)]),
    Case("csv-unquoted-delimiter", "a comma inside an unquoted text on the first row (pandas made the texts the row "
         "index and read the labels as texts)", [], ["line 2 has 3 fields where the header has 2", "Quote such texts"],
         setup=lambda t: ["--train_file", _table(t, [("bad, slow movie", 0), *_ROWS[1:]])]),
    Case("csv-unquoted-delimiter-later", "commas inside unquoted texts further down a csv", [],
         ["line 12 has 3 fields", "(and 1 more line(s))", "Quote such texts"],
         setup=lambda t: ["--train_file", _table(t, [(f"{a}, really" if i in (10, 20) else a, b)
                                                     for i, (a, b) in enumerate(_ROWS)])]),
    Case("csv-column-named-twice", "a csv header naming a column twice (pandas renamed the second 'text.1')", [],
         ["the header names 'text' twice", "Give every column its own name"],
         setup=lambda t: ["--train_file", _table(t, [(f"{a},{a}", b) for a, b in _ROWS], header="text,text,label")]),
    Case("repeated-header-in-validation", "the header repeated in a joined validation file", [],
         ["validation data repeats its header row at row 21", "tail -n +2"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _joined_csv(t, name="v.csv")]),
    Case("mixed-label-types", "jsonl labels 0/1 in some rows and 'neg'/'pos' in others (4 classes for 2)", [],
         ["mixes numbers and strings (strings at row 21", "Write every label one way"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": a, "label": b if i < 20 else ["neg", "pos"][b]}
                                                      for i, (a, b) in enumerate(_ROWS)])]),
    Case("bool-and-word-labels", "jsonl labels true/false in most rows, \"yes\"/\"no\" in two", [],
         ["mixes numbers and strings (strings at row 4, 40, e.g. 'yes')", "all numbers, or all names"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": a, "label": ["no", "yes"][b] if i in (3, 39) else bool(b)}
                                                      for i, (a, b) in enumerate(_ROWS)])]),
    Case("label-types-differ-across-splits", "training labels \"0\"/\"1\" (strings), validation labels 0/1", [],
         ["validation labels [0, 1] are ints, the training labels the same as strs", 'numbers (0, not "0"'],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": a, "label": str(b)} for a, b in _ROWS]),
                          "--validation_file", _jsonl(t, [{"text": f"new {a}", "label": b} for a, b in _ROWS[:10]],
                                                      name="v.jsonl")]),
    Case("label-types-differ-reversed", "training labels 0/1, validation labels \"0\"/\"1\"", [],
         ["validation labels ['0', '1'] are strs, the training labels the same as ints", "one way in both splits"],
         setup=lambda t: ["--train_file", _table(t),
                          "--validation_file", _jsonl(t, [{"text": f"new {a}", "label": str(b)} for a, b in _ROWS[:10]],
                                                      name="v.jsonl")]),
    # ---- the data's content: texts
    Case("numeric-text-column", "a text column of numbers", [],
         ["column 'text' holds int values, not text", "Pass --text_column naming the column of texts"],
         setup=lambda t: ["--train_file", _table(t, [(i, i % 2) for i in range(40)])]),
    Case("empty-text-cell", "an empty text cell", [],
         ["column 'text' has 1 empty cell(s), row 40", "Fill or drop those rows"],
         setup=lambda t: ["--train_file", _table(t, [*_ROWS[:-1], ("", 1)])]),
    Case("numeric-text-for-causal-lm", "a causal-LM text column of numbers", ["--task", "causal-lm"],
         ["holds int values, not text", "Pass --text_column"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": i} for i in range(40)])]),
    Case("missing-pair-column", "--text_pair_column naming a column that is not there", ["--text_pair_column", "s2"],
         ["--text_pair_column 's2' is not a column", "Pass --text_pair_column with one of them"],
         setup=lambda t: ["--train_file", _table(t)]),
    Case("pair-column-for-causal-lm", "--text_pair_column for a task without pairs",
         ["--task", "causal-lm", "--text_pair_column", "b"],
         ["--text_pair_column serves --task text-classification", "Drop it"]),
    Case("per-document-packing-in-pipeline", "per-document packing in a recipe whose stages use a plain causal mask",
         ["--task", "causal-lm", "--packing", "per_document"],
         ["would let packed documents attend to each other", "Use --packing concat"], recipe="pipeline_parallel"),
    Case("too-little-text", "a text file shorter than one packed block", ["--task", "causal-lm"],
         ["fewer than one block of --max_seq_length 128", "Lower --max_seq_length"],
         setup=lambda t: ["--train_file", _write(t / "short.txt", "a few words\nand a few more\nthe end\n")]),
    # ---- files that do not parse
    Case("malformed-json-line", "a json-lines file with a broken line", [],
         ["bad.jsonl: cannot be read as json, line 6 is not valid JSON", "Fix or remove that line"],
         setup=lambda t: ["--train_file", _bad_jsonl(t)]),
    Case("not-utf8", "a csv saved as Latin-1", [],
         ["cannot be read as csv, line 2 is not UTF-8", "save the file as UTF-8 csv"],
         setup=lambda t: ["--train_file", _latin1_csv(t)]),
    Case("columns-differ-across-splits", "a validation file with other columns than train", [],
         ["must have the same columns", "Rename or drop columns"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _table(t, header="sentence,target",
                                                                                   name="v.csv")]),
    Case("empty-validation-file", "a validation file with a header and no rows", [],
         ["is empty", "Pass a file with rows"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _empty_csv(t)]),
    Case("one-line-txt", "a one-line text file and no validation file", ["--task", "causal-lm"],
         ["holds 1 row: too few to hold out 10%", "Pass --validation_file"],
         setup=lambda t: ["--train_file", _write(t / "one.txt", "just one line of text\n")]),
    Case("validation-file-is-train-file", "--validation_file naming the training file (evaluation on trained rows)",
         [], ["All 40 validation rows occur in the training data", "or drop the flag: 10% of the training rows"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _table(t)]),
    Case("validation-file-is-a-copy", "a validation file with the training file's content under another name", [],
         ["All 40 validation rows occur in the training data", "Pass held-out data as --validation_file"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _table(t, name="copy.csv")]),
    Case("validation-subset-of-train", "a validation file cut from the training file (its rows trained on)",
         ["--task", "causal-lm"], ["All 5 validation rows occur in the training data", "Pass held-out data"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"text": a} for a, _ in _ROWS]),
                          "--validation_file", _jsonl(t, [{"text": a} for a, _ in _ROWS[10:15]], name="v.jsonl")]),
    Case("validation-dir-is-train-dir", "--validation_dir naming the training folder",
         ["--task", "image-classification"], ["All 8 validation rows occur in the training data", "drop the flag"],
         setup=lambda t: ["--train_dir", _folder(t), "--validation_dir", _folder(t)]),
    Case("seq-length-1", "--max_seq_length 1 (below the special tokens the tokenizer cuts nothing; a long text "
         "crashed step 2)", ["--max_seq_length", "1"],
         ["--max_seq_length 1 leaves 0 token(s) of text", "2 special tokens", "Pass --max_seq_length 6 or more"]),
    Case("seq-length-2", "--max_seq_length 2: a classifier would see [CLS] [SEP] alone", ["--max_seq_length", "2"],
         ["--max_seq_length 2 leaves 0 token(s)", "Pass --max_seq_length 6 or more"]),
    Case("seq-length-1-causal-lm", "--max_seq_length 1 for a causal LM (blocks without a target: a NaN loss)",
         ["--task", "causal-lm", "--max_seq_length", "1"], ["causal-lm sample", "Pass --max_seq_length 6 or more"]),
    Case("seq-length-pairs", "--max_seq_length 5 for sentence pairs ([CLS] a [SEP] b [SEP]: 3 special tokens)",
         ["--text_pair_column", "second", "--max_seq_length", "5"],
         ["leaves 2 token(s) of text", "3 special tokens", "Pass --max_seq_length 7 or more"],
         setup=lambda t: ["--train_file", _table(t, [(f"{a},{a} again", b) for a, b in _ROWS],
                                                 header="text,second,label")]),
    Case("packing-for-classification", "--packing per_document with text classification (silently ignored)",
         ["--packing", "per_document"], ["--packing per_document with --task text-classification",
                                         "Drop --packing, or pass --task causal-lm"]),
    Case("packing-for-images", "--packing concat with image classification", ["--task", "image-classification",
                                                                              "--packing", "concat"],
         ["--packing concat with --task image-classification", "Drop --packing"]),
    Case("pandas-default-json", "a JSON file from pandas' df.to_json(path): a dict of columns, not records", [],
         ["is one JSON object of columns", 'df.to_json(path, orient="records", lines=True)'],
         setup=lambda t: ["--train_file", _pandas_json(t)]),
    Case("pandas-index-json", "a JSON file from df.to_json(path, orient=\"index\"): a dict of rows", [],
         ["is one JSON object of columns", 'orient="records", lines=True'],
         setup=lambda t: ["--train_file", _pandas_json(t, orient="index")]),
    Case("csv-for-images", "a table without an image column for image classification",
         ["--task", "image-classification"], ["Found no image column among", "Pass --image_column"],
         setup=lambda t: ["--train_file", _table(t)]),
    Case("missing-image-column", "--image_column naming a column that is not there",
         ["--task", "image-classification", "--image_column", "photo"],
         ["--image_column 'photo' is not a column", "Pass --image_column with one of them"],
         setup=lambda t: ["--train_file", _table(t)]),
    Case("broken-validation-image", "an image in the validation folder that does not open (evaluation would crash "
         "after training)", ["--task", "image-classification"],
         ["1 validation image(s) do not open", "broken.png", "Remove or replace them"],
         setup=lambda t: ["--train_dir", _folder(t), "--validation_dir", _folder(t, name="val", broken=True)]),
    Case("truncated-validation-jpeg", "a JPEG cut short by an interrupted copy (opened and verified, it crashed "
         "evaluation after training)", ["--task", "image-classification"],
         ["1 validation image(s) do not open or decode", "cut.jpg", "image file is truncated", "copy it again"],
         setup=lambda t: _bad_image_folder(t, "val", "truncated", "cut.jpg")),
    Case("truncated-png", "a truncated PNG in the training folder", ["--task", "image-classification"],
         ["1 training image(s) do not open or decode", "cut.png", "truncated", "Remove or replace them"],
         setup=lambda t: _bad_image_folder(t, "train", "truncated", "cut.png")),
    Case("zero-byte-image", "an empty image file (a copy that never started)", ["--task", "image-classification"],
         ["empty.jpg (UnidentifiedImageError", "Remove or replace them"],
         setup=lambda t: _bad_image_folder(t, "val", "empty", "empty.jpg")),
    Case("195-megapixel-image", "a 195-megapixel image (PIL's decompression-bomb guard, raised as a raw traceback)",
         ["--task", "image-classification"],
         ["huge.png: Image size (195000000 pixels) exceeds limit", "Resize it", "PIL.Image.MAX_IMAGE_PIXELS"],
         setup=lambda t: _bad_image_folder(t, "train", "huge", "huge.png")),
    Case("missing-validation-dir", "a validation folder that does not exist", ["--task", "image-classification"],
         ["--validation_dir", "does not exist"], setup=lambda t: ["--train_dir", _folder(t), "--validation_dir",
                                                                 t / "nowhere"]),
    # ---- datasets that cannot be loaded
    Case("missing-local-dataset", "--dataset_name naming a local path that does not exist",
         ["--dataset_name", "./no/such/dataset"], ["does not exist", "--train_file for a local file"]),
    Case("offline-hub-dataset", "a hub dataset with the hub out of reach", ["--dataset_name", "someorg/somedata"],
         ["Could not load the hub dataset 'someorg/somedata'", "pass local data: --train_file"]),
    Case("dataset-without-train-split", "a dataset directory with no train split", [],
         ["has no 'train' split", "--train_file and --validation_file"],
         setup=lambda t: ["--dataset_name", _dataset_dir(t)]),
    # ---- models that do not fit
    Case("model-for-another-task", "a ViT directory for text classification", [],
         ["is a vit model, which has no text-classification head", "Pass --task image-classification"],
         setup=lambda t: ["--model_name_or_path", _model_dir(t, "vit")]),
    Case("encoder-as-causal-lm", "a BERT (bidirectional) directory as a causal LM (the loss falls to 0, nothing "
         "learned)", ["--task", "causal-lm"], ["bidirectional bert encoder", "Use a decoder model"],
         setup=lambda t: ["--model_name_or_path", _model_dir(t, "bert")]),
    Case("tokenizer-less-model-dir", "a model directory without tokenizer files", [],
         ["holds no tokenizer files", "Pass --tokenizer_name"],
         setup=lambda t: ["--model_name_or_path", _model_dir(t, "bert", tokenizer=False)]),
    Case("encoder-positions", "texts cut longer than an encoder's position embeddings", ["--max_seq_length", "512"],
         ["exceeds the model's 128 positions", "Pass --max_seq_length 128"]),
    # ---- flag values out of range, and combinations that would do less than asked
    Case("negative-grad-norm", "a negative clipping norm (gradient ascent)", ["--max_grad_norm", "-1"],
         ["--max_grad_norm: must be at least 0", "0: no clipping"]),
    Case("zero-epochs", "0 epochs", ["--num_train_epochs", "0"], ["--num_train_epochs: must be greater than 0"]),
    Case("zero-checkpointing-steps", "checkpoints every 0 steps (none would be written)",
         ["--checkpointing_steps", "0"], ["--checkpointing_steps: must be at least 1", "unset: never"]),
    Case("zero-train-samples", "--max_train_samples 0", ["--max_train_samples", "0"],
         ["--max_train_samples: must be at least 1"]),
    Case("zero-eval-batch", "an evaluation batch of 0", ["--per_device_eval_batch_size", "0"],
         ["--per_device_eval_batch_size: must be at least 1"]),
    Case("word-for-a-number", "a word where a number goes", ["--per_device_train_batch_size", "sixteen"],
         ["--per_device_train_batch_size: expected an integer, got 'sixteen'"]),
    Case("nan-learning-rate", "a learning rate of nan", ["--learning_rate", "nan"],
         ["--learning_rate", "must be", "finite"]),
    Case("zero-learning-rate", "a learning rate of 0 (nothing would change)", ["--learning_rate", "0"],
         ["--learning_rate: must be greater than 0"]),
    Case("negative-weight-decay", "a negative weight decay", ["--weight_decay", "-0.1"],
         ["--weight_decay: must be at least 0"]),
    Case("negative-warmup", "negative warmup steps", ["--num_warmup_steps", "-5"],
         ["--num_warmup_steps: must be at least 0"]),
    Case("negative-workers", "a negative number of dataloader workers", ["--dataloader_num_workers", "-1"],
         ["--dataloader_num_workers: must be at least 0"]),
    Case("zero-logging-steps", "logging every 0 steps", ["--logging_steps", "0"],
         ["--logging_steps: must be at least 1"]),
    Case("warmup-past-the-end", "warmup longer than the run (the learning rate never peaks)",
         ["--num_warmup_steps", "5"], ["--num_warmup_steps 5 >= --max_train_steps 2", "Lower --num_warmup_steps"]),
    Case("save-limit-without-checkpoints", "a checkpoint limit with no checkpoints written",
         ["--save_total_limit", "2"], ["none are written without --checkpointing_steps", "Pass --checkpointing_steps"]),
    Case("async-checkpoint-without-checkpoints", "background checkpoint writes with no checkpoints written",
         ["--async_checkpoint"], ["none are written without --checkpointing_steps", "Pass --checkpointing_steps"]),
    Case("async-checkpoint-without-dcp", "background checkpoint writes in a recipe that saves with torch.save",
         ["--async_checkpoint", "--checkpointing_steps", "1"],
         ["--async_checkpoint: recipes/baseline.py writes its checkpoints with torch.save", "recipes/fsdp.py"]),
    Case("tracker-typo", "a tracker name with a typo (pip would install a package of that name)",
         ["--report_to", "tensorbord"], ["not a tracker Accelerate knows", "Did you mean tensorboard?"]),
    Case("unwritable-output-dir", "an output directory that cannot be written (it would fail after training)", [],
         ["is a file, not a directory", "Pass another path"], out=lambda t: _write(t / "afile", "x") / "out"),
    Case("resume-past-the-end", "resuming a checkpoint past the run's last step (a lowered --max_train_steps)", [],
         ["is at step 4, past this run's 2 steps", "Pass --max_train_steps 4 or more"],
         setup=lambda t: ["--resume_from_checkpoint", _finished_checkpoint(t)]),
    Case("resume-line-from-a-lost-checkpoint", "--resume_from_checkpoint latest where the run's newest branch began "
         "at another folder's checkpoint, since deleted, and has none of its own (it trained from scratch, unsaid)",
         ["--resume_from_checkpoint", "latest"],
         ["branch 1 of the run in", "cannot be resumed (it no longer exists)", "Pass --resume_from_checkpoint"],
         out=lambda t: _line_from(t, t / "gone" / "checkpoints" / "step_00000002")),
    Case("resume-the-run-folder", "--resume_from_checkpoint naming the run's own folder (--output_dir), not a step of "
         "it (it was told to pass an --output_dir apart from its input)", [],
         ["is this run's folder (--output_dir), not one of its checkpoints", "Pass --resume_from_checkpoint latest"],
         setup=lambda t: ["--resume_from_checkpoint", _made(t / "out" / "checkpoints").parent]),
    Case("resume-the-checkpoints-folder", "--resume_from_checkpoint naming the run's checkpoints/ folder", [],
         ["is this run's checkpoints folder, not one of its checkpoints", "a step_N folder under"],
         setup=lambda t: ["--resume_from_checkpoint", _made(t / "out" / "checkpoints")]),
    Case("resume-another-recipes-checkpoint", "resuming another recipe's checkpoint (it was refused for its precision,"
         " then, once that was followed, as '--recipe was baseline', a flag that does not exist)",
         ["--per_device_train_batch_size", 4],
         ["was written by recipes/baseline.py, and this is recipes/mixed_precision.py",
          "Resume it with recipes/baseline.py"], recipe="mixed_precision",
         setup=lambda t: ["--resume_from_checkpoint", _saved_at_batch_4(t, "baseline")]),
    Case("resume-another-global-batch", "resuming on another per-device batch, process count or accumulation whose "
         "product, the global batch, is not the checkpoint's (docs/resharding.md)",
         ["--per_device_train_batch_size", 2],
         ["the global batch (per device x processes x accumulation) was 4, now 2",
          "pass --per_device_train_batch_size 4"],
         setup=lambda t: ["--resume_from_checkpoint", _saved_at_batch_4(t, "baseline")]),
    Case("resume-layout-not-resharded", "resuming on another layout a recipe whose checkpoints do not reshard",
         ["--per_device_train_batch_size", 2], ["recipes/mixed_precision.py resumes only on the layout that wrote it",
                                                 "resume with that run's settings"], recipe="mixed_precision",
         setup=lambda t: ["--resume_from_checkpoint", _saved_at_batch_4(t, "mixed_precision")]),
    Case("dora-without-lora", "DoRA asked for with no LoRA adapters to shape", ["--use_dora"],
         ["--use_dora makes the LoRA adapters DoRA adapters, and --lora trains none", "Add --lora"],
         recipe="combined"),
    Case("chunked-loss-for-classification", "a chunked vocabulary loss for a task without a vocabulary head",
         ["--chunked_loss"], ["has no vocabulary head", "Pass --task causal-lm"], recipe="combined"),
    # ---- recipe flags out of range
    Case("zero-lora-rank", "a LoRA rank of 0", ["--lora_r", "0"], ["--lora_r: must be at least 1"], recipe="qlora"),
    Case("lora-dropout-of-one", "a LoRA dropout of 1 (every adapter input dropped)", ["--lora_dropout", "1"],
         ["--lora_dropout: must be less than 1"],
         recipe="qlora"),
    Case("zero-microbatches", "0 pipeline micro-batches", ["--n_microbatches", "0"],
         ["--n_microbatches: must be at least 1"], recipe="pipeline_parallel"),
    Case("zero-loss-chunk", "a loss chunk of 0 tokens", ["--loss_chunk_size", "0"],
         ["--loss_chunk_size: must be at least 1"], recipe="chunked_loss"),
    Case("zero-loss-scale", "an fp16 loss scale of 0 (every gradient would be 0)", ["--init_loss_scale", "0"],
         ["--init_loss_scale: must be greater than 0"], recipe="mixed_precision"),
    Case("percentile-clipping-over-100", "an 8-bit optimizer's percentile clipping above 100",
         ["--percentile_clipping", "101"], ["--percentile_clipping: must be at most 100"], recipe="optim_8bit"),
    Case("zero-qat-group", "a QAT quantization group of 0 weights", ["--group_size", "0"],
         ["--group_size: must be at least 1"], recipe="qat"),
    Case("zero-pruning-frequency", "pruning every 0 steps", ["--pruning_frequency", "0"],
         ["--pruning_frequency: must be at least 1"], recipe="pruning"),
    Case("compile-not-wired", "--torch_compile in a recipe whose model does not go through prepare()",
         ["--torch_compile", "regional"], ["--torch_compile regional", "does not compile its model",
                                           "Drop --torch_compile"], recipe="model_parallel"),
    Case("text-preset-for-images", "a decoder preset (Llama / Mixtral style) for an image task",
         ["--task", "image-classification", "--model_preset", "tiny-moe"],
         ["--model_preset tiny-moe is a decoder for text", "Pass --task causal-lm or text-classification"]),
    Case("compile-other-backend", "a launch config's dynamo backend other than inductor", [],
         ["dynamo_backend 'aot_eager'", "Set dynamo_backend: INDUCTOR"],
         env={"ACCELERATE_DYNAMO_BACKEND": "AOT_EAGER", "ACCELERATE_DYNAMO_MODE": "default"}),  # as launch sets them
    # ---- launches that would quietly do less: `accelerate launch` asked for 2 processes, started 1 (its one-process
    # launcher sets MASTER_ADDR and no WORLD_SIZE); the launches themselves: test_a_launch_of_two_that_starts_one_*
    Case("lone-launch-num-processes", "`accelerate launch --num_processes 2` with no config on a CPU-only machine "
         "(one process ran, exit 0)", [],
         ["was asked for several processes and started this one alone", "Add --multi_gpu to `accelerate launch`",
          "accelerate_configs/multi_cpu.yaml"],
         env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_USE_CPU": "False"}),
    Case("lone-launch-cpu", "`accelerate launch --cpu --num_processes 2`, or a `distributed_type: MULTI_CPU` config",
         [], ["started this one alone", "for --cpu, and for `distributed_type: MULTI_CPU`", "(not --cpu"],
         env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "ACCELERATE_USE_CPU": "True"}),
    # ---- flags: misread, given twice, out of range, or for a machine this is not
    Case("lr-prefix", "`--lr 3e-4` (argparse took prefixes: it was read as --lr_scheduler_type)", ["--lr", "3e-4"],
         ["unrecognized arguments: --lr 3e-4", "--lr: did you mean --learning_rate?"],
         fix=["--learning_rate", "3e-4"]),
    Case("other-codebase-spellings", "Trainer's and timm's spellings: --epochs, --batch_size, --wd",
         ["--epochs", "3", "--batch_size", "8", "--wd", "0.1"],
         ["--epochs: did you mean --num_train_epochs?", "--batch_size: did you mean --per_device_train_batch_size?",
          "--wd: did you mean --weight_decay?"],
         fix=["--num_train_epochs", "3", "--per_device_train_batch_size", "8", "--weight_decay", "0.1"]),
    Case("hyphenated-flag", "a flag spelled with hyphens (--learning-rate)", ["--learning-rate", "1e-3"],
         ["--learning-rate: did you mean --learning_rate?"], fix=["--learning_rate", "1e-3"]),
    Case("flag-twice", "a flag given twice (argparse kept the last silently)",
         ["--learning_rate", "1e-4", "--seed", "1", "--learning_rate", "3e-4"],
         ["--learning_rate is given twice, as 1e-4 and 3e-4", "Pass it once"],
         fix=["--learning_rate", "3e-4", "--seed", "1"]),
    Case("flash-attention-on-cpu", "a CUDA-only attention kernel on a machine without CUDA",
         ["--attn_implementation", "flash_attention_2"],
         ["--attn_implementation flash_attention_2 runs on CUDA GPUs only", "Pass --attn_implementation sdpa"],
         fix=["--attn_implementation", "sdpa"]),
    Case("seed-out-of-range", "a seed beyond numpy's 32-bit range", ["--seed", "4294967296"],
         ["--seed: must be at most 4,294,967,295 (numpy's seed range)"], fix=["--seed", "4294967295"]),
    Case("ddp-timeout-too-short", "--ddp_timeout 1: seconds, less than the processes' start-up skew (5-30 s here)",
         ["--ddp_timeout", "1"], ["--ddp_timeout: must be at least 60 seconds"], fix=["--ddp_timeout", "60"]),
    Case("negative-max-steps", "a negative --max_train_steps", ["--max_train_steps", "-5"],
         ["--max_train_steps: must be at least 1, got -5"]),
    Case("letter-for-a-digit", "a learning rate typed with the letter l for the digit 1", ["--learning_rate", "le-4"],
         ["--learning_rate: expected a number, got 'le-4'"], fix=["--learning_rate", "1e-4"]),
    Case("number-with-a-unit", "a batch size with a unit", ["--per_device_train_batch_size", "8k"],
         ["--per_device_train_batch_size: expected an integer, got '8k'"]),
    # ---- a model directory that does not load
    Case("truncated-weights", "model.safetensors cut in half (an interrupted copy)", [],
         ["model.safetensors is truncated or corrupt", "Copy or download it again"],
         setup=lambda t: ["--model_name_or_path", _cut_weights(t)]),
    Case("classifier-of-other-labels", "a fine-tuned 3-label classifier given 2-class data", [],
         ["is a classifier of 3 labels, and the data has 2", "Pass --ignore_mismatched_sizes"],
         setup=lambda t: ["--model_name_or_path", _classifier_dir(t), "--train_file", _table(t)],
         fix=["--ignore_mismatched_sizes"]),
    # ---- a cache that cannot be written: datasets caches even a local csv there
    # ---- communication reduction (recipes/data_parallel.py): flags that would do nothing, silently
    Case("comm-hook-one-process", "a DDP communication hook on one process (nothing is all-reduced)",
         ["--comm_hook", "bf16"], ["--comm_hook bf16 with one process", "Launch 2 or more processes"],
         recipe="data_parallel"),
    Case("bf16-hook-on-cpu", "the bf16 hook on a CPU-only machine (torch's DDP wants CUDA + NCCL)",
         ["--comm_hook", "bf16"], ["refuses bf16_compress_hook", "Use --comm_hook fp16"], recipe="data_parallel"),
    Case("local-sgd-one-process", "LocalSGD on one process (Accelerate turns it off)", ["--local_sgd_steps", "4"],
         ["--local_sgd_steps with one process", "LocalSGD turns itself off"], recipe="data_parallel"),
    Case("comm-hook-with-local-sgd", "a communication hook and LocalSGD at once (the hook would never run)",
         ["--comm_hook", "fp16", "--local_sgd_steps", "4"], ["the hook never runs", "Pick one"],
         recipe="data_parallel"),
    Case("powersgd-flags-without-it", "PowerSGD's rank without --comm_hook power_sgd", ["--powersgd_rank", "2"],
         ["--powersgd_rank tune PowerSGD", "Add --comm_hook power_sgd"], recipe="data_parallel"),
    Case("powersgd-never-compresses", "PowerSGD starting after the run's last step",
         ["--comm_hook", "power_sgd", "--max_train_steps", "5"],
         ["this run would never compress", "Pass --powersgd_start_iter below 5"], recipe="data_parallel"),
    Case("powersgd-start-1", "PowerSGD from step 1 (torch needs 2 with error feedback)",
         ["--comm_hook", "power_sgd", "--powersgd_start_iter", "1"], ["--powersgd_start_iter: must be at least 2"],
         recipe="data_parallel"),
    Case("local-sgd-checkpoints", "LocalSGD with checkpoints (each process's AdamW moments differ)",
         ["--local_sgd_steps", "4", "--checkpointing_steps", "2"],
         ["a checkpoint keeps process 0's", "Drop --checkpointing_steps"], recipe="data_parallel"),
    Case("unwritable-hf-home", "HF_HOME not a writable directory", [],
         ["The Hugging Face cache /dev/null/hf cannot be written", "Set HF_HOME to a writable directory"],
         setup=lambda t: ["--train_file", _table(t)], env={"HF_HOME": "/dev/null/hf"}, fix=[],
         fix_env={"HF_HOME": "/tmp/hf_home"}),
    Case("unwritable-home", "HOME not writable, HF_HOME unset (the cache defaults to ~/.cache/huggingface)", [],
         ["The Hugging Face cache /dev/null/.cache/huggingface cannot be written", "Set HF_HOME"],
         setup=lambda t: ["--train_file", _table(t)], env={"HOME": "/dev/null", "HF_HOME": "", "XDG_CACHE_HOME": ""},
         fix=[], fix_env={"HF_HOME": "/tmp/hf_home"}),
    # ---- elastic restarts that could not connect: what torch elastic sets under --max_restarts and a shared store
    Case("elastic-restarts-shared-store", "--max_restarts with torch's shared rendezvous store (static, or c10d "
         "without TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): a restart would never connect", [],
         ["would read their dead peers' addresses", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv_backend c10d"],
         env={"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}, fix=[],
         fix_env={"TORCHELASTIC_USE_AGENT_STORE": "False"}),
    # ---- issue 37's trial: each finding a row (the classes: tests/test_boundary.py, tests/test_fuzz_inputs.py)
    Case("zero-byte-jsonl", "an empty (0-byte) .jsonl training file (datasets' StopIteration)", [],
         ["--train_file", "is empty (0 bytes)", "Pass the file with its rows"],
         setup=lambda t: ["--train_file", _write(t / "train.jsonl", "")]),
    Case("zero-byte-validation", "an empty (0-byte) validation file", [],
         ["--validation_file", "is empty (0 bytes)"],
         setup=lambda t: ["--train_file", _table(t), "--validation_file", _write(t / "val.csv", "")]),
    Case("zero-byte-txt", "an empty (0-byte) .txt for a causal LM (called 'not UTF-8' before)", ["--task", "causal-lm"],
         ["--train_file", "is empty (0 bytes)"], setup=lambda t: ["--train_file", _write(t / "train.txt", "")]),
    Case("adapter-as-model", "a PEFT adapter folder as --model_name_or_path (transformers' 'Unrecognized model')", [],
         ["a PEFT adapter", "not a whole model", "Pass its base model as --model_name_or_path ('my-org/base')",
          "merge_and_unload"], setup=lambda t: ["--model_name_or_path", _adapter_dir(t)]),
    Case("checkpoint-as-model", "a checkpoints/step_N folder as --model_name_or_path", [],
         ["a training checkpoint", "not a saved model", "--resume_from_checkpoint"],
         setup=lambda t: ["--model_name_or_path", _finished_checkpoint(t)]),
    Case("model-as-checkpoint", "--resume_from_checkpoint naming a finished model folder (called 'the save did not "
         "finish' before)", [], ["is a saved model", "not a checkpoint", "--model_name_or_path"],
         setup=lambda t: ["--resume_from_checkpoint", _classifier_dir(t, labels=2)]),
    Case("lora-target-typo", "--lora_target_modules naming a layer the model lacks (PEFT's NoMatchingPeftModuleError,"
         " even under --preflight)", ["--lora_target_modules", "query,value,nonexistent_proj", "--preflight"],
         ["nonexistent_proj match(es) no layer", "all-linear"], recipe="qlora"),
    Case("leftover-world-size", "a WORLD_SIZE left in the shell (Accelerate's 'MASTER_ADDR env was not set')", [],
         ["WORLD_SIZE=2 is set in the environment", "no launcher started this run", "unset WORLD_SIZE"],
         env={"WORLD_SIZE": "2"}),
    Case("leftover-rendezvous", "WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT left in the shell (waited out "
         "--ddp_timeout, then DistStoreError)", [],
         ["WORLD_SIZE=2, RANK=1, MASTER_ADDR=127.0.0.1, MASTER_PORT=29511 are set", "would wait for peers",
          "unset WORLD_SIZE RANK MASTER_ADDR MASTER_PORT"],
         env={"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}),
    Case("leftover-mixed-precision", "ACCELERATE_MIXED_PRECISION=fp16 left in the shell of a plain run (it computed "
         "in fp16 unasked)", [], ["ACCELERATE_MIXED_PRECISION=fp16 is set in the environment",
                                  "Pass --mixed_precision fp16", "unset ACCELERATE_MIXED_PRECISION"],
         env={"ACCELERATE_MIXED_PRECISION": "fp16"}),
    Case("leftover-dynamo-backend", "ACCELERATE_DYNAMO_BACKEND left in the shell (a plain run compiled, unasked)", [],
         ["ACCELERATE_DYNAMO_BACKEND=inductor is set in the environment", "Pass --torch_compile full",
          "unset ACCELERATE_DYNAMO_BACKEND"], env={"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"},
         fix=["--torch_compile", "full"], fix_env={"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}),
    Case("leftover-accumulation", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS left in the shell (Accelerate divided "
         "every loss by it in a loop that steps every batch)", [],
         ["ACCELERATE_GRADIENT_ACCUMULATION_STEPS=4 is set in the environment", "divide every loss by 4",
          "unset ACCELERATE_GRADIENT_ACCUMULATION_STEPS"], env={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
         fix=["--gradient_accumulation_steps", "4"], fix_recipe="gradient_accumulation",
         fix_env={"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}),
    Case("empty-class-folder", "a class folder with no images (the head got a class it never sees)",
         ["--task", "image-classification"], ["class folder(s) ['c'] hold no images", "remove the empty folders"],
         setup=lambda t: ["--train_dir", _folder(t, classes=("a", "b")) and _folder(t, classes=("c",), images=False)]),
    Case("leftover-use-fsdp", "ACCELERATE_USE_FSDP left in the shell (blamed on 'the launch config' before)", [],
         ["ACCELERATE_USE_FSDP=true is set in the environment", "unset ACCELERATE_USE_FSDP"],
         env={"ACCELERATE_USE_FSDP": "true"}),
    Case("leftover-use-deepspeed", "ACCELERATE_USE_DEEPSPEED left in the shell", [],
         ["ACCELERATE_USE_DEEPSPEED=1 is set in the environment", "unset ACCELERATE_USE_DEEPSPEED"],
         env={"ACCELERATE_USE_DEEPSPEED": "1"}),
    Case("hint-save-steps", "Trainer's --save_steps (hinted --max_train_steps, which changes the run's length)",
         ["--save_steps", "50"], ["--save_steps: did you mean --checkpointing_steps?"]),
    Case("hint-gradient-checkpointing", "Trainer's --gradient_checkpointing (hinted --async_checkpoint)",
         ["--gradient_checkpointing"], ["recipes/activation_checkpointing.py"]),
    Case("hint-evaluation-strategy", "Trainer's --evaluation_strategy (hinted --validation_dir)",
         ["--evaluation_strategy", "steps"], ["evaluate once, after training"]),
    Case("hint-use-peft", "TRL's --use_peft (hinted --seed)", ["--use_peft"], ["recipes/qlora.py"]),
    Case("hint-dataset-text-field", "TRL's --dataset_text_field (hinted --dataset_name)",
         ["--dataset_text_field", "body"], ["did you mean --text_column?"]),
    Case("hint-train-on-inputs", "axolotl's --train_on_inputs (hinted --train_dir)", ["--train_on_inputs", "true"],
         ["--train_on_prompt"]),
    Case("hint-chat-template", "TRL's --chat_template on a task without chat (hinted --torch_compile)",
         ["--chat_template", "chatml"], ["--chat_template serves --task sft", "Pass --task sft"]),
    Case("hint-bf16", "Trainer's --bf16 (no hint)", ["--bf16"], ["did you mean --mixed_precision bf16?"]),
    Case("hint-block-size", "run_clm's --block_size (no hint)", ["--block_size", "64"],
         ["did you mean --max_seq_length?"]),
    Case("label-case-spellings", "labels 'pos' and 'Pos' (two classes where one was meant)", [],
         ["spells one class several ways", "'Pos' / 'pos'", "Write each label one way"],
         setup=lambda t: ["--train_file", _table(t, [(a, ("pos", "Pos", "neg")[i % 3]) for i, (a, _) in
                                                      enumerate(_ROWS)])]),
    Case("column-in-two-roles", "the label column also named as the text column", ["--text_column", "label"],
         ["is used as both the text and the label"], setup=lambda t: ["--train_file", _table(t)]),
    Case("nested-image-folders", "images one folder deeper than the classes (silently skipped before)",
         ["--task", "image-classification"], ["class folders hold subfolders", "Move their images up"],
         setup=lambda t: ["--train_dir", _nested_folder(t)]),
    Case("unread-image-files", "files of a type no loader reads among the images (silently skipped before)",
         ["--task", "image-classification"], ["file(s) of a type no loader reads would be skipped", "notes.txt"],
         setup=lambda t: ["--train_dir", _folder_with(t, "notes.txt")]),
    Case("tokenizer-of-another-model", "a tokenizer larger than the model's embeddings",
         [], ["tokens, and the model", "embeds", "Pass the model's own tokenizer"],
         setup=lambda t: ["--model_name_or_path", _classifier_dir(t, labels=2), "--tokenizer_name", _big_tokenizer(t)]),
    Case("file-as-model-dir", "config.json itself passed as the model", [],
         ["it is a file, and a folder is expected", "Pass the folder that holds it"],
         setup=lambda t: ["--model_name_or_path", _classifier_dir(t, labels=2) / "config.json"]),
    Case("folder-as-data-file", "a folder passed as --train_file", [],
         ["it is a folder, and a file is expected", "train.csv"],
         setup=lambda t: ["--train_file", _table((t / "data").mkdir() or t / "data").parent]),
    Case("model-dir-typo", "a near-miss spelling of a model folder", [],
         ["does not exist", "Did you mean"],
         setup=lambda t: ["--model_name_or_path", str(_classifier_dir(t, 2)).replace("classifier", "clasifier")]),
    # ---- found by tests/test_fuzz_inputs.py while the boundary was built (its regression rows)
    Case("headerless-csv", "a csv without a header row (its first row became the column names)", [],
         ["these read like a row of data", "add one naming the columns"],
         setup=lambda t: ["--train_file", _write(t / "nohead.csv", "".join(f"{a},{b}\n" for a, b in _ROWS))]),
    Case("empty-parquet", "a parquet file of no rows (pyarrow's 'BatchSize must be greater than 0')", [],
         ["is empty"], setup=lambda t: ["--train_file", _parquet(t, rows=0)]),
    Case("utf16-csv", "a UTF-16 csv (Excel's 'Unicode text')", [], ["it is UTF-16", "save the file as UTF-8"],
         setup=lambda t: ["--train_file", _encoded(t, "utf-16")]),
    Case("gz-not-utf8", "a .jsonl.gz whose text is latin-1 (the compressed bytes were blamed before)", [],
         ["line 1 is not UTF-8", "train.jsonl.gz"], setup=lambda t: ["--train_file", _gz_latin1(t)]),
    Case("edited-model-type", "config.json's model_type edited (BERT weights under a GPT-2 config trained from "
         "random values)", ["--max_seq_length", "32"], ["weights are not in its checkpoint", "random values"],
         setup=lambda t: ["--model_name_or_path", _retyped(t), "--train_file", _table(t)]),
    # --task sft (shared/tasks/chat.py): one check over every row, the layout chosen, the flags of the task
    Case("sft-two-layouts", "chat data with both a messages and a text column, and no choice made",
         ["--task", "sft", "--model_preset", "tiny-llama"], ["which one to train is a choice", "--messages_column"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": _CHAT, "text": "x"}] * 20)],
         fix=["--task", "sft", "--model_preset", "tiny-llama", "--messages_column", "messages",
              "--per_device_train_batch_size", "2"]),
    Case("sft-ends-on-user", "a conversation that ends on a user turn (no answer to learn)",
         ["--task", "sft", "--model_preset", "tiny-llama"], ["row 3 ends on a user or system turn",
                                                             "end every conversation on an assistant turn"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": _CHAT}] * 2 + [{"messages": [*_CHAT, _CHAT[0]]}]
                                                   + [{"messages": _CHAT}] * 20)]),
    Case("launcher-option-to-recipe", "accelerate launch's --config_file given to the recipe (the hint was "
         "'did you mean --train_file?')", ["--config_file", "accelerate_configs/zero3.yaml"],
         ["an option of `accelerate launch`, which goes before the recipe", "accelerate launch --config_file"]),
    Case("column-name-case", "csv columns 'Text' and 'Label' (the guesses are lower case)", [],
         ["'Text' differs from 'text' only in case", "Pass --text_column Text"],
         setup=lambda t: ["--train_file", _table(t, header="Text,Label")],
         fix=["--text_column", "Text", "--label_column", "Label"]),
    Case("column-near-miss", "--label_column misspelled", ["--text_column", "text", "--label_column", "lable"],
         ["--label_column 'lable' is not a column", "Did you mean --label_column label?"],
         setup=lambda t: ["--train_file", _table(t)]),
    Case("sft-flag-without-sft", "a chat template for a task that is not sft", ["--chat_template", "t.jinja"],
         ["serves --task sft", "Pass --task sft, or drop them"]),
    Case("sft-template-syntax", "a chat template file that is not valid Jinja (a raw TemplateSyntaxError traceback "
         "from the first row before)", ["--task", "sft", "--model_preset", "tiny-llama"],
         ["cannot render a user and an assistant turn (line 1)", "TemplateSyntaxError", "Fix the template"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": _CHAT}] * 20), "--chat_template",
                          _write(t / "bad.jinja", "{% for m in messages %}{{ m.content }")]),
    Case("sft-template-not-applied", "a chat template with prompt/completion strings (set on the tokenizer, never "
         "used, and reported as the run's template)", ["--task", "sft", "--model_preset", "tiny-llama"],
         ["--chat_template renders conversations", "Drop --chat_template"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"prompt": "2+2?", "completion": "4"}] * 20), "--chat_template",
                          _write(t / "t.jinja", "{% for m in messages %}{{ m.content }}{% endfor %}")]),
    Case("sft-sharegpt-column", "ShareGPT data: a 'conversations' column of from/value turns (the help said the "
         "column was guessed; it was not)", ["--task", "sft", "--model_preset", "tiny-llama"],
         ["column 'conversations'", "uses ShareGPT's from/value keys", "human -> user, gpt -> assistant"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"conversations": [{"from": "human", "value": "hi"},
                                                                         {"from": "gpt", "value": "hello"}]}] * 20)]),
    # Fresh cases of the same classes (their checkpoint, their data, their config), each caught at its check.
    Case("quantized-checkpoint", "a checkpoint stored quantized (config.json's quantization_config: bitsandbytes, "
         "GPTQ, fp8, gpt-oss's mxfp4): a raw bitsandbytes assertion, or optimum's ImportError", [],
         ["stores its weights quantized (quantization_config, quant_method bitsandbytes)",
          "Pass the checkpoint it was quantized from"],
         setup=lambda t: ["--model_name_or_path", _edited_config(_classifier_dir(t, labels=2), quantization_config={
             "quant_method": "bitsandbytes", "load_in_4bit": True}), "--train_file", _table(t)]),
    Case("fp16-checkpoint-auto", "--weights_dtype auto over an fp16 checkpoint (pure fp16 weights, no loss scaling: "
         "the loss turned nan at step 1)", ["--weights_dtype", "auto"],
         ["stores its weights in float16", "no loss scaling", "Pass --weights_dtype fp32"],
         setup=lambda t: ["--model_name_or_path", _edited_config(_classifier_dir(t, labels=2), dtype="float16"),
                          "--train_file", _table(t)]),
    Case("json-records-under-a-key", "a .json file wrapping its records in an object ({'version': 1, 'data': [...]}, "
         "SQuAD's layout): 'no text column among version, data'", [],
         ["records are a list under 'data'", "on its own line (jsonl)"],
         setup=lambda t: ["--train_file", _write(t / "train.json", __import__("json").dumps(
             {"version": "1", "data": [{"text": x, "label": y} for x, y in _ROWS]}))]),
    Case("sft-dolly-columns", "Dolly's instruction/context/response columns (only Alpaca's were hinted)",
         ["--task", "sft", "--model_preset", "tiny-llama"],
         ["Found no sft columns", "--prompt_column instruction,context --completion_column response"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"instruction": "reverse : a b", "context": "", "response": "b a",
                                                      "category": "qa"}] * 20)],
         fix=["--task", "sft", "--model_preset", "tiny-llama", "--prompt_column", "instruction,context",
              "--completion_column", "response", "--per_device_train_batch_size", "2"]),
    Case("sft-preference-pairs", "DPO data (prompt/chosen/rejected) given to sft", ["--task", "sft", "--model_preset",
                                                                                    "tiny-llama"],
         ["these are preference pairs", "--prompt_column prompt --completion_column chosen"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"prompt": "reverse : a b", "chosen": "b a", "rejected": "a b"}]
                                                 * 20)],
         fix=["--task", "sft", "--model_preset", "tiny-llama", "--prompt_column", "prompt", "--completion_column",
              "chosen", "--per_device_train_batch_size", "2"]),
    Case("fp8-config-plain-recipe", "mixed_precision: fp8 in the launch config of a recipe that is not fp8.py (GPT-2 "
         "trained in bf16 under an fp8 label)", [], ["mixed precision 'fp8' (from the launch config)",
                                                     "Use recipes/fp8.py"],
         env={"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_DYNAMO_MODE": "default"},
         fix=[], fix_recipe="fp8", fix_env={"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_DYNAMO_MODE": "default"}),
    Case("megatron-config", "distributed_type: MEGATRON_LM in the launch config (Accelerator() raised ImportError)",
         [], ["distributed_type is MEGATRON_LM", "recipes/tensor_parallel.py"],
         env={"ACCELERATE_USE_MEGATRON_LM": "true", "ACCELERATE_DYNAMO_MODE": "default"}),
    Case("config-field-dropped", "config.json without hidden_size (the class default, 768, against 32-wide weights)",
         ["--max_seq_length", "32"], ["its weights' shapes differ from the ones config.json describes",
                                      "Use the config.json saved with these weights"],
         setup=lambda t: ["--model_name_or_path", _edited_config(_classifier_dir(t, labels=2), hidden_size=None),
                          "--train_file", _table(t)]),
    # betas and eps "auto" are filled (the recipe's AdamW): the first "auto" nothing fills is the scheduler's
    Case("deepspeed-json-auto-unfilled", "a DeepSpeed JSON with \"auto\" where nothing fills it (betas, eps, a "
         "cosine schedule's ratios: a raw ValueError from prepare())", [],
         ['scheduler.params.warmup_min_ratio is "auto"', "Set it to a value in the JSON"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, optimizer={"type": "AdamW", "params": {
             "lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}, scheduler={
             "type": "WarmupCosineLR", "params": {"warmup_min_ratio": "auto", "warmup_num_steps": "auto",
                                                  "total_num_steps": "auto"}})]),
    Case("checkpoint-folder-one-level-up", "--resume_from_checkpoint given a run's output directory (its checkpoints "
         "inside): 'not a complete checkpoint: the save did not finish'", [],
         ["is a folder of 1 checkpoint(s), not one checkpoint", "--resume_from_checkpoint latest --output_dir"],
         setup=lambda t: ["--resume_from_checkpoint", _steps_dir(t / "run")]),
    Case("deepspeed-json-auto-outside-blocks", "\"auto\" in zero_optimization where Accelerate fills nothing "
         "(sub_group_size: a raw ValueError from prepare())", [],
         ['zero_optimization.sub_group_size is "auto"', "Set it to a value in the JSON"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, zero_optimization={"stage": 2, "sub_group_size": "auto"})]),
    Case("fp8-config-under-deepspeed", "mixed_precision: fp8 in a DeepSpeed launch config (the fp16/bf16 blocks hold "
         "no fp8: it trained in fp32, unsaid)", [], ["mixed precision 'fp8'", "under DeepSpeed",
                                                     "use recipes/fp8.py"], recipe="zero",
         env={"ACCELERATE_MIXED_PRECISION": "fp8", "ACCELERATE_DYNAMO_MODE": "default"}),
    # A chat template's own raise_exception (Mistral's alternation, Gemma's 'System role not supported'), met on a
    # row the plain exchange check cannot see: a raw jinja2 TemplateError from the encoding before.
    Case("sft-template-refuses-row", "a chat template that raises on a row (two user turns in a row under a template "
         "that needs them to alternate): a raw jinja2 TemplateError traceback", ["--task", "sft", "--model_preset",
                                                                                 "tiny-llama"],
         ["The chat template refuses the training data's row 11", "Conversation roles must alternate",
          "merge consecutive turns of one role"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": _CHAT}] * 10 + [{"messages": [_CHAT[0], *_CHAT]}]
                                                 + [{"messages": _CHAT}] * 10),
                          "--chat_template", _write(t / "alt.jinja", _RAISING_TEMPLATE)]),
    Case("sft-template-no-system", "system turns under a template without a system role (Gemma's): a raw jinja2 "
         "TemplateError traceback", ["--task", "sft", "--model_preset", "tiny-llama"],
         ["refuses the training data's row 1, 2, 3, 4, 7 and 13 more", "System role not supported",
          "fold a system turn into the first user turn"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": [{"role": "system", "content": "be brief"}, *_CHAT]}]
                                                 * 20),
                          "--chat_template", _write(t / "nosys.jinja", _NO_SYSTEM_TEMPLATE)]),
    Case("lm-head-missing", "a causal LM checkpoint without lm_head.weight and tie_word_embeddings false (a random "
         "head trained, unsaid)", ["--task", "causal-lm", "--max_seq_length", "32"],
         ["the language-model head 'lm_head.weight' is not in its checkpoint", "tie_word_embeddings: False",
          "set \"tie_word_embeddings\": true in config.json"],
         setup=lambda t: ["--model_name_or_path", _headless_decoder(t)]),
    Case("lm-head-missing-sft", "the same checkpoint for --task sft (a chat model's head trained from random)",
         ["--task", "sft", "--max_seq_length", "64"],
         ["the language-model head 'lm_head.weight' is not in its checkpoint", "tie_word_embeddings: False"],
         setup=lambda t: ["--model_name_or_path", _headless_decoder(t)]),
    Case("label-column-for-causal-lm", "--label_column for a causal LM (ignored: it trained on the text alone)",
         ["--task", "causal-lm", "--label_column", "label"],
         ["--label_column serves --task text-classification and image-classification, not --task causal-lm",
          "Drop it"], fix=["--task", "causal-lm"]),
    Case("text-column-for-images", "--text_column for image classification (ignored)",
         ["--task", "image-classification", "--text_column", "caption"],
         ["--text_column serves --task text-classification and causal-lm and sft, not --task image-classification",
          "Drop it"], fix=["--task", "image-classification"]),
    Case("image-column-for-text", "--image_column for text classification (ignored)", ["--image_column", "img"],
         ["--image_column serves --task image-classification, not --task text-classification", "Drop it"], fix=[]),
    Case("mixed-precision-flag-and-config", "--mixed_precision no with a launch config's mixed_precision: bf16 (the "
         "flag won, the config's bf16 dropped unsaid)", ["--mixed_precision", "no"],
         ["--mixed_precision no and the launch config's mixed_precision (bf16", "Set it in one place",
          "drop --mixed_precision to run with bf16"],
         env={"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_MODE": "default"}, fix=[],
         fix_env={"ACCELERATE_MIXED_PRECISION": "bf16", "ACCELERATE_DYNAMO_MODE": "default"}),
    Case("compile-flag-and-config", "--torch_compile full with a launch config's regional compilation (the flag won)",
         ["--torch_compile", "full"], ["--torch_compile full and the launch config's dynamo_config (regional",
                                       "Set it in one place"],
         env={"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "true",
              "ACCELERATE_DYNAMO_MODE": "default"}),
    Case("deepspeed-json-misspelled-block", "a DeepSpeed JSON's \"zero_optimisation\" (DeepSpeed ignores keys it does "
         "not read: it trained without ZeRO, unsaid)", [],
         ['"zero_optimisation" is not a key DeepSpeed reads (did you mean "zero_optimization"?)', "Fix the spelling"],
         recipe="zero", setup=lambda t: ["--deepspeed_config", _write(t / "ds.json", __import__("json").dumps({
             "train_micro_batch_size_per_gpu": "auto", "zero_optimisation": {"stage": 2}}))]),
    Case("deepspeed-json-unknown-zero-key", "a key zero_optimization does not have (overlap_com): a raw pydantic "
         "ValidationError from deepspeed.initialize in prepare()", [],
         ["zero_optimization.overlap_com: Extra inputs are not permitted (did you mean \"overlap_comm\"?)",
          "Fix or remove those keys"], recipe="zero",
         setup=lambda t: ["--deepspeed_config", _ds_json(t, zero_optimization={"stage": 2, "overlap_com": True})]),
    Case("sft-validation-all-dropped", "sft validation conversations whose prompts all fill --max_seq_length (each "
         "dropped: eval_loss 0.0 and perplexity 1.0 reported)",
         ["--task", "sft", "--model_preset", "tiny-llama", "--max_seq_length", "16", "--per_device_train_batch_size",
          "2"],
         ["The validation data (", "has no sample left to evaluate", "a loss of 0", "Raise --max_seq_length"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": _CHAT}] * 40), "--validation_file", _jsonl(
             t, [{"messages": [{"role": "user", "content": " ".join(["a"] * 40)}, _CHAT[1]]}] * 4, name="v.jsonl")]),
    Case("moe-top-k-beyond-experts", "a Mixtral config.json routing each token to 8 of its 4 experts (a raw "
         "torch.topk 'selected index k out of range' at the first step)", ["--task", "causal-lm"],
         ["config.json routes each token to num_experts_per_tok 8 experts of the model's 4",
          "Set num_experts_per_tok between 1 and 4"], setup=lambda t: ["--model_name_or_path", _moe_config_dir(t)]),
    Case("model-beside-adapter", "a whole model folder that also holds adapter_config.json (a merge saved over the "
         "adapter's folder): called 'LoRA weights only, not a whole model'", ["--max_seq_length", "32"],
         ["holds a whole model and a PEFT adapter", "Move adapter_config.json and adapter_model.* out of it"],
         setup=lambda t: ["--model_name_or_path", _with_adapter_config(_classifier_dir(t, labels=2)),
                          "--train_file", _table(t)]),
    Case("sft-developer-role", "OpenAI messages with the 'developer' role (the system prompt's newer name): 'a role "
         "other than system, user, assistant: map it to one of them'", ["--task", "sft", "--model_preset",
                                                                         "tiny-llama"],
         ["holds OpenAI's 'developer' role", "rename it to system"],
         setup=lambda t: ["--train_file", _jsonl(t, [{"messages": [{"role": "developer", "content": "be brief"},
                                                                   *_CHAT]}] * 20)]),
    Case("tokenizer-config-missing", "a model folder with tokenizer.json but no tokenizer_config.json (no eos, bos or "
         "pad: a causal LM trained on documents run together; sft said 'Pass --chat_template')",
         ["--task", "causal-lm", "--max_seq_length", "32"],
         ["the tokenizer loads without special tokens", "the folder has no tokenizer_config.json",
          "Copy tokenizer_config.json"], setup=lambda t: ["--model_name_or_path", _without_tokenizer_config(t)]),
    Case("config-fewer-layers", "config.json's num_hidden_layers lowered from 2 to 1 (layer 1's weights dropped on "
         "load: a 1-layer model trained, unsaid)", ["--task", "causal-lm", "--max_seq_length", "32"],
         ["weights of its checkpoint have no place in the model config.json describes", "model.layers.1.",
          "Use the config.json saved with these weights"],
         setup=lambda t: ["--model_name_or_path", _edited_config(__import__("tests.shipped_models").shipped_models
                                                                  .make_dir(t, "mistral"), num_hidden_layers=1)]),
    Case("image-paths-relative-to-table", "a csv of image paths written relative to the csv's own folder, run from "
         "elsewhere: every image called broken ('do not open or decode ... Remove or replace them')",
         ["--task", "image-classification", "--per_device_train_batch_size", "2"],
         ["image path(s) in", "are relative ('imgs/a/", "relative to the table's folder", "Run from that folder"],
         setup=lambda t: ["--train_file", _image_table(t)]),
    Case("config-field-refused", "config.json's rope_scaling {'rope_type': 'yarn'} without its factor (the fix said "
         "'Pass a directory saved with save_pretrained', which it is)", ["--task", "causal-lm"],
         ["its config class refuses one of its fields", "Missing required keys", "Fix the field the reason names"],
         setup=lambda t: ["--model_name_or_path", _edited_config(__import__("tests.shipped_models").shipped_models
                                                                  .make_dir(t, "mistral"),
                                                                  rope_scaling={"rope_type": "yarn"})]),
    Case("overwrite-and-resume", "--overwrite_output_dir with --resume_from_checkpoint latest (the resume won, the "
         "overwrite was dropped unsaid)", ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"],
         ["they ask for opposite things", "Drop --overwrite_output_dir to train that run on"]),
]


_RAISING_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                     "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
                     "{% endif %}{{ '<' + m['role'] + '>' + m['content'] + eos_token }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")
_NO_SYSTEM_TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not "
                       "supported') }}{% endif %}{{ '<' + m['role'] + '>' + m['content'] + eos_token }}{% endfor %}"
                       "{% if add_generation_prompt %}{{ '<assistant>' }}{% endif %}")


def _moe_config_dir(tmp: Path) -> Path:
    """A Mixtral directory (config.json and tokenizer; no weights are read before the refusal) with a hand-edited
    num_experts_per_tok."""
    from transformers import MixtralConfig

    from shared.core.data import build_word_tokenizer

    path = tmp / "moe"
    MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=8).save_pretrained(path)
    build_word_tokenizer(["a b c"], "causal-lm").save_pretrained(path)
    return path


def _with_adapter_config(path: Path) -> Path:
    import json

    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "my-org/base",
                                                           "r": 8, "target_modules": ["query"]}))
    return path


def _without_tokenizer_config(tmp: Path) -> Path:
    """A decoder folder copied without tokenizer_config.json and special_tokens_map.json (only tokenizer.json)."""
    from tests.shipped_models import make_dir

    path = make_dir(tmp, "mistral")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    return path


def _image_table(tmp: Path) -> Path:
    """images.csv beside imgs/<class>/, its paths relative to its own folder (as HF's metadata.csv writes them)."""
    _folder(tmp)
    rows = "".join(f"imgs/{c}/{i}.png,{c}\n" for c in "ab" for i in range(4)) * 3
    return _write(tmp / "images.csv", "image,label\n" + rows)


def _headless_decoder(tmp: Path) -> Path:
    """A Mistral-style causal LM (untied head) whose export left lm_head.weight out of model.safetensors."""
    from safetensors.torch import load_file, save_file

    from tests.shipped_models import make_dir

    path = make_dir(tmp, "mistral")
    weights = load_file(path / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


def _edited_config(path: Path, **keys: object) -> Path:
    """`path` with config.json's `keys` set (None: removed), as a quantizer, an fp16 export or a hand edit leaves it."""
    import json

    config = {**json.loads((path / "config.json").read_text()), **keys}
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return path

# The earlier rows whose fix is a flag or a recipe, followed (argv, recipe, env); the others' fix is in the data, a
# pip install, or a launch of several processes (test_following_a_launch_fix_clears_the_rule).
_FOLLOWED = {
    "batch-larger-than-data": (["--per_device_train_batch_size", "8", "--text_column", "review", "--label_column",
                                "sentiment"], "", {}),
    "accumulation-in-plain-recipe": (["--gradient_accumulation_steps", "4"], "gradient_accumulation", {}),
    "sequence-beyond-positions": (["--task", "causal-lm", "--max_seq_length", "128"], "", {}),
    "encoder-positions": (["--max_seq_length", "128"], "", {}),
    "deepspeed-fp16-on-cpu": (["--mixed_precision", "bf16"], "", {}),
    "paged-optimizer-without-cuda": ([], "", {}),
    "quantized-without-lora": (["--load_in", "4bit", "--lora"], "", {}),
    "old-optim-adamw_8bit": (["--optim", "adamw_torchao_8bit"], "", {}),
    "old-optim-adamw_8bit-combined": (["--optim", "adamw_bnb_8bit"], "", {}),
    "old-flag-bits": (["--load_in", "4bit"], "", {}),
    "dora-without-lora": (["--use_dora", "--lora"], "", {}),
    "chunked-loss-for-classification": (["--chunked_loss", "--task", "causal-lm"], "", {}),
    "compile-not-wired": ([], "", {}),
    "text-preset-for-images": (["--task", "causal-lm", "--model_preset", "tiny-moe"], "", {}),
    "compile-other-backend": ([], "", {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR", "ACCELERATE_DYNAMO_MODE": "default"}),
    "warmup-past-the-end": (["--num_warmup_steps", "1"], "", {}),
    "save-limit-without-checkpoints": (["--save_total_limit", "2", "--checkpointing_steps", "1"], "", {}),
    "tracker-typo": (["--report_to", "tensorboard"], "", {}),
    "resume-past-the-end": (["--max_train_steps", "4"], "", {}),
    "resume-another-global-batch": (["--per_device_train_batch_size", "4"], "", {}),
    "resume-layout-not-resharded": (["--per_device_train_batch_size", "4"], "", {}),
    # fixes that lead to the next refusal, a true one: the tiny data then holds too few blocks, or no label column
    "too-little-text": (["--task", "causal-lm", "--max_seq_length", "6", "--per_device_train_batch_size", "1"], "", {}),
    "missing-text-column": (["--text_column", "review", "--label_column", "sentiment"], "", {}),
}
for _case in CASES:
    if _case.id in _FOLLOWED:
        _case.fix, _case.fix_recipe, _case.fix_env = _FOLLOWED[_case.id]
assert set(_FOLLOWED) <= {c.id for c in CASES}


def _adapter_dir(tmp: Path) -> Path:
    """What PEFT's save_pretrained writes for a LoRA adapter: its config (naming the base) and the adapter weights."""
    import json

    path = tmp / "adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path":
                                                           "my-org/base", "r": 8, "target_modules": ["query"]}))
    (path / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return path


def _nested_folder(tmp: Path) -> Path:
    root = _folder(tmp)
    (root / "a" / "batch2").mkdir()
    for i in range(2):
        (root / "a" / "batch2" / f"{i}.png").write_bytes((root / "a" / "0.png").read_bytes())
    return root


def _folder_with(tmp: Path, name: str) -> Path:
    root = _folder(tmp)
    (root / "b" / name).write_text("labelled by hand")
    return root


def _big_tokenizer(tmp: Path) -> Path:
    from shared.core.data import build_word_tokenizer

    path = tmp / "big-tokenizer"
    build_word_tokenizer([f"w{i}" for i in range(60000)], "text-classification", vocab_size=40000).save_pretrained(path)
    return path


def _parquet(tmp: Path, rows: int) -> Path:
    import pandas as pd

    path = tmp / "train.parquet"
    pd.DataFrame({"text": [a for a, _ in _ROWS][:rows], "label": [b for _, b in _ROWS][:rows]}).to_parquet(path)
    return path


def _encoded(tmp: Path, encoding: str) -> Path:
    path = tmp / "train.csv"
    path.write_bytes(("text,label\n" + "".join(f"{a},{b}\n" for a, b in _ROWS)).encode(encoding))
    return path


def _gz_latin1(tmp: Path) -> Path:
    import gzip
    import json

    path = tmp / "train.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps({"text": "x", "label": b}, ensure_ascii=False)
                                           .replace('"x"', f'"caf\xe9 {a}"') + "\n"
                                           for a, b in _ROWS).encode("latin-1")))
    return path


def _retyped(tmp: Path) -> Path:
    import json

    path = _classifier_dir(tmp, labels=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    return path


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


def _steps_dir(run: Path) -> Path:
    """A run's output directory with one checkpoint folder in it."""
    (run / "checkpoints" / "step_00000002").mkdir(parents=True)
    return run


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
    capsys.readouterr()  # what a setup run printed is not this case's
    out = case.out(tmp_path) if case.out else tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        run_recipe(case.recipe, out, *argv, *_steps(argv), as_typed=True)  # a flag twice is a case here
    printed = capsys.readouterr()
    message = f"{exc.value.code}\n{printed.err}"
    for fragment in case.says:
        assert fragment in message, f"{case.id}: {fragment!r} not in {message[-1500:]!r}"
    # No training step ran: the progress bar (shared/core/meter.py) never started, and nothing was written.
    assert "train:" not in printed.err + printed.out, f"{case.id}: training started before the refusal"
    assert not (tmp_path / "out" / "results.json").exists()
    assert not list((tmp_path / "out").glob("checkpoints/step_*")), "it trained before failing"


def _grey_folder(tmp: Path, depth: dict) -> Path:
    """Class folders of grey gradients, saved 8-bit (mode L) or 16-bit (mode I;16, as microscopes and scanners do)
    per class: the same scene in both, 16-bit values 257 x the 8-bit ones."""
    import numpy as np
    from PIL import Image

    for c, bits in depth.items():
        (tmp / "grey" / c).mkdir(parents=True)
        for i in range(4):
            scene = (np.add.outer(np.arange(32), np.arange(32)) * (2 + i)) % 200 + 20  # 20..219: no pure white
            img = scene.astype(np.uint16) * 257 if bits == 16 else scene.astype(np.uint8)
            Image.fromarray(img).save(tmp / "grey" / c / f"{i}.png")
    return tmp / "grey"


def test_16_bit_images_are_scaled_not_clipped(tmp_path):
    """A 16-bit grey PNG converted to RGB by PIL clips every value above 255: ~all white. ImageDataset maps 65535 to
    255 instead, so the model sees the 16-bit image exactly as its 8-bit twin, whatever the mix in one folder."""
    from PIL import Image

    from shared.tasks.images import ImageDataset, image_folder

    folder = image_folder(str(_grey_folder(tmp_path, {"a": 16, "b": 8})))
    assert Image.open(folder["image"][0]).mode == "I;16"
    import numpy as np

    assert np.asarray(Image.open(folder["image"][0]).convert("RGB")).mean() > 250  # what PIL alone would feed
    ds = ImageDataset(folder["image"], folder["label"], 32, [0.5] * 3, [0.5] * 3)
    sixteen, eight = ds[0]["pixel_values"], ds[4]["pixel_values"]  # image 0 of class a (16-bit), of class b (8-bit)
    assert (sixteen >= 0.999).float().mean() < 0.01, "saturated"  # (x - 0.5) / 0.5: 1.0 is white
    assert sixteen.std() > 0.2
    assert (sixteen - eight).abs().max() < 1e-6  # the same scene, the same pixels
    from shared.tasks import images

    images.check_images(folder["image"], "training")  # and the 16-bit files pass the check that decodes them


def test_the_image_size_limit_is_pils_and_raising_it_works(tmp_path, monkeypatch):
    """The refusal of a huge image keeps PIL's guard; the fix it names (raise Image.MAX_IMAGE_PIXELS) lets it
    through. A low limit stands in for the 195-megapixel file."""
    from PIL import Image

    from shared.tasks import images

    path = str(_image_file(tmp_path / "big.png", "whole"))  # 64 x 64 = 4096 pixels
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)  # PIL refuses above twice the limit
    with pytest.raises(RecipeError, match="big.png: Image size .4096 pixels. exceeds limit.*MAX_IMAGE_PIXELS"):
        images.check_images([path], "training")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)
    images.check_images([path], "training")


def test_the_data_fixes_work_when_followed(tmp_path):
    """Two refusals' fixes, done as they say: pandas' records/lines JSON, and the --max_seq_length they name."""
    import re

    import pandas as pd

    from tests.conftest import run_recipe

    path = _pandas_json(tmp_path)
    with pytest.raises(SystemExit, match=r"df\.to_json\(path, orient=\"records\", lines=True\)"):
        run_recipe("baseline", tmp_path / "a", "--train_file", path, "--max_train_steps", 2)
    pd.read_json(path).to_json(path, orient="records", lines=True)  # the fix, word for word
    r = run_recipe("baseline", tmp_path / "b", "--train_file", path, "--max_train_steps", 2,
                   "--per_device_train_batch_size", 8, "--no_save_model")
    assert r["train_examples"] == 36  # 40 rows, 10% held out
    small = ["--train_file", _table(tmp_path), "--max_train_steps", 2, "--per_device_train_batch_size", 8]
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "c", *small, "--max_seq_length", 2)
    least = re.search(r"Pass --max_seq_length (\d+) or more", str(exc.value.code)).group(1)
    run_recipe("baseline", tmp_path / "d", *small, "--max_seq_length", least, "--no_save_model")


def _steps(argv: list) -> list:
    return [] if "--max_train_steps" in map(str, argv) else ["--max_train_steps", 2]  # (twice would be refused)


FIXED = [c for c in CASES if c.fix is not None]


def _forget_deepspeed() -> None:
    """A ZeRO run in this process leaves Transformers' global DeepSpeed config behind: the next in-process run would
    build its model under zero.Init."""
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()


@pytest.mark.parametrize("case", FIXED, ids=[c.id for c in FIXED])
def test_following_the_fix_passes_the_checks(case, tmp_path, capsys, monkeypatch):
    """Doing what the refusal says gets the run through every start-up check: data and model loaded and prepared,
    and --preflight stops it (exit 0) before the first step."""
    from tests.conftest import run_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in {**case.env, **case.fix_env}.items():
        monkeypatch.setenv(key, value)
    argv = [*case.fix, *(case.setup(tmp_path) if case.setup else [])]
    capsys.readouterr()  # what a setup run printed is not this case's
    try:
        with pytest.raises(SystemExit) as exc:
            run_recipe(case.fix_recipe or case.recipe, tmp_path / "out", *argv, *_steps(argv), "--preflight")
    finally:
        _forget_deepspeed()
    assert exc.value.code in (0, None), f"{case.id}: the fix does not pass: {str(exc.value.code)[-1500:]}"
    assert (tmp_path / "out" / "preflight.json").exists()
    assert "train:" not in capsys.readouterr().err


def test_following_a_launch_fix_clears_the_rule():
    """Rows whose fix is another launch (more processes, another launch config): the rule table refuses the run as
    launched and takes it as the fix says."""
    from dataclasses import replace

    from shared.core.rules import refusals
    from shared.tools.catalogue import recipe_run

    cases = [  # (the run refused, its words, the run as fixed)
        (recipe_run(recipe="baseline", sharding="none", launched="none", on_accelerator=False, lone_launch=True),
         "started this one alone", dict(lone_launch=False, sharding="ddp", launched="ddp", num_processes=2)),
        (recipe_run(recipe="data_parallel", sharding="none", launched="none", comm_hook="bf16"), "with one process",
         dict(sharding="ddp", launched="ddp", num_processes=2)),
        (recipe_run(recipe="fsdp", sharding="fsdp", launched="none"), "needs at least 2 processes",
         dict(launched="fsdp", num_processes=2)),
        (recipe_run(recipe="fsdp", sharding="fsdp", launched="none", dp_replicate_size=2), "with one process",
         dict(launched="fsdp", num_processes=4)),  # accelerate_configs/hsdp.yaml
        (recipe_run(recipe="pipeline_parallel", sharding="ddp", launched="ddp", num_processes=2, microbatches=4,
                    batch_size=6), "not divisible by --n_microbatches", dict(batch_size=8)),
        (recipe_run(recipe="pipeline_parallel", sharding="ddp", launched="ddp", num_processes=2, packing="per_document",
                    task="causal-lm"), "attend to each other", dict(packing="concat")),
    ]
    for run, words, fixed in cases:
        assert any(words in r for r in refusals(run)), (words, refusals(run))
        assert refusals(replace(run, **fixed)) == [], (words, refusals(replace(run, **fixed)))


def test_a_classifier_of_other_labels_trains_with_the_fix(tmp_path, monkeypatch):
    """--ignore_mismatched_sizes, as the refusal says: the 3-label head is replaced by a 2-label one, the rest loads,
    and the run trains and saves a 2-label classifier."""
    from tests.conftest import load_params, run_recipe

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_recipe("baseline", tmp_path / "out", "--model_name_or_path", _classifier_dir(tmp_path), "--train_file",
                   _table(tmp_path), "--ignore_mismatched_sizes", "--max_train_steps", 3)
    assert r["train_loss"] > 0
    assert load_params(tmp_path / "out")["classifier.weight"].shape == (2, 32)  # the new head, trained and saved


_USER_MULTI_CPU = """\
# as `accelerate config` writes it on a CPU-only machine (multi-CPU, 2 processes)
compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""
_SMALL = ("--max_train_steps", 2, "--max_train_samples", 64, "--max_eval_samples", 16, "--max_seq_length", 32,
          "--no_save_model")


@pytest.mark.slow
@pytest.mark.parametrize("launch_args, own_config, fixed", [
    (("--num_processes", "2"), False, ("--multi_gpu", "--num_processes", "2")),
    ((), True, ("--multi_gpu",)),
    (("--cpu", "--num_processes", "2"), False, None),  # its fix is the first row's
], ids=["num-processes-without-config", "own-multi-cpu-config", "cpu-flag"])
def test_a_launch_of_two_that_starts_one_is_refused_and_the_fix_runs_two(launch_args, own_config, fixed, tmp_path):
    """Without GPUs, Accelerate 1.15 starts one process for these launches of two, and that one trained to the end
    (exit 0). Now it is refused before the first step, and the launch the message gives runs two processes."""
    from tests.conftest import launch

    config = None
    if own_config:
        config = str(tmp_path / "my_config.yaml")
        Path(config).write_text(_USER_MULTI_CPU)
    env = {"HF_HOME": str(tmp_path / "hf")}  # no default accelerate config of this machine's user
    proc = launch("baseline", tmp_path / "out", *_SMALL, config=config, launch_args=launch_args, env=env,
                  expect_fail=True, timeout=300)
    printed = proc.stdout + proc.stderr
    assert "started this one alone" in printed and "Add --multi_gpu to `accelerate launch`" in printed, printed[-2000:]
    assert "train:" not in printed and not (tmp_path / "out" / "results.json").exists()
    if fixed:
        r = launch("baseline", tmp_path / "fixed", *_SMALL, config=config, launch_args=fixed, env=env, timeout=300)
        assert r["num_processes"] == 2 and r["distributed_type"] == "MULTI_CPU", r


def test_refusal_under_launch_is_shown_once_at_the_end(tmp_path):
    """Two processes refuse the same data: the launcher's failure summary shows the message once, as its last word,
    instead of each process printing it above the launcher's traceback (shared/core/launch.py entrypoint)."""
    from tests.conftest import launch

    data = _table(tmp_path, [(f"text {i}", 0) for i in range(40)])
    proc = launch("baseline", tmp_path / "out", "--train_file", data, expect_fail=True)
    printed = proc.stdout + proc.stderr
    assert printed.count("holds one class (0)") == 1, printed[-3000:]
    tail = printed.strip().splitlines()[-6:]
    assert any("holds one class (0)" in line for line in tail), tail
    assert "Root Cause" in printed and "rank      : 0" in printed
    assert "The same refusal as local rank 0" in printed  # the second process, pointing to the first
    assert "train:" not in printed


def test_a_damaged_results_json_is_written_again_on_resume(tmp_path, caplog):
    """A finished run's results.json cut short (a full disk, a partial copy of the run dir): the resume took it for a
    finished run's record, said 'its results are left as they are' and kept the damaged file. It is no record: the
    resume evaluates the final checkpoint and writes results.json again."""
    from tests.conftest import run_recipe

    flags = ("--max_train_steps", 2, "--checkpointing_steps", 2, "--max_eval_samples", 16, "--no_save_model")
    first = run_recipe("baseline", tmp_path / "out", *flags)
    results = tmp_path / "out" / "results.json"
    results.write_text(results.read_text()[:40])  # cut mid-record
    again = run_recipe("baseline", tmp_path / "out", *flags, "--resume_from_checkpoint", "latest")
    assert again["eval_accuracy"] == first["eval_accuracy"]  # the same final weights, evaluated again
    assert "cannot be read as the run's results" in caplog.text and "left as they are" not in caplog.text


def test_a_failure_after_training_keeps_the_trained_model(tmp_path, monkeypatch):
    """Evaluation that fails after training (a file gone from a network disk) still leaves the trained model."""
    from shared.core.tasks import Task
    from tests.conftest import run_recipe

    def gone(*_args):
        raise OSError("the validation files went away")

    monkeypatch.setattr(Task, "evaluate", gone)
    with pytest.raises(OSError, match="went away"):
        run_recipe("baseline", tmp_path / "out", "--max_train_steps", 3)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "out")  # the 3 trained steps, saved
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 0


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
