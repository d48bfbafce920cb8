"""What the data holds, checked before the first step: files that parse, columns that agree, texts that are text,
a label set a classifier can learn (images that open: shared/tasks/images.py). Each refusal names the file, row or
line, and the fix."""

from __future__ import annotations

import itertools
import json
import logging
import math
from collections import Counter
from pathlib import Path

from .errors import InputError

logger = logging.getLogger("recipes")

_SHOWN = 5  # rows named in a message; the count says how many more


def _rows(indices: list[int]) -> str:
    """Row numbers as a user finds them: 1-based data rows (a csv's header is not a row)."""
    shown = ", ".join(str(i + 1) for i in indices[:_SHOWN])
    return f"{shown} and {len(indices) - _SHOWN} more" if len(indices) > _SHOWN else shown


# ---------------------------------------------------------------- files
def explain_unreadable(path: str, kind: str, err: Exception) -> InputError:
    """The refusal for a file `datasets` could not build a split from: the file, the line, the cause."""
    where = _first_bad_line(Path(path), kind)
    cause = err.__cause__ or err.__context__ or err
    detail = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
    return InputError(f"{path}: cannot be read as {kind}{', ' + where if where else ''} ({detail}). Fix or remove "
                      f"that {'line' if where else 'content'}, or save the file as UTF-8 {kind}.")


def check_csv_fields(path: str, delimiter: str, rows: int = 10_000) -> None:
    """The header against the first `rows` rows, as the csv module splits them. pandas (under datasets) takes two
    mistakes silently: a column name given twice (the second renamed 'name.1'), and a first row one field longer
    than the header (the first column becomes the row index, every column shifts one left: labels read as texts).
    Longer rows further down fail in pandas, and shorter ones become empty cells, which the column checks name."""
    import csv
    import gzip

    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8-sig", errors="replace", newline="") as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, [])
        twice = sorted({n for n in header if n.strip() and header.count(n) > 1})
        if twice:
            raise InputError(f"{path}: the header names {', '.join(repr(n) for n in twice)} twice ({header}): pandas "
                             "would rename the second and the run would use whichever came first. Give every column "
                             "its own name.")
        longer = [(reader.line_num, len(row)) for row in itertools.islice(reader, rows) if len(row) > len(header)]
    if longer:
        (line, n), more = longer[0], f" (and {len(longer) - 1} more line(s))" if len(longer) > 1 else ""
        raise InputError(f"{path}: line {line} has {n} fields where the header has {len(header)}{more}: a "
                         f"{delimiter!r} inside an unquoted text splits it into two fields. Quote such texts "
                         f"(\"a{delimiter} b\"), as Python's csv.writer and pandas' to_csv do, or save the file as "
                         "JSON lines.")


def _first_bad_line(path: Path, kind: str) -> str:
    """'line N: why' for the first line that does not decode as UTF-8 or (json lines) does not parse. Binary
    formats (parquet) have no lines; a compressed file's lines are its decompressed ones."""
    import gzip

    if kind not in ("csv", "json", "text"):
        return ""
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix.lower() == ".gz" else path.read_bytes()
    except OSError as err:
        return f"it does not decompress ({err})"
    if raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte-order mark (Excel's 'Unicode text', PowerShell)
        return "it is UTF-16 (its first bytes are a UTF-16 byte-order mark)"
    for number, line in enumerate(raw.split(b"\n"), start=1):
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as err:
            return f"line {number} is not UTF-8 (byte {line[err.start:err.start + 1]!r} at column {err.start + 1})"
        if kind == "json" and text.strip() and not _is_json_array(raw):
            try:
                json.loads(text)
            except json.JSONDecodeError as err:
                return f"line {number} is not valid JSON ({err.msg} at column {err.colno})"
    return ""


def _is_json_array(raw: bytes) -> bool:
    return raw.lstrip()[:1] == b"["


def check_same_columns(train_columns: list[str], val_columns: list[str], train_file: str, val_file: str) -> None:
    if set(train_columns) != set(val_columns):
        raise InputError(f"{val_file} has columns {val_columns}, {train_file} has {train_columns}: the splits must "
                         "have the same columns. Rename or drop columns so that they match.")


def check_can_hold_out(n_rows: int, source: str) -> None:
    """Without a validation split, 10% of the training rows are held out: that needs at least two rows."""
    if n_rows < 2:
        raise InputError(f"The training data ({source}) holds {n_rows} row: too few to hold out 10% for evaluation. "
                         "Pass --validation_file, or add rows (a .txt file holds one document per line).")


# ---------------------------------------------------------------- texts
def check_texts(values: list, column: str, split: str, allow_empty: bool = False) -> None:
    """Every cell of a text column is a string; empty ones are refused where they would be trained on."""
    not_text = [i for i, v in enumerate(values) if v is not None and not isinstance(v, str)]
    if not_text:
        example = values[not_text[0]]
        raise InputError(f"The {split} column {column!r} holds {type(example).__name__} values, not text (row "
                         f"{_rows(not_text)}, e.g. {example!r}). Pass --text_column naming the column of texts.")
    if allow_empty:
        return
    empty = [i for i, v in enumerate(values) if v is None or not v.strip()]
    if empty:
        raise InputError(f"The {split} column {column!r} has {len(empty)} empty cell(s), row {_rows(empty)}. Fill "
                         "or drop those rows: an empty text trains the label on nothing but special tokens.")


def check_seq_length(max_seq_length: int, specials: int, task: str, least: int = 4) -> None:
    if max_seq_length - specials < least:  # below the specials nothing is cut, at them [CLS] [SEP]; 4: a phrase
        raise InputError(f"--max_seq_length {max_seq_length} leaves {max(0, max_seq_length - specials)} token(s) of "
                         f"text per {task} sample beside the tokenizer's {specials} special tokens; {least} is the "
                         f"least that trains. Pass --max_seq_length {specials + least} or more.")


# ---------------------------------------------------------------- labels
def check_label_values(values: list, column: str, split: str) -> None:
    """Every cell of a label column holds a class: one value, not empty, not a fraction, not negative."""
    header = [i for i, v in enumerate(values) if v == column]  # two csv files joined by `cat`
    if header:
        raise InputError(f"The {split} data repeats its header row at row {_rows(header)}: a class named {column!r} "
                         "would train. Delete those rows (join files with `tail -n +2` for all but the first).")
    nested = [i for i, v in enumerate(values) if isinstance(v, (list, dict, tuple))]
    if nested:
        raise InputError(f"The {split} label column {column!r} holds {type(values[nested[0]]).__name__} values (row "
                         f"{_rows(nested)}, e.g. {values[nested[0]]!r}): these recipes train one class per example, "
                         "not multi-label targets. Pass --label_column naming a column of single classes.")
    empty = [i for i, v in enumerate(values) if v is None or (isinstance(v, float) and math.isnan(v))
             or (isinstance(v, str) and not v.strip())]
    if empty:
        raise InputError(f"The {split} label column {column!r} has {len(empty)} empty cell(s), row "
                         f"{_rows(empty)}. Fill or drop those rows: an empty label is not a class.")
    strings = [i for i, v in enumerate(values) if isinstance(v, str)]
    if 0 < len(strings) < len(values):  # 0/1 beside "neg"/"pos": four classes where two were meant
        raise InputError(f"The {split} label column {column!r} mixes numbers and strings (strings at row "
                         f"{_rows(strings)}, e.g. {values[strings[0]]!r}): each spelling would be a class of its "
                         "own. Write every label one way: all numbers, or all names.")
    fractional = [i for i, v in enumerate(values) if isinstance(v, float) and not v.is_integer()]
    if fractional:
        raise InputError(f"The {split} label column {column!r} holds fractions (row {_rows(fractional)}, e.g. "
                         f"{values[fractional[0]]}): these recipes classify, they do not regress. Pass "
                         "--label_column naming a column of classes.")
    negative = [i for i, v in enumerate(values) if isinstance(v, (int, float)) and v < 0]
    if negative:
        raise InputError(f"The {split} label column {column!r} has negative labels (row {_rows(negative)}, "
                         f"e.g. {values[negative[0]]}); GLUE's test splits mark unlabelled rows with -1. Drop "
                         "those rows, or use a split with labels.")


def check_roles(columns: dict[str, str | None]) -> None:
    """One column in two roles (text and label, text and pair) trains the answer as the question: refused."""
    seen: dict[str, str] = {}
    for role, column in columns.items():
        if column and column in seen:
            raise InputError(f"The column {column!r} is used as both the {seen[column]} and the {role}: the model "
                             f"would read its own {role}. Pass --{role.replace(' ', '_')}_column naming another "
                             "column.")
        if column:
            seen[column] = role


def check_spellings(values: list, column: str) -> None:
    """Label values that differ only in case, spaces or number formatting ('pos'/'Pos', '1'/'1.0') would each train
    as a class of their own: two classes where one was meant."""
    groups: dict[object, dict] = {}
    for v in set(values):
        text = str(v).strip().casefold()
        try:
            norm: object = float(text)
        except ValueError:
            norm = text
        groups.setdefault(norm, {})[_key(v)] = v  # 1, 1.0 and True are one class already (_key)
    # 0 beside "0" (a type, not a spelling) is label_set's to explain, split by split
    split = [sorted(map(repr, g.values())) for g in groups.values() if len({str(v) for v in g.values()}) > 1]
    if split:
        shown = "; ".join(" / ".join(g) for g in split[:_SHOWN])
        raise InputError(f"The label column {column!r} spells one class several ways ({shown}): each spelling would "
                         "train as a class of its own. Write each label one way (same case, no spaces) in every split.")


def label_set(train: list, val: list, column: str) -> tuple[list, dict]:
    """The classes a classifier learns, and how each label value maps to its index; refuses a label set that
    cannot train what the user meant. Integers 0..K-1 stay; anything else is numbered in sorted order (so labels
    1..5 train 5 classes, not 6 with a class 0 nothing ever trains). The values passed check_label_values."""
    check_spellings(list(train) + list(val), column)
    train_keys = [_key(v) for v in train]
    counts = Counter(train_keys)
    if len(counts) < 2:
        raise InputError(f"The training label column {column!r} holds one class ({next(iter(counts))!r}): a "
                         "classifier needs at least two, and one class would score accuracy 1.0 having learned "
                         "nothing. Add examples of the other classes, or pass --label_column naming the label column.")
    if len(counts) > 2 and len(counts) > len(train) / 2:
        raise InputError(f"The label column {column!r} has {len(counts)} different values in {len(train)} training "
                         f"rows (e.g. {list(counts)[:3]}): a class seen about once cannot be learned. Is it a text "
                         "column? Pass --label_column naming the column of classes.")
    unseen = sorted({_key(v) for v in val} - set(counts), key=str)
    if unseen and {str(k) for k in unseen} <= {str(k) for k in counts}:
        raise InputError(f"The validation labels {unseen[:_SHOWN]} are {type(unseen[0]).__name__}s, the training "
                         f"labels the same as {type(next(iter(counts))).__name__}s: no class would match. Write "
                         f"{column!r} one way in both splits: numbers (0, not \"0\", in JSON) or strings.")
    if unseen:
        raise InputError(f"The validation labels {unseen[:_SHOWN]} never occur in the training data: no step would "
                         "ever train them, and evaluation would count them as errors. Add training examples of "
                         "them, or drop those validation rows.")
    if len(counts) > 20 and len(counts) > len(train) / 10:
        logger.warning("The label column %r has %d classes in %d training rows, %.1f rows per class: check that "
                       "--label_column names the classes.", column, len(counts), len(train), len(train) / len(counts))
    classes = sorted(counts, key=lambda k: (isinstance(k, str), k))
    if all(isinstance(k, int) for k in classes) and classes == list(range(len(classes))):
        return classes, {}
    return [str(k) for k in classes], {k: i for i, k in enumerate(classes)}


def _key(v: object) -> object:
    """A label value as a class key: 3, 3.0 and True/False are integers; strings stay strings."""
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def label_index(mapping: dict) -> object:
    """value -> class index, for label_set's mapping ({}: the values are the indices)."""
    return (lambda v: mapping[_key(v)]) if mapping else int


def check_held_out(train: object, val: object | None, columns: list) -> None:  # the same file, a copy, or a subset
    rows = lambda s: {hash(r) for r in zip(*(s[c] for c in filter(None, columns)), strict=True)}  # noqa: E731
    if val is not None and len(val[columns[0]]) and rows(val) <= rows(train):  # one pass each, hashes only
        raise InputError(f"All {len(val[columns[0]])} validation rows occur in the training data: evaluation would "
                         "score rows the model trained on. Pass held-out data as --validation_file (--validation_dir), "
                         "or drop the flag: 10% of the training rows are then held out.")
