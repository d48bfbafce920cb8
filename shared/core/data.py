"""Data every task reads: local files, hub datasets, tokenizers; the built-in data and image folders are the task
modules' (shared/tasks/)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator
from difflib import get_close_matches
from pathlib import Path

from . import datacheck
from .args import tasks_package
from .boundary import diagnose, loading
from .errors import InputError

# ---------------------------------------------------------------- built-in offline data (deterministic)
BUILTIN_SIZES = {"train": 2000, "validation": 400}


def builtin_split(task: str, split: str) -> dict[str, list]:
    """The built-in data: 2000 training and 400 validation examples, the same on every machine. Each task module
    makes its own (builtin_data in shared/tasks/<task>.py), loaded by name: a copy carries its task's alone."""
    n, seed = BUILTIN_SIZES[split], {"train": 1, "validation": 2}[split]
    return importlib.import_module(f"{tasks_package()}.tasks.{task.replace('-', '_')}").builtin_data(n, seed)


# ---------------------------------------------------------------- user data: files, folders, hub
_TEXT_GUESSES = ("text", "sentence", "content", "review", "document")
_LABEL_GUESSES = ("label", "labels", "class", "target")
_FILE_TYPES = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet",
               ".txt": "text"}
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst")  # datasets decompresses these itself


def file_kind(path: str) -> str | None:
    """The datasets builder of a data file by its name (data.jsonl.gz: json), None for a type no loader reads."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    if suffixes and suffixes[-1] in _COMPRESSED:
        suffixes = suffixes[:-1]
    return _FILE_TYPES.get(suffixes[-1]) if suffixes else None


def csv_delimiter(path: str) -> str:
    """The delimiter of a csv/tsv file: a tab for .tsv; else ',' unless the header is split by ';', tab or '|' and
    holds no comma (Excel in many locales writes ';'). Reported in the data report."""
    import gzip

    if ".tsv" in [s.lower() for s in Path(path).suffixes]:
        return "\t"
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8", errors="replace") as f:
            header = f.readline()
    except OSError:
        return ","
    if "," in header:
        return ","
    counts = {d: header.count(d) for d in (";", "\t", "|")}
    best = max(counts, key=counts.get)
    return best if counts[best] else ","


def check_paths(args: argparse.Namespace) -> None:
    """Missing paths and mixed sources fail before any model is built."""
    for flag in ("train_file", "validation_file", "train_dir", "validation_dir"):
        path = getattr(args, flag)
        if path and not Path(path).exists():
            raise InputError(f"--{flag} {path!r} does not exist. Pass an existing path (relative to {Path.cwd()}).")
    for flag in ("train_file", "validation_file"):
        path = getattr(args, flag)
        if path:
            kind = file_kind(path)
            if Path(path).is_dir():
                found, fix = diagnose("data file", path)
                raise InputError(f"--{flag} {path!r}: {found}. {fix}"
                                 + (" An image folder is --train_dir." if args.task == "image-classification" else ""))
            if kind is None:
                raise InputError(f"--{flag} {path!r}: unknown file type. Use one of {sorted(_FILE_TYPES)} "
                                 f"(or those compressed: {', '.join(_COMPRESSED)}).")
            if Path(path).stat().st_size == 0:
                raise InputError(f"--{flag} {path!r} is empty (0 bytes). Pass the file with its rows (an interrupted "
                                 "copy or export?).")
            if kind == "text" and args.task != "causal-lm":
                raise InputError(f"--{flag} {path!r}: .txt has no labels; it serves --task causal-lm only. "
                                 "Use csv, json/jsonl or parquet with a label column.")
    name = args.dataset_name
    if name and name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():
        raise InputError(f"--dataset_name {name!r} does not exist. Pass an existing directory, a hub dataset id, "
                         "or --train_file for a local file.")
    if (args.train_dir or args.validation_dir) and args.task != "image-classification":
        raise InputError("--train_dir/--validation_dir are image folders: use them with --task image-classification.")
    sources = [s for s in ("dataset_name", "train_file", "train_dir") if getattr(args, s)]
    if len(sources) > 1:
        raise InputError(f"Pass one data source, not {', '.join('--' + s for s in sources)}.")
    if args.validation_file and not args.train_file:
        raise InputError("--validation_file needs --train_file.")
    if args.validation_dir and not args.train_dir:
        raise InputError("--validation_dir needs --train_dir.")


def load_raw_splits(args: argparse.Namespace) -> tuple[object, object, str]:
    """Train and validation splits (HF Datasets, or dicts of lists for the built-in data) and where they came from;
    validation is None when the source has none (hold_out makes one). Image folders: shared/tasks/images.py."""
    import datasets

    SKIPPED.clear()
    if args.train_file:
        with loading("data file", "--train_file", args.train_file):
            train = _load_file(args.train_file)
        with loading("data file", "--validation_file", args.validation_file):
            val = _load_file(args.validation_file) if args.validation_file else None
        if val is not None:
            datacheck.check_same_columns(train.column_names, val.column_names, args.train_file, args.validation_file)
        source = f"file {args.train_file}"
    elif args.dataset_name:
        saved = Path(args.dataset_name).expanduser()
        if saved.is_dir() and ((saved / "dataset_dict.json").exists() or (saved / "state.json").exists()):
            # save_to_disk's folder: load_dataset refuses it ("use load_from_disk instead")
            with loading("saved dataset", "--dataset_name", args.dataset_name):
                loaded = datasets.load_from_disk(str(saved))
            # map() would write its cache-*.arrow files into the user's folder, beside the saved data: a temporary
            # folder holds them instead (datasets deletes it at exit; the tokenization is then redone each run).
            datasets.disable_caching()
            if isinstance(loaded, datasets.Dataset):  # one split: the validation rows are held out below
                loaded = datasets.DatasetDict(train=loaded)
            kind = "dataset saved with save_to_disk"
        else:
            try:
                loaded = datasets.load_dataset(args.dataset_name, args.dataset_config_name,
                                               trust_remote_code=args.trust_remote_code or None)
            except (ConnectionError, FileNotFoundError) as err:  # datasets' words for offline, and for no such id
                raise InputError(f"Could not load the hub dataset {args.dataset_name!r} ({type(err).__name__}: "
                                 f"{str(err).splitlines()[0]}). Check the id and the network (HF_HUB_OFFLINE=1 "
                                 "forbids downloads), or pass local data: --train_file, or --train_dir for "
                                 "images.") from err
            except Exception as err:  # noqa: BLE001 (the loading boundary: a folder or script datasets rejects)
                from .boundary import explain

                raise InputError(explain("dataset", "--dataset_name", args.dataset_name, err)) from err
            kind = "hub dataset" if not saved.exists() else "dataset folder"
        if "train" not in loaded:
            raise InputError(f"The dataset {args.dataset_name!r} has no 'train' split (it has {sorted(loaded)}). "
                             "Pass --dataset_config_name for a configuration with one, or its files as "
                             "--train_file and --validation_file.")
        val_name = next((s for s in ("validation", "valid", "test") if s in loaded), None)
        train, val = loaded["train"], loaded[val_name] if val_name else None
        source = f"{kind} {args.dataset_name}"
    else:
        return builtin_split(args.task, "train"), builtin_split(args.task, "validation"), "built-in offline dataset"
    if not isinstance(train, dict) and len(train) == 0:
        raise InputError(f"The training data ({source}) is empty.")
    return train, val, source


def hold_out(train: object, val: object | None, source: str) -> tuple[object, object]:
    """The validation split: the given one, else 10% of the training rows, the same rows for every seed. Called
    after the row checks, so that a refusal's row numbers are the file's own."""
    if val is not None:
        return train, val
    datacheck.check_can_hold_out(len(train), source)
    parts = train.train_test_split(test_size=0.1, seed=0)
    return parts["train"], parts["test"]


def _load_file(path: str):
    """One data file as a Dataset; a file that does not parse is refused with its name and first bad line."""
    import datasets

    kind = file_kind(path)
    if Path(path).stat().st_size < 1 << 20 and not Path(path).read_bytes().strip():  # datasets: a bare StopIteration
        raise InputError(f"The data file {path} is empty. Pass a file with rows.")
    options = {"sep": csv_delimiter(path)} if kind == "csv" else {}
    if kind == "csv":
        datacheck.check_csv_fields(path, options["sep"])
    try:
        ds = datasets.load_dataset(kind, data_files={"train": path}, split="train", **options)
    except ValueError as err:
        if "corresponds to no data" in str(err) or _no_rows(path, kind):  # a file with a header and no rows
            raise InputError(f"The data file {path} is empty. Pass a file with rows.") from None
        raise datacheck.explain_unreadable(path, kind, err) from err
    except datasets.exceptions.DatasetGenerationError as err:
        if _no_rows(path, kind):
            raise InputError(f"The data file {path} is empty. Pass a file with rows.") from err
        raise datacheck.explain_unreadable(path, kind, err) from err
    try:  # Arrow checks UTF-8 only when a cell is read: a compressed file's bad bytes surfaced mid-build
        ds.data.table.validate(full=True)
    except Exception as err:  # noqa: BLE001 (pyarrow.ArrowInvalid: which line, said by explain_unreadable)
        raise datacheck.explain_unreadable(path, kind, err) from err
    if kind == "json" and len(ds) == 1 and all(isinstance(v, dict) for v in ds[0].values()):
        raise InputError(f"{path} is one JSON object of columns ({{column: {{row: value}}}}: pandas' df.to_json(path)"
                         '), not a record per row. Save it with df.to_json(path, orient="records", lines=True).')
    # One object wrapping the records ({"version": ..., "data": [{...}, ...]}, SQuAD's layout): each record is a row.
    if kind == "json" and len(ds) == 1 and (wrapped := [k for k, v in ds[0].items() if isinstance(v, list) and v
                                                        and all(isinstance(r, dict) for r in v)]):
        raise InputError(f"{path} is one JSON object whose records are a list under {wrapped[0]!r}, not a record per "
                         f"row. Write each record of {wrapped[0]!r} on its own line (jsonl): "
                         f"[json.dumps(r) for r in json.load(f)[{wrapped[0]!r}]].")
    return ds


def _no_rows(path: str, kind: str) -> bool:
    """A parquet file of no rows (pyarrow's 'BatchSize must be greater than 0' in datasets)."""
    if kind != "parquet":
        return False
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception:  # noqa: BLE001 (not a parquet file at all: the caller explains that)
        return False


SKIPPED: list[str] = []  # what the last load_raw_splits left out, and why: the data report shows it


def class_names(ds: object, column: str, classes: list) -> list[str] | None:
    """The name of each class (label_set's, in order) where the column is a datasets ClassLabel, whose values are
    ids: for the saved model's id2label. None otherwise."""
    feature = (getattr(ds, "features", None) or {}).get(column)
    return [feature.names[int(c)] for c in classes] if type(feature).__name__ == "ClassLabel" else None


def pick_column(columns: list[str], wanted: str | None, guesses: tuple[str, ...], what: str, flag: str) -> str:
    """The named column, or the first common name present; a clear error naming the columns that exist."""
    if wanted:
        if wanted not in columns:
            near = get_close_matches(wanted, columns, 1) or [c for c in columns if c.lower() == wanted.lower()]
            raise InputError(f"--{flag} {wanted!r} is not a column of the data. Columns: {columns}. "
                             + (f"Did you mean --{flag} {near[0]}?" if near else f"Pass --{flag} with one of them."))
        return wanted
    for name in guesses:
        if name in columns:
            return name
    # a guessed name in other letter case ('Text', 'LABEL'): the fix is knowable, and taking it unasked is not ours
    if near := [c for name in guesses for c in columns if c.strip().lower() == name]:
        raise InputError(f"Found no {what} column among {columns}; {near[0]!r} differs from {guesses[0]!r} only in "
                         f"case or spaces. Pass --{flag} {near[0]}.")
    pairs = " (sentence pairs such as GLUE's sentence1/sentence2: also --text_pair_column)" if what == "text" else ""
    if columns and all(" " in c or c.strip().lstrip("-").replace(".", "", 1).isdigit() or c in ("True", "False")
                       for c in columns[1:] + columns[:1]) and any(" " in c for c in columns):
        # the column names read like values: a file without a header row, whose first row became the names
        raise InputError(f"Found no {what} column among {columns}: these read like a row of data. If the file "
                         "has no header row, add one naming the columns (e.g. text,label) as its first line; else "
                         f"pass --{flag} naming the column.")
    raise InputError(f"Found no {what} column among {columns}. Pass --{flag} naming it{pairs}.")


def column_names(split: object) -> list[str]:
    return list(split.keys()) if isinstance(split, dict) else list(split.column_names)


# ---------------------------------------------------------------- tokenizers
SPECIAL_TOKENS = {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                  "mask_token": "[MASK]", "bos_token": "[BOS]", "eos_token": "[EOS]"}


def build_word_tokenizer(texts: list[str], task: str, vocab_size: int = 8000):
    """A word-level tokenizer trained on the training texts, for models built from a config (no download)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = list(SPECIAL_TOKENS.values())
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=specials))
    inputs = {}
    if task == "causal-lm":
        template = processors.TemplateProcessing(single="[BOS] $A [EOS]", special_tokens=[
            ("[BOS]", tok.token_to_id("[BOS]")), ("[EOS]", tok.token_to_id("[EOS]"))])
    else:  # a pair is [CLS] A [SEP] B [SEP], B in segment 1 (token_type_ids), as BERT's tokenizer makes it
        template = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                 special_tokens=[("[CLS]", tok.token_to_id("[CLS]")),
                                                                 ("[SEP]", tok.token_to_id("[SEP]"))])
        inputs["model_input_names"] = ["input_ids", "token_type_ids", "attention_mask"]
    tok.post_processor = template
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS, **inputs)


# ---------------------------------------------------------------- iterating
def endless_batches(accelerator, dataloader, start_batch: int = 0) -> Iterator[dict]:
    """Batches across epochs, starting after `start_batch` batches: the data position a checkpoint resumes from.

    The shuffle is seeded by (seed, epoch), so batch k is the same batch whether or not the run was interrupted.
    """
    per_epoch = len(dataloader)
    epoch, skip = divmod(start_batch, per_epoch)
    while True:
        dataloader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(dataloader, skip) if skip else dataloader
        yield from loader
        epoch, skip = epoch + 1, 0
