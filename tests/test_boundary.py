"""The loading boundary (shared/core/boundary.py) and the data report (shared/core/datareport.py).

An exception injected into each loader (model, config, tokenizer, image processor, data, saved dataset, image,
checkpoint) reads as a message naming the flag and what failed, never as a raw traceback; --debug shows the cause.
Files that datasets reads (.tsv, .jsonl.gz, ';' CSVs, save_to_disk folders) train, and the data report says what
was trained on. Leftover launch variables and a quoted ~ behave as asked (issue 37's trial)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, load_recipe, run_recipe
from tests.test_bad_inputs import _ROWS, _classifier_dir, _folder, _table

FAST = ["--max_train_steps", "2", "--no_save_model", "--report_to", "none", "--max_eval_samples", "16"]


class Injected(Exception):
    """An exception no code of ours knows: what a library may raise on a user's input."""


def _raise(*_args, **_kwargs):
    raise Injected("boom from the library\nsecond line of its message")


def _vit_dir(tmp: Path) -> Path:
    """A tiny ViT classifier with its image processor, as save_pretrained writes them."""
    from transformers import ViTConfig, ViTForImageClassification

    from shared.tasks.images import image_processor

    path = tmp / "vit"
    ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, image_size=32, patch_size=8,
                                         num_labels=2)).save_pretrained(path)
    image_processor(32, [0.5] * 3, [0.5] * 3).save_pretrained(path)
    return path


def _checkpoint(tmp: Path) -> Path:
    run_recipe("baseline", tmp / "run", "--max_train_steps", 2, "--checkpointing_steps", 2, "--no_save_model",
               "--max_eval_samples", 16)
    return tmp / "run" / "checkpoints" / "step_00000002"


def _saved_dataset(tmp: Path) -> Path:
    import datasets

    path = tmp / "saved"
    datasets.Dataset.from_dict({"text": [t for t, _ in _ROWS], "label": [y for _, y in _ROWS]}).save_to_disk(path)
    return path


# loader: (object patched, attribute, the argv that reaches it, the flag named, the words of the message)
LOADERS = {
    "config": ("transformers.AutoConfig", "from_pretrained", lambda t: ["--model_name_or_path", _classifier_dir(t, 2)],
               "--model_name_or_path", "could not load the config"),
    "model": ("transformers.AutoModelForSequenceClassification", "from_pretrained",
              lambda t: ["--model_name_or_path", _classifier_dir(t, 2)], "--model_name_or_path",
              "could not load the model"),
    "tokenizer": ("transformers.AutoTokenizer", "from_pretrained",
                  lambda t: ["--model_name_or_path", _classifier_dir(t, 2)], "--model_name_or_path",
                  "could not load the tokenizer"),
    "processor": ("transformers.AutoImageProcessor", "from_pretrained",
                  lambda t: ["--task", "image-classification", "--model_name_or_path", _vit_dir(t), "--train_dir",
                             _folder(t, n=8)], "--model_name_or_path", "could not load the image processor"),
    "data": ("datasets", "load_dataset", lambda t: ["--train_file", _table(t)], "--train_file",
             "could not load the data file"),
    "saved-dataset": ("datasets", "load_from_disk", lambda t: ["--dataset_name", _saved_dataset(t)], "--dataset_name",
                      "could not load the saved dataset"),
    "image": ("PIL.Image", "open", lambda t: ["--task", "image-classification", "--train_dir", _folder(t, n=8)],
              "0.png", "do not open or decode"),
    "checkpoint": ("accelerate.Accelerator", "load_state", lambda t: ["--resume_from_checkpoint", _checkpoint(t),
                                                                      "--max_train_steps", "4"],
                   "--resume_from_checkpoint", "could not load the checkpoint"),
}


@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_loader_failure_reads_as_a_message(loader, tmp_path, monkeypatch, capsys):
    import importlib

    target, attribute, argv, flag, words = LOADERS[loader]
    module, _, name = target.rpartition(".") if target.count(".") else (target, "", "")
    owner = getattr(importlib.import_module(module), name) if name else importlib.import_module(target)
    extra = argv(tmp_path)
    capsys.readouterr()
    monkeypatch.setattr(owner, attribute, _raise)
    with pytest.raises(SystemExit) as exc:
        run_recipe("baseline", tmp_path / "out", *extra, "--max_train_steps", "2", "--max_eval_samples", "16")
    message, printed = str(exc.value.code), capsys.readouterr()
    assert flag in message and words in message, message
    assert "Injected: boom from the library" in message and "second line" not in message, message
    assert "Traceback" not in printed.err + printed.out  # the message alone
    assert isinstance(exc.value.__context__.__cause__, Injected) or loader == "image"  # chained for --debug
    assert not (tmp_path / "out" / "results.json").exists()


def test_debug_prints_the_cause_after_a_refusal(tmp_path, monkeypatch, capsys):
    import datasets

    monkeypatch.setattr(datasets, "load_dataset", _raise)
    data = _table(tmp_path)
    monkeypatch.setenv("RECIPES_DEBUG", "1")
    with pytest.raises(SystemExit, match="could not load the data file"):
        run_recipe("baseline", tmp_path / "out", "--train_file", data)
    err = capsys.readouterr().err
    assert "Traceback" in err and "tests.test_boundary.Injected: boom" in err or "Injected: boom" in err
    monkeypatch.delenv("RECIPES_DEBUG")
    with pytest.raises(SystemExit):
        run_recipe("baseline", tmp_path / "out2", "--train_file", data, "--debug")
    assert "Traceback" in capsys.readouterr().err


def _report(out: Path) -> dict:
    return json.loads((out / "data_report.json").read_text())


def test_files_datasets_reads_train_and_the_report_says_how(tmp_path):
    """.tsv, .jsonl.gz and a ';' CSV (refused or misread before) train; the data report names the delimiter, the
    label counts per split, and the label-to-id mapping."""
    import gzip

    rows = [(t, "pos" if y else "neg") for t, y in _ROWS]
    tsv = tmp_path / "train.tsv"
    tsv.write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    semi = tmp_path / "excel.csv"
    semi.write_text("text;label\n" + "".join(f"{t};{y}\n" for t, y in rows))
    gz = tmp_path / "train.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.writelines(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows)
    for path, delimiter in ((tsv, "tab"), (semi, ";"), (gz, None)):
        out = tmp_path / path.name.replace(".", "_")
        run_recipe("baseline", out, "--train_file", path, *FAST)
        report = _report(out)
        assert report.get("delimiter") == delimiter, report
        assert report["columns"] == {"text": "text", "label": "label"}
        assert report["label_to_id"] == {"neg": 0, "pos": 1}
        counts = report["label_counts"]
        assert sum(counts["train"].values()) + sum(counts["validation"].values()) == len(rows)  # 10% held out
        assert report["example"]["train"]["tokens"][0] == "[CLS]"


def test_a_saved_dataset_loads_and_is_named_so(tmp_path):
    """save_to_disk's folder (one Dataset, or a DatasetDict) as --dataset_name: load_from_disk, and results.json
    calls it so, not 'hub dataset'."""
    import datasets

    single = _saved_dataset(tmp_path)
    saved = sorted(p.name for p in Path(single).iterdir())
    r = run_recipe("baseline", tmp_path / "one", "--dataset_name", single, *FAST)
    assert r["data"] == f"dataset saved with save_to_disk {single}"
    # The user's folder is read, never written: map()'s cache-*.arrow files went there before.
    assert sorted(p.name for p in Path(single).iterdir()) == saved
    ds = datasets.Dataset.from_dict({"text": [t for t, _ in _ROWS], "label": [y for _, y in _ROWS]})
    datasets.DatasetDict(train=ds, validation=ds.select(range(8))).save_to_disk(tmp_path / "dict")
    with pytest.raises(SystemExit, match="validation rows occur in the training data"):  # the dict's own splits
        run_recipe("baseline", tmp_path / "two", "--dataset_name", tmp_path / "dict", *FAST)


def test_a_hub_datasets_class_names_name_the_saved_models_labels(tmp_path):
    """A ClassLabel column (IMDB's neg/pos, beans' disease names) stores ids; its names become the saved model's
    id2label, so pipeline() answers 'pos', not 'LABEL_1' (they were dropped before)."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=["neg", "pos"])})
    datasets.Dataset.from_dict({"text": [t for t, _ in _ROWS], "label": [y for _, y in _ROWS]},
                               features=features).save_to_disk(tmp_path / "imdb")
    run_recipe("baseline", tmp_path / "out", "--dataset_name", tmp_path / "imdb", "--max_train_steps", "2",
               "--report_to", "none", "--max_eval_samples", "16")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "neg", "1": "pos"}


def test_a_quoted_tilde_means_home_for_every_path_flag(tmp_path, monkeypatch):
    """'~/run' reached Python unexpanded: the lock went to $HOME/run and the model to ./~/run. Now every path
    flag expands it, and nothing is written to a folder named ~."""
    home = tmp_path / "home"
    home.mkdir()
    _table(home)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    from tests.conftest import _reset_accelerate

    _reset_accelerate()
    try:
        load_recipe("baseline").main(["--train_file", "~/train.csv", "--output_dir", "~/run", *FAST])
    finally:
        _reset_accelerate()
    assert (home / "run" / "results.json").exists() and (home / "run" / "data_report.json").exists()
    assert not (tmp_path / "~").exists()
    assert json.loads((home / "run" / "results.json").read_text())["data"] == f"file {home / 'train.csv'}"


def test_leftover_mixed_precision_is_honoured_when_asked(tmp_path, monkeypatch):
    """ACCELERATE_MIXED_PRECISION left in the shell is refused (leftover-mixed-precision in test_bad_inputs); with
    the flag that asks for it, the run computes in it and results.json says so."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    r = run_recipe("baseline", tmp_path / "out", "--mixed_precision", "bf16", *FAST)
    assert r["mixed_precision"] == "bf16"


@pytest.mark.slow
def test_a_one_process_launch_ends_with_the_refusal(tmp_path):
    """`accelerate launch` of one process answers a failed child with its CalledProcessError traceback; the refusal
    is printed again after it (shared/core/launch.py _repeat_after_launcher), so it is the last thing shown."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--cpu",
           str(ROOT / "recipes" / "baseline.py"), "--train_file", str(tmp_path / "missing.csv"),
           "--output_dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    tail = proc.stderr.strip().splitlines()[-2:]
    assert "missing.csv' does not exist" in tail[0], proc.stderr[-2000:]
    assert "CalledProcessError" in proc.stderr  # Accelerate's own, now above the message
