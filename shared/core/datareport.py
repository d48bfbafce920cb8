"""The data report: what the run will train on, printed on the main process before the first step and saved as
<output_dir>/data_report.json beside results.json (docs/data.md shows one for each task and for a user file).

It names the columns used for text, pair and label (or the class folders), the label set with its counts per split
and the label-to-id mapping, what was skipped and why, and one rendered example per split."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from .args import DECODER_TASKS

logger = logging.getLogger("recipes")
FILE = "data_report.json"


def build_report(task, args, source: str) -> dict:
    """The report of a built Task (its dataloaders' datasets, its tokenizer or processor, its model's labels)."""
    from . import data

    report: dict = {"task": task.name, "source": source, "columns": dict(task.columns)}
    if args.train_file and data.file_kind(args.train_file) == "csv":
        delimiter = data.csv_delimiter(args.train_file)
        report["delimiter"] = {"\t": "tab"}.get(delimiter, delimiter)
    id2label = getattr(task.model.config, "id2label", None) or {}
    splits = {"train": task.train_dataloader.dataset, "validation": task.eval_dataloader.dataset}
    report["examples"] = {name: len(ds) for name, ds in splits.items()}
    if task.name not in DECODER_TASKS:  # (a decoder's targets are its tokens: no label set)
        # Transformers' default names (LABEL_0 ...) stand for labels that were 0..K-1 in the data: shown as those.
        names = {int(i): str(n) if str(n) != f"LABEL_{i}" else str(i) for i, n in id2label.items()}
        report["label_to_id"] = {names.get(i, str(i)): i for i in sorted(names)} if names else {}
        report["label_counts"] = {name: _counts(ds, names) for name, ds in splits.items()}
    report["skipped"] = list(data.SKIPPED) + task.skipped
    report["example"] = {name: _render(task, ds) for name, ds in splits.items() if len(ds)}
    return report


def _labels(ds) -> list[int]:
    if hasattr(ds, "labels") and isinstance(ds.labels, list):  # ImageDataset
        return ds.labels
    return [int(x) for x in ds["labels"]]


def _counts(ds, names: dict[int, str]) -> dict[str, int]:
    counts = Counter(_labels(ds))
    return {names.get(i, str(i)): counts[i] for i in sorted(counts)}


def _render(task, ds) -> dict:
    """The first example as the model receives it: its tokens (the first 48), or what an image dataset shows of it
    (shared/tasks/images.py ImageDataset.report_example)."""
    if hasattr(ds, "report_example"):
        return ds.report_example(0)
    item = ds[0]
    ids = list(item["input_ids"])
    shown = {"tokens": task.tokenizer.convert_ids_to_tokens(ids[:48]), "length": len(ids)}
    if task.name not in DECODER_TASKS:
        shown["label_id"] = int(item["labels"])
    return shown


def emit(report: dict, accelerator, output_dir: str) -> None:
    """Print the report and write data_report.json, on the main process."""
    if not accelerator.is_main_process:
        return
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / FILE).write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"data: {report['source']} ({report['task']}); columns {report['columns']}"
             + (f", delimiter {report['delimiter']!r}" if "delimiter" in report else ""),
             f"  examples: {report['examples']}"]
    if report.get("label_to_id"):
        lines.append(f"  label_to_id: {report['label_to_id']}")
    for split, counts in report.get("label_counts", {}).items():
        lines.append(f"  {split} labels: {counts}")
    for item in report["skipped"]:
        lines.append(f"  skipped: {item}")
    for split, shown in report["example"].items():
        lines.append(f"  {split} example: {json.dumps(shown)[:300]}")
    logger.info("data report (%s):\n%s", FILE, "\n".join(lines))
