"""Data for the three families: built-in offline datasets, local files and folders, hub datasets, tokenizers."""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from . import datacheck
from .boundary import diagnose, loading
from .errors import InputError

# ---------------------------------------------------------------- built-in offline datasets (deterministic)
_POSITIVE = "great excellent superb wonderful delightful brilliant enjoyable charming moving fresh clever".split()
_NEGATIVE = "awful terrible boring dull dreadful poor painful mediocre bland clumsy tedious weak".split()
_NOUNS = "movie film plot acting script cast ending story music pacing dialogue camera".split()
_FILLER = "the a this that really quite very somewhat rather honestly overall frankly".split()
_ANIMALS = "cat dog bird fox horse mouse owl wolf".split()
_COLORS = "red green blue black white brown".split()
_PLACES = "garden house forest river field road".split()
_NUMBERS = "one two three four five six seven eight nine ten".split()


def sentiment_dataset(n: int, seed: int) -> dict[str, list]:
    """Short reviews; the label is the polarity held by most of the sentiment words (0 negative, 1 positive)."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        label = rng.randint(0, 1)
        major, minor = (_POSITIVE, _NEGATIVE) if label else (_NEGATIVE, _POSITIVE)
        words = [rng.choice(major) for _ in range(rng.randint(2, 3))]
        words += [rng.choice(minor) for _ in range(rng.randint(0, 1))]
        rng.shuffle(words)
        clauses = [f"{rng.choice(_FILLER)} {rng.choice(_NOUNS)} was {rng.choice(_FILLER)} {w}" for w in words]
        texts.append(" and ".join(clauses))
        labels.append(label)
    return {"text": texts, "label": labels}


def story_dataset(n: int, seed: int) -> dict[str, list]:
    """Lines of 1 to 4 templated sentences and counting runs: a causal LM's perplexity falls far below chance."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        sentences = []
        for _ in range(rng.randint(1, 4)):
            if rng.random() < 0.3:
                start = rng.randint(0, 5)
                sentences.append(" ".join(_NUMBERS[start:start + rng.randint(3, 5)]) + " .")
            else:
                sentences.append(f"the {rng.choice(_COLORS)} {rng.choice(_ANIMALS)} ran to the {rng.choice(_PLACES)} .")
        lines.append(" ".join(sentences))
    return {"text": lines}


def pattern_images(n: int, seed: int, image_size: int) -> dict[str, list]:
    """uint8 RGB images of 4 classes (horizontal, vertical, checkerboard, diagonal stripes), random colours, noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:image_size, 0:image_size]
    images, labels = [], []
    for _ in range(n):
        label = int(rng.integers(4))
        period = int(rng.choice([2, 4])) * max(1, image_size // 32)
        y, x = (yy + int(rng.integers(period))) // period, (xx + int(rng.integers(period))) // period
        d = (yy + xx + int(rng.integers(period))) // period
        mask = [y, x, y + x, d][label] % 2
        fg, bg = rng.integers(140, 256, 3), rng.integers(0, 110, 3)  # light stripes on a dark ground
        img = np.where(mask[..., None] == 1, fg, bg) + rng.normal(0, 20, (image_size, image_size, 3))
        images.append(np.clip(img, 0, 255).astype(np.uint8))
        labels.append(label)
    return {"image": images, "label": labels}


BUILTIN_SIZES = {"train": 2000, "validation": 400}


def builtin_split(task: str, split: str) -> dict[str, list]:
    """The built-in data: 2000 training and 400 validation examples, the same on every machine."""
    n, seed = BUILTIN_SIZES[split], {"train": 1, "validation": 2}[split]
    if task == "text-classification":
        return sentiment_dataset(n, seed)
    if task == "causal-lm":
        return story_dataset(n, seed)
    return pattern_images(n, seed, image_size=32)  # resized to the model's size on the fly


# ---------------------------------------------------------------- user data: files, folders, hub
_TEXT_GUESSES = ("text", "sentence", "content", "review", "document")
_IMAGE_GUESSES = ("image", "img", "pixel_values", "picture")
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
    """Train and validation splits (HF Datasets, or dicts of lists for the built-in data and image folders) and where
    they came from; validation is None when the source has none (hold_out makes one)."""
    import datasets

    SKIPPED.clear()
    if args.train_dir:
        with loading("image folder", "--train_dir", args.train_dir):
            train = image_folder(args.train_dir)
        with loading("image folder", "--validation_dir", args.validation_dir):
            val = image_folder(args.validation_dir, classes=train["classes"]) if args.validation_dir else None
        source = f"image folder {args.train_dir}"
    elif args.train_file:
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
    if isinstance(train, dict):  # image folder
        datacheck.check_can_hold_out(len(train["label"]), source)
        return _split_dict(train)
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


def _split_dict(d: dict[str, list]) -> tuple[dict, dict]:
    n = len(d["label"])
    order = random.Random(0).sample(range(n), n)
    cut = max(1, n // 10)
    pick = lambda idx: {"image": [d["image"][i] for i in idx], "label": [d["label"][i] for i in idx],  # noqa: E731
                        "classes": d["classes"]}
    return pick(order[cut:]), pick(order[:cut])


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")
_JUNK = ("Thumbs.db", "desktop.ini")  # what file managers leave beside images
SKIPPED: list[str] = []  # what the last load_raw_splits left out, and why: the data report shows it


def image_folder(root: str, classes: list[str] | None = None) -> dict[str, list]:
    """Paths and labels from root/<class>/<image>; classes sorted by name, as torchvision's ImageFolder does.
    Hidden folders (.ipynb_checkpoints) are not classes; a subfolder inside a class, or a file of a type no loader
    reads, is refused: its images would be skipped without a word."""
    root_path = Path(root)
    if not root_path.is_dir():
        raise InputError(f"{root!r} is a file; an image folder is expected ({root_path.parent}/<class>/<image>). "
                         "Pass the folder that holds the class subfolders.")
    entries = sorted(root_path.iterdir())
    found = [p.name for p in entries if p.is_dir() and not p.name.startswith(".")]
    SKIPPED.extend(f"{p} (hidden folder, not a class)" for p in entries if p.is_dir() and p.name.startswith("."))
    SKIPPED.extend(f"{p} (a file beside the class folders)" for p in entries if p.is_file())
    if not found:
        raise InputError(f"{root!r} holds no class subfolders. Lay images out as {root}/<class_name>/<image>.png.")
    classes = classes or found
    unknown = set(found) - set(classes)
    if unknown:
        raise InputError(f"{root!r} has classes {sorted(unknown)} that the training folder lacks.")
    paths, labels, nested, other = [], [], [], []
    for label, name in enumerate(classes):
        for p in sorted((root_path / name).glob("*")):
            if p.name.startswith(".") or p.name in _JUNK:
                SKIPPED.append(f"{p} (hidden or file-manager file)")
            elif p.is_dir():
                nested.append(p)
            elif p.suffix.lower() in IMAGE_SUFFIXES:
                paths.append(str(p))
                labels.append(label)
            else:
                other.append(p)
    if nested:
        raise InputError(f"{root!r}: class folders hold subfolders ({', '.join(map(str, nested[:5]))}), whose images "
                         "would not train. Move their images up into the class folder, or, if the subfolders are "
                         f"the classes, pass --train_dir {str(nested[0].parent)!r}.")
    if other:
        raise InputError(f"{root!r}: {len(other)} file(s) of a type no loader reads would be skipped "
                         f"({', '.join(map(str, other[:5]))}). Convert them to {', '.join(IMAGE_SUFFIXES[:3])} ..., or "
                         "move them out of the class folders.")
    if not paths:
        raise InputError(f"{root!r} holds no images ({', '.join(s.lstrip('.') for s in IMAGE_SUFFIXES)}).")
    return {"image": paths, "label": labels, "classes": classes}


def pick_column(columns: list[str], wanted: str | None, guesses: tuple[str, ...], what: str, flag: str) -> str:
    """The named column, or the first common name present; a clear error naming the columns that exist."""
    if wanted:
        if wanted not in columns:
            raise InputError(f"--{flag} {wanted!r} is not a column of the data. Columns: {columns}. "
                             f"Pass --{flag} with one of them.")
        return wanted
    for name in guesses:
        if name in columns:
            return name
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


# ---------------------------------------------------------------- images to tensors
RESAMPLE = 3  # PIL's BICUBIC (Image.resize's default): the dataset and the saved image processor resize alike


def image_processor(size: int, mean: list[float], std: list[float]):
    """A ViT image processor that does what ImageDataset does: resize to size x size, scale to [0, 1], normalize."""
    import importlib.util

    import transformers

    # Transformers 5 builds ViTImageProcessor on torchvision; the PIL one is the same processing without it.
    cls = (transformers.ViTImageProcessor if importlib.util.find_spec("torchvision")
           else transformers.ViTImageProcessorPil)
    return cls(do_resize=True, size={"height": size, "width": size}, resample=RESAMPLE, do_rescale=True,
               rescale_factor=1 / 255, do_normalize=True, image_mean=mean, image_std=std)


class ImageDataset(torch.utils.data.Dataset):
    """uint8 arrays or image paths -> normalized pixel_values at the model's size."""

    def __init__(self, images: list, labels: list[int], image_size: int, mean: list[float], std: list[float]):
        self.images, self.labels, self.size = images, labels, image_size
        self.mean = torch.tensor(mean).view(3, 1, 1)
        self.std = torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        img = self.images[i]
        if not isinstance(img, np.ndarray):
            from PIL import Image

            with loading("image", None, img if isinstance(img, str) else "an image of the dataset"):
                pil = img if isinstance(img, Image.Image) else Image.open(img)
                if pil.mode.startswith("I;16"):  # 16-bit grey: convert("RGB") clips at 255 (nearly all white)
                    pil = Image.fromarray((np.asarray(pil) / 257).round().astype(np.uint8))  # 65535 -> 255
                img = np.asarray(pil.convert("RGB").resize((self.size, self.size), RESAMPLE))
        elif img.shape[0] != self.size:
            from PIL import Image

            img = np.asarray(Image.fromarray(img).resize((self.size, self.size), RESAMPLE))
        x = torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255.0  # np.array: a writable copy
        return {"pixel_values": (x - self.mean) / self.std, "labels": torch.tensor(self.labels[i])}


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
