"""A property-based fuzz test of bad input, by class (hypothesis, seeded: derandomize=True).

Each example mutates a valid run of recipes/baseline.py (main(argv) in this process): its data file (format,
encoding, delimiter, header, label spellings and types, empty and huge rows), image folder (modes, formats, nesting,
truncated and foreign files), flags (wrong types, out of range, other tools' flags), model directory (missing or
extra files, config fields removed or changed, another model's tokenizer) or launch environment (what a launch
config becomes: ACCELERATE_* and rendezvous variables).

The property: the run either trains what was asked (checked against data_report.json and results.json: the classes
and their rows, the precision) or stops before the first step with a project error (a message, no traceback). It
never hangs (an alarm), and never finishes having trained something else.

    pytest tests/test_fuzz_inputs.py                # CI: FUZZ_EXAMPLES (40) examples, seeded: 22 s on 2 CPU cores
    pytest tests/test_fuzz_inputs.py -m slow        # FUZZ_EXAMPLES_SLOW (120) examples; 300 ran in 8 min, none failed
Failing inputs found while building the boundary are regression rows in REGRESSIONS below (and test_bad_inputs).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import _reset_accelerate, load_recipe

FUZZ_EXAMPLES, FUZZ_EXAMPLES_SLOW = 40, int(os.environ.get("FUZZ_EXAMPLES_SLOW", "120"))
RUN = ["--max_train_steps", "2", "--no_save_model", "--report_to", "none", "--max_eval_samples", "8",
       "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8"]
N_ROWS = 40
HANG_S = 120  # one example's limit: a run that waits on a peer or a lock fails here instead of hanging CI


@dataclass
class Mutated:
    """A run to try, and what it must train if it trains."""
    kind: str
    argv: list = field(default_factory=list)
    env: dict = field(default_factory=dict)
    classes: dict | None = None  # {class: rows} over both splits, when it trains (None: not checked)
    must_refuse: bool = False
    task: str = "text-classification"

    def describe(self) -> str:
        return f"{self.kind}: argv={self.argv} env={self.env}"


# ---------------------------------------------------------------- data files
_LABELS = {  # style -> (label of row i, the classes a correct run trains: 2 classes of 20 rows)
    "int": lambda i: i % 2, "str": lambda i: ("neg", "pos")[i % 2], "str-int": lambda i: str(i % 2),
    "float": lambda i: float(i % 2), "bool": lambda i: bool(i % 2), "padded": lambda i: (" neg", " pos")[i % 2],
    "upper": lambda i: ("NEG", "POS")[i % 2],
    # refused: one class spelled two ways, or numbers beside strings (JSON)
    "mixed-case": lambda i: ("neg", "pos", "Pos")[i % 3], "mixed-type": lambda i: (0, "1")[i % 2],
}
_REFUSED_LABELS = {"mixed-case", "mixed-type"}


def _texts(accent: bool) -> list[str]:
    word = "café" if accent else "cafe"
    return [f"{'good' if i % 2 else 'bad'} film {word} number {i}" for i in range(N_ROWS)]


@st.composite
def data_files(draw, root: Path) -> Mutated:
    fmt = draw(st.sampled_from(["csv", "tsv", "semicolon", "pipe", "jsonl", "jsonl.gz", "json-array", "parquet"]))
    style = draw(st.sampled_from(list(_LABELS)))
    encoding = draw(st.sampled_from(["utf-8", "utf-8", "utf-8-sig", "latin-1", "utf-16"]))
    row_change = draw(st.sampled_from(["none", "blank-line", "empty-text", "huge-row", "header-again", "no-header",
                                       "empty-file", "header-only"]))
    texts, labels = _texts(accent=encoding != "utf-8"), [_LABELS[style](i) for i in range(N_ROWS)]
    if row_change == "huge-row":
        texts[3] = " ".join(["long"] * 20000)
    if row_change == "empty-text":
        texts[5] = ""
    records = [{"text": t, "label": y} for t, y in zip(texts, labels, strict=True)]
    name = {"semicolon": "train.csv", "pipe": "train.csv", "json-array": "train.json"}.get(fmt, f"train.{fmt}")
    path = root / name
    if fmt in ("csv", "tsv", "semicolon", "pipe"):
        sep = {"csv": ",", "tsv": "\t", "semicolon": ";", "pipe": "|"}[fmt]
        lines = [f"text{sep}label"] if row_change != "no-header" else []
        lines += [f"{r['text']}{sep}{r['label']}" for r in records]
        if row_change == "blank-line":
            lines.insert(10, "")
        if row_change == "header-again":
            lines.insert(20, f"text{sep}label")
        body = "\n".join(lines[:1] if row_change == "header-only" else lines) + "\n"
        path.write_bytes(b"" if row_change == "empty-file" else body.encode(encoding))
    elif fmt == "parquet":
        import pandas as pd

        if style == "mixed-type":  # parquet holds one type per column: the mix is a JSON mistake
            style, labels = "str-int", [str(y) for y in labels]
            records = [{**r, "label": y} for r, y in zip(records, labels, strict=True)]
        pd.DataFrame(records[:0] if row_change == "header-only" else records).to_parquet(path)
        if row_change == "empty-file":
            path.write_bytes(b"")
    else:
        rows = [] if row_change == "header-only" else records
        if fmt == "json-array":
            text = json.dumps(rows, ensure_ascii=False)
        else:
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
            if row_change == "blank-line":
                text = text.replace("\n", "\n\n", 1)
        data = b"" if row_change == "empty-file" else text.encode(encoding)
        path.write_bytes(gzip.compress(data) if fmt.endswith(".gz") and data else data)
    # 0 beside "1": a csv has no types (both read as numbers); a JSON array may read both as strings. Either trains
    # two classes of 20 rows (checked) or is refused; JSON lines refuse it (test_bad_inputs).
    csv_like = fmt in ("csv", "tsv", "semicolon", "pipe")  # a header row repeated is a csv mistake
    refuse = (style == "mixed-case" or row_change == "header-again" and csv_like
              or row_change in ("empty-text", "empty-file", "header-only"))
    return Mutated(f"data {fmt} {style} {encoding} {row_change}", ["--train_file", str(path)],
                   classes={"a": N_ROWS // 2, "b": N_ROWS // 2}, must_refuse=refuse)


# ---------------------------------------------------------------- image folders
@st.composite
def image_folders(draw, root: Path) -> Mutated:
    import numpy as np
    from PIL import Image

    change = draw(st.sampled_from(["none", "modes", "formats", "truncated", "zero-byte", "nested", "foreign-file",
                                   "hidden-folder", "tiny", "one-class"]))
    mode = draw(st.sampled_from(["L", "LA", "P", "RGBA", "I;16", "1", "CMYK", "I", "F"]))
    fmt = draw(st.sampled_from(["jpg", "bmp", "gif", "webp", "tif"]))
    classes = ["one"] if change == "one-class" else ["cat", "dog"]
    rng = np.random.default_rng(0)
    count = {}
    for c in classes:
        (root / "imgs" / c).mkdir(parents=True)
        for i in range(6):
            size = 1 if change == "tiny" and i == 0 else 16
            img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
            target = root / "imgs" / c / f"{i}.png"
            if change == "modes" and i < 2:
                img = img.convert(mode) if mode not in ("I;16", "I", "F") else Image.fromarray(
                    np.asarray(img.convert("L")).astype({"I;16": np.uint16, "I": np.int32, "F": np.float32}[mode])
                     * (257 if mode != "F" else 1))
                target = target.with_suffix(".tif" if mode in ("F", "I", "CMYK", "LA") else ".png")
            if change == "formats" and i < 2:
                target = target.with_suffix(f".{fmt}")
                img = img.convert("RGB")
            img.save(target)
        count[c] = 6
    first = root / "imgs" / classes[0]
    if change == "truncated":
        data = (first / "2.png").read_bytes()
        (first / "2.png").write_bytes(data[: len(data) // 2])
    if change == "zero-byte":
        (first / "2.png").write_bytes(b"")
    if change == "nested":
        (first / "more").mkdir()
        shutil.copy(first / "3.png", first / "more" / "3.png")
    if change == "foreign-file":
        (first / "labels.csv").write_text("file,label\n")
    if change == "hidden-folder":
        (root / "imgs" / ".ipynb_checkpoints").mkdir()
        shutil.copy(first / "3.png", root / "imgs" / ".ipynb_checkpoints" / "3-checkpoint.png")
    refuse = change in ("truncated", "zero-byte", "nested", "foreign-file", "one-class") or (
        change == "modes" and mode in ("I", "F"))
    return Mutated(f"images {change} {mode if change == 'modes' else fmt if change == 'formats' else ''}",
                   ["--task", "image-classification", "--train_dir", str(root / "imgs")],
                   classes=dict(count), must_refuse=refuse, task="image-classification")


# ---------------------------------------------------------------- flags
_FLAG_VALUES = [
    ["--per_device_train_batch_size", "four"], ["--learning_rate", "-1"], ["--learning_rate", "nan"],
    ["--learning_rate", "1e400"], ["--max_seq_length", "0"], ["--max_seq_length", "2"], ["--max_seq_length", "100000"],
    ["--num_warmup_steps", "5"], ["--seed", "-1"], ["--max_grad_norm", "-1"], ["--logging_steps", "0"],
    ["--max_train_samples", "1"], ["--weight_decay", "inf"], ["--num_train_epochs", "0"], ["--task", "ner"],
    ["--model_preset", "huge"], ["--text_column", "label"], ["--label_column", "text"], ["--lr_scheduler_type", "cos"],
    ["--mixed_precision", "fp8"], ["--dataloader_num_workers", "-2"], ["--resume_from_checkpoint", "latest"],
    ["--output_dir", ""], ["--report_to", "wandbb"], ["--checkpointing_steps", "0"], ["--save_total_limit", "1"],
]


@st.composite
def flags(draw, root: Path) -> Mutated:
    from shared.core.args import SPELLINGS

    if draw(st.booleans()):
        argv = list(draw(st.sampled_from(_FLAG_VALUES)))
    else:
        argv = [draw(st.sampled_from(sorted(SPELLINGS)))] + draw(st.sampled_from([[], ["1"], ["true"]]))
    must = argv[0] in SPELLINGS and argv[0] not in ("--chat_template",)  # never a flag of ours: refused
    return Mutated(f"flags {' '.join(argv)}", argv, must_refuse=must)


# ---------------------------------------------------------------- model directories
_BASE_MODEL: list[Path] = []


def _base_model() -> Path:
    """A tiny BERT classifier of 2 labels with its tokenizer, written once per session."""
    if not _BASE_MODEL:
        from transformers import BertConfig, BertForSequenceClassification

        from shared.core.data import build_word_tokenizer

        path = Path(tempfile.mkdtemp()) / "model"
        BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                 intermediate_size=64, max_position_embeddings=64, vocab_size=200,
                                                 num_labels=2)).save_pretrained(path)
        build_word_tokenizer(_texts(False), "text-classification", vocab_size=150).save_pretrained(path)
        _BASE_MODEL.append(path)
    return _BASE_MODEL[0]


@st.composite
def model_dirs(draw, root: Path) -> Mutated:
    model = root / "model"
    shutil.copytree(_base_model(), model)
    change = draw(st.sampled_from(["none", "no-weights", "no-config", "no-tokenizer", "drop-field", "change-field",
                                   "big-tokenizer", "extra-files", "cut-weights", "bad-json", "adapter-beside"]))
    fld = draw(st.sampled_from(["hidden_size", "vocab_size", "num_attention_heads", "model_type", "architectures",
                                "max_position_embeddings", "num_labels", "id2label"]))
    config = json.loads((model / "config.json").read_text())
    if change == "no-weights":
        (model / "model.safetensors").unlink()
    if change == "no-config":
        (model / "config.json").unlink()
    if change == "no-tokenizer":
        for f in model.glob("tokenizer*"):
            f.unlink()
    if change == "drop-field":
        config.pop(fld, None)
    if change == "change-field":
        config[fld] = {"hidden_size": 48, "vocab_size": 50, "num_attention_heads": 3, "model_type": "gpt2",
                       "architectures": ["GPT2LMHeadModel"], "max_position_embeddings": 8, "num_labels": 5,
                       "id2label": {"0": "x", "1": "y", "2": "z"}}[fld]
    if change in ("drop-field", "change-field"):
        (model / "config.json").write_text(json.dumps(config))
    if change == "big-tokenizer":
        from shared.core.data import build_word_tokenizer

        build_word_tokenizer([f"w{i}" for i in range(400)], "text-classification").save_pretrained(root / "tok")
        return Mutated("model big-tokenizer", ["--model_name_or_path", str(model), "--tokenizer_name",
                                               str(root / "tok"), "--train_file", str(_data(root)),
                                               "--max_seq_length", "32"],
                       classes={"a": N_ROWS // 2, "b": N_ROWS // 2}, must_refuse=True)
    if change == "extra-files":
        (model / "notes.md").write_text("# my model")
        (model / "optimizer.pt").write_bytes(b"\0" * 64)
    if change == "cut-weights":
        w = model / "model.safetensors"
        w.write_bytes(w.read_bytes()[:200])
    if change == "bad-json":
        (model / "config.json").write_text((model / "config.json").read_text()[:-10])
    if change == "adapter-beside":
        (model / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": "x"}))
    refuse = change in ("no-weights", "no-config", "cut-weights", "bad-json", "adapter-beside") or (
        change == "change-field" and fld == "model_type")  # BERT weights under a GPT-2 config: none would load
    return Mutated(f"model {change} {fld if 'field' in change else ''}",
                   ["--model_name_or_path", str(model), "--train_file", str(_data(root)), "--max_seq_length", "32"],
                   classes={"a": N_ROWS // 2, "b": N_ROWS // 2}, must_refuse=refuse)


def _data(root: Path) -> Path:
    path = root / "train.csv"
    path.write_text("text,label\n" + "".join(f"{t},{i % 2}\n" for i, t in enumerate(_texts(False))))
    return path


# ---------------------------------------------------------------- launch environments
_ENVS = [
    {"WORLD_SIZE": "2"}, {"WORLD_SIZE": "1", "RANK": "0"}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1"},
    {"LOCAL_RANK": "0"}, {"ACCELERATE_MIXED_PRECISION": "fp16"}, {"ACCELERATE_MIXED_PRECISION": "bf16"},
    {"ACCELERATE_USE_FSDP": "true"}, {"ACCELERATE_USE_DEEPSPEED": "true"}, {"ACCELERATE_DYNAMO_BACKEND": "EAGER"},
    {"ACCELERATE_USE_CPU": "true"}, {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"},
    {"ACCELERATE_MIXED_PRECISION": "no"}, {"ACCELERATE_USE_FSDP": "false"},
]


@st.composite
def launch_envs(draw, root: Path) -> Mutated:
    env = dict(draw(st.sampled_from(_ENVS)))
    refuse = any(k in env for k in ("WORLD_SIZE", "RANK", "MASTER_ADDR", "LOCAL_RANK")) or env.get(
        "ACCELERATE_MIXED_PRECISION", "no") != "no" or "true" in (env.get("ACCELERATE_USE_FSDP"),
                                                                   env.get("ACCELERATE_USE_DEEPSPEED"))
    return Mutated(f"env {env}", ["--train_file", str(_data(root))], env=env,
                   classes={"a": N_ROWS // 2, "b": N_ROWS // 2}, must_refuse=refuse)


KINDS = {"data": data_files, "images": image_folders, "flags": flags, "model": model_dirs, "env": launch_envs}


# ---------------------------------------------------------------- the property
class Hung(Exception):
    pass


def _alarm(*_):
    raise Hung(f"no answer in {HANG_S} s")


def run_mutated(case: Mutated, out: Path, capsys) -> tuple[str, str]:
    """('trained' | 'refused' | 'crashed', detail). Checks the property; returns what happened."""
    saved = dict(os.environ)
    os.environ.update(case.env)
    _reset_accelerate()
    capsys.readouterr()
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(HANG_S)
    try:
        load_recipe("baseline").main([*RUN, *case.argv, "--output_dir", str(out)])
        outcome, detail = "trained", ""
    except SystemExit as exc:
        printed = capsys.readouterr()
        usage = exc.code == 2 and "error:" in printed.err  # argparse: the usage line and the error
        outcome = "refused" if isinstance(exc.code, str) or usage else "crashed"
        detail = str(exc.code) if isinstance(exc.code, str) else printed.err[-400:]
        assert "Traceback" not in printed.err + printed.out, f"{case.describe()}: a traceback was shown"
        assert "train:" not in printed.err, f"{case.describe()}: refused after training started: {detail}"
        assert not (out / "results.json").exists(), f"{case.describe()}: refused after writing results"
    except Hung:
        raise
    except Exception as exc:  # noqa: BLE001 (a raw exception is the failure this test looks for)
        outcome, detail = "crashed", f"{type(exc).__name__}: {exc}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        _reset_accelerate()
        os.environ.clear()
        os.environ.update(saved)
    return outcome, detail


def check_property(case: Mutated, out: Path, outcome: str, detail: str) -> None:
    assert outcome != "crashed", f"{case.describe()}: a raw exception, not a project error: {detail[:600]}"
    if outcome == "refused":
        return
    assert not case.must_refuse, f"{case.describe()}: trained, but it must be refused"
    report = json.loads((out / "data_report.json").read_text())
    results = json.loads((out / "results.json").read_text())
    assert results["mixed_precision"] == "no", f"{case.describe()}: trained in {results['mixed_precision']} unasked"
    if case.classes is None:
        return
    total = sum(case.classes.values())  # no validation data given: 10% of the rows are held out
    held = math.ceil(total * 0.1) if case.task == "text-classification" else max(1, total // 10)
    train = report["label_counts"]["train"]
    assert len(report["label_to_id"]) == len(case.classes), f"{case.describe()}: trained classes {train}"
    assert sum(train.values()) == total - held, f"{case.describe()}: trained {train}, asked {case.classes}"


def _kinds_strategy():
    return st.sampled_from(sorted(KINDS))


def _one(data, capsys, tmp_root: Path) -> None:
    kind = data.draw(_kinds_strategy())
    root = Path(tempfile.mkdtemp(dir=tmp_root))
    case = data.draw(KINDS[kind](root))
    try:
        outcome, detail = run_mutated(case, root / "out", capsys)
        if os.environ.get("FUZZ_LOG"):
            with open(os.environ["FUZZ_LOG"], "a") as f:
                f.write(json.dumps({"case": case.describe()[:200], "outcome": outcome, "detail": detail[:300]}) + "\n")
        check_property(case, root / "out", outcome, detail)
    except AssertionError as err:
        if not os.environ.get("FUZZ_COLLECT"):  # development: record every failure and go on, instead of shrinking
            raise
        with open(os.environ["FUZZ_COLLECT"], "a") as f:
            f.write(json.dumps({"case": case.describe(), "failure": str(err).splitlines()[0][:700]}) + "\n")
    shutil.rmtree(root, ignore_errors=True)


_COMMON = dict(derandomize=True, deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                      HealthCheck.data_too_large])


@settings(max_examples=FUZZ_EXAMPLES, **_COMMON)
@given(data=st.data())
def test_fuzzed_inputs_train_what_was_asked_or_are_refused(data, capsys, tmp_path_factory):
    _one(data, capsys, tmp_path_factory.getbasetemp())


@pytest.mark.slow
@settings(max_examples=FUZZ_EXAMPLES_SLOW, **_COMMON)
@given(data=st.data())
def test_fuzzed_inputs_many(data, capsys, tmp_path_factory):
    _one(data, capsys, tmp_path_factory.getbasetemp())
