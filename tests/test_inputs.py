"""User data in every supported form trains; bad input fails before training with a message naming the fix."""

import json

import numpy as np
import pytest

from shared.tasks.causal_lm import story_dataset
from shared.tasks.text_classification import sentiment_dataset
from tests.conftest import run_recipe

FAST = ["--max_train_steps", 2, "--no_save_model"]


def _write_text_classification(tmp_path, fmt):
    import pandas as pd

    d = sentiment_dataset(80, seed=5)
    df = pd.DataFrame({"review": d["text"], "sentiment": ["pos" if y else "neg" for y in d["label"]]})
    path = tmp_path / f"train.{fmt}"
    {"csv": lambda: df.to_csv(path, index=False), "jsonl": lambda: df.to_json(path, orient="records", lines=True),
     "parquet": lambda: df.to_parquet(path)}[fmt]()
    return path


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "parquet"])
def test_text_classification_from_files(fmt, tmp_path):
    path = _write_text_classification(tmp_path, fmt)
    r = run_recipe("baseline", tmp_path / "out", "--train_file", path, "--text_column", "review",
                   "--label_column", "sentiment", "--max_train_steps", 2)
    assert r["data"] == f"file {path}"
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "out").id2label == {0: "neg", 1: "pos"}  # string labels numbered


def test_causal_lm_from_txt(tmp_path):
    path = tmp_path / "train.txt"
    path.write_text("\n".join(story_dataset(200, seed=3)["text"]) + "\n\n")  # packed: 25 blocks of 128 tokens
    r = run_recipe("baseline", tmp_path / "out", "--task", "causal-lm", "--train_file", path, *FAST)
    assert r["eval_perplexity"] > 1


def test_images_from_folders(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for cls in ("cats", "dogs", "owls"):
            (tmp_path / split / cls).mkdir(parents=True)
            for i in range(6):
                pixels = rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)  # not square, not the model's size
                Image.fromarray(pixels).save(tmp_path / split / cls / f"{i}.png")
    r = run_recipe("baseline", tmp_path / "out", "--task", "image-classification", "--train_dir", tmp_path / "train",
                   "--validation_dir", tmp_path / "val", "--max_train_steps", 2, "--per_device_train_batch_size", 4)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["id2label"] == {"0": "cats", "1": "dogs", "2": "owls"}
    assert r["eval_accuracy"] is not None


def test_tensorboard_tracker_writes_events(tmp_path):
    from tests.conftest import _reset_accelerate, load_recipe

    _reset_accelerate()
    load_recipe("baseline").main(["--max_train_steps", "3", "--logging_steps", "1", "--no_save_model",
                                  "--report_to", "tensorboard", "--output_dir", str(tmp_path)])
    _reset_accelerate()
    assert list(tmp_path.rglob("events.out.tfevents.*")), "no TensorBoard event file"
