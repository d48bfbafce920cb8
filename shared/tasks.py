"""A task bundles what differs between the families: model, data, loss and metric. Recipes never branch on it."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from . import data, models


@dataclass
class Task:
    name: str
    model: nn.Module
    model_id: str
    train_dataloader: DataLoader
    eval_dataloader: DataLoader
    data_source: str
    tokenizer: object | None = None
    extra_files: dict[str, object] = field(default_factory=dict)

    # ---- loss: a sum over items divided by a count, so accumulation can normalize over the whole global batch
    def count_items(self, batch: dict) -> torch.Tensor:
        """What the loss averages over: target tokens for a causal LM, samples for classification."""
        if self.name == "causal-lm":
            return (batch["labels"][:, 1:] != -100).sum()
        return torch.tensor(batch["labels"].numel(), device=batch["labels"].device)

    def loss(self, model: nn.Module, batch: dict, num_items: torch.Tensor | float | None = None) -> torch.Tensor:
        """Summed cross-entropy over the batch divided by `num_items` (default: this batch's own count)."""
        labels = batch["labels"]
        logits = model(**self._inputs(batch)).logits.float()
        if self.name == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100,
                                reduction="sum")
        return total / (self.count_items(batch) if num_items is None else num_items)

    def _inputs(self, batch: dict) -> dict:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        if self.name == "causal-lm":
            # A KV cache only serves generation; in training it costs memory, and a checkpointed block that is
            # recomputed in backward would append to it a second time.
            inputs["use_cache"] = False
        return inputs

    def tokens_in(self, batch: dict) -> int:
        """Positions the model processed (non-padding tokens; patches + [CLS] for images), for throughput."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        if "input_ids" in batch:
            return batch["input_ids"].numel()
        cfg = self.model.config
        return batch["pixel_values"].shape[0] * ((cfg.image_size // cfg.patch_size) ** 2 + 1)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, eval_dataloader: DataLoader, accelerator) -> dict[str, float]:
        """Accuracy for classification; token-weighted loss and perplexity for a causal LM. Over all processes."""
        was_training = model.training
        model.eval()
        sums, counts = [], []
        for batch in eval_dataloader:
            labels = batch["labels"]
            logits = model(**self._inputs(batch)).logits.float()
            if self.name == "causal-lm":
                logits, labels = logits[:, :-1], labels[:, 1:]
                per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
                value, count = per_token.sum(dim=1), (labels != -100).sum(dim=1)
            else:
                value, count = (logits.argmax(-1) == labels).float(), torch.ones_like(labels)
            # gather_for_metrics drops the samples duplicated to even out the last batch across processes
            value, count = accelerator.gather_for_metrics((value, count))
            sums.append(value.sum().item())
            counts.append(count.sum().item())
        model.train(was_training)
        mean = sum(sums) / max(1, sum(counts))
        if self.name == "causal-lm":
            return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0))}
        return {"eval_accuracy": mean}

    def save_preprocessing(self, output_dir: str) -> None:
        """What a user needs beside the weights to run the model: the tokenizer."""
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(output_dir)


def load_task(args: argparse.Namespace, accelerator) -> Task:
    """Data, tokenizer and model for args.task. Bad input fails here, before any training step."""
    data.check_paths(args)
    models.check_model_path(args.model_name_or_path)
    with accelerator.main_process_first():  # the first process fills the datasets cache, the others reuse it
        train_raw, val_raw, source = data.load_raw_splits(args)
    loader = {"text-classification": _text_classification, "causal-lm": _causal_lm,
              "image-classification": _image_classification}[args.task]
    task = loader(args, accelerator, train_raw, val_raw, source)
    n_train = len(task.train_dataloader.dataset)
    if n_train == 0:
        raise SystemExit(f"The training data ({source}) has no usable examples. Check the file and the columns.")
    global_batch = args.per_device_train_batch_size * accelerator.num_processes
    if global_batch > n_train:
        raise SystemExit(f"The global batch ({args.per_device_train_batch_size} per device x "
                         f"{accelerator.num_processes} processes = {global_batch}) is larger than the training set "
                         f"({n_train} examples). Lower --per_device_train_batch_size or add data.")
    return task


def _limit(split: object, n: int | None) -> object:
    if n is None:
        return split
    if isinstance(split, dict):
        return {k: (v[:n] if isinstance(v, list) and k != "classes" else v) for k, v in split.items()}
    return split.select(range(min(n, len(split))))


def _to_dataset(split: object):
    import datasets

    return split if isinstance(split, datasets.Dataset) else datasets.Dataset.from_dict(split)


def _dataloaders(args, train_ds, eval_ds, collate) -> tuple[DataLoader, DataLoader]:
    # A generator of its own: each new epoch iterator then draws its seed from it, not from the global RNG that
    # dropout uses, so a resumed run sees the same dropout masks as an uninterrupted one.
    train = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, shuffle=True, collate_fn=collate,
                       generator=torch.Generator().manual_seed(args.seed))
    evaluation = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, collate_fn=collate)
    return train, evaluation


def _tokenizer(args, texts: list[str]):
    name = args.tokenizer_name or args.model_name_or_path
    if name is None:
        return data.build_word_tokenizer(texts, args.task)
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    except OSError as err:
        raise models.unreachable(name, err) from None
    if tok.pad_token is None:  # GPT-2 style tokenizers have none; padding is masked out of the loss anyway
        tok.pad_token = tok.eos_token
    return tok


def _label_mapping(train_labels: list, val_labels: list) -> tuple[list, dict]:
    """Integer labels stay as they are; string labels are numbered in sorted order."""
    if all(isinstance(v, (int, bool)) for v in train_labels):
        return sorted(set(train_labels) | set(val_labels)), {}
    names = sorted({str(v) for v in train_labels} | {str(v) for v in val_labels})
    return names, {n: i for i, n in enumerate(names)}


def _text_classification(args, accelerator, train_raw, val_raw, source) -> Task:
    cols = data.column_names(train_raw)
    text_col = data.pick_column(cols, args.text_column, data._TEXT_GUESSES, "text", "text_column")
    label_col = data.pick_column(cols, args.label_column, data._LABEL_GUESSES, "label", "label_column")
    train_raw, val_raw = _limit(train_raw, args.max_train_samples), _limit(val_raw, args.max_eval_samples)
    train_ds, val_ds = _to_dataset(train_raw), _to_dataset(val_raw)
    labels, mapping = _label_mapping(list(train_ds[label_col]), list(val_ds[label_col]))
    num_labels = len(mapping) if mapping else int(max(labels)) + 1
    tokenizer = _tokenizer(args, list(train_ds[text_col]))

    def encode(batch):
        enc = tokenizer(batch[text_col], truncation=True, max_length=args.max_seq_length)
        enc["labels"] = [mapping[str(v)] if mapping else int(v) for v in batch[label_col]]
        return enc

    with accelerator.main_process_first():
        train_ds, val_ds = (ds.map(encode, batched=True, remove_columns=ds.column_names) for ds in (train_ds, val_ds))
    from transformers import DataCollatorWithPadding

    if args.model_name_or_path:
        extra = {"id2label": {i: n for i, n in enumerate(mapping)}} if mapping else {}
        config = models.load_pretrained_config(args, num_labels=num_labels, **extra)
    else:
        config = models.preset_config(args.task, args.model_preset, vocab_size=_vocab(tokenizer, args),
                                      num_labels=num_labels, pad_token_id=tokenizer.pad_token_id)
        if mapping:
            config.id2label = dict(enumerate(mapping))
    model = models.build_model(args, config)
    train_dl, eval_dl = _dataloaders(args, train_ds, val_ds, DataCollatorWithPadding(tokenizer))
    return Task(args.task, model, models.model_source(args), train_dl, eval_dl, source, tokenizer)


def _vocab(tokenizer, args) -> int:
    """The tiny preset sizes its embedding to the local tokenizer; base keeps the real model's vocabulary."""
    return len(tokenizer) if args.model_preset == "tiny" else max(len(tokenizer), 30522)


class CausalCollator:
    """Pads a batch; padding is masked out of the labels (-100) so it never counts as a target token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer.pad(features, return_tensors="pt")
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return dict(batch)


def _causal_lm(args, accelerator, train_raw, val_raw, source) -> Task:
    cols = data.column_names(train_raw)
    text_col = data.pick_column(cols, args.text_column, data._TEXT_GUESSES, "text", "text_column")
    train_ds, val_ds = _to_dataset(train_raw), _to_dataset(val_raw)
    # Blank lines (wikitext has many) hold no target token.
    train_ds, val_ds = (ds.filter(lambda b: [bool(t and t.strip()) for t in b[text_col]], batched=True)
                        for ds in (train_ds, val_ds))
    train_ds, val_ds = _limit(train_ds, args.max_train_samples), _limit(val_ds, args.max_eval_samples)
    tokenizer = _tokenizer(args, list(train_ds[text_col]))

    def encode(batch):
        return tokenizer(batch[text_col], truncation=True, max_length=args.max_seq_length)

    with accelerator.main_process_first():
        train_ds, val_ds = (ds.map(encode, batched=True, remove_columns=ds.column_names) for ds in (train_ds, val_ds))
    if args.model_name_or_path:
        config = models.load_pretrained_config(args)
    else:
        config = models.preset_config(args.task, args.model_preset, vocab_size=_vocab(tokenizer, args),
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    positions = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    if positions and args.max_seq_length > positions:
        raise SystemExit(f"--max_seq_length {args.max_seq_length} exceeds the model's {positions} positions. "
                         f"Pass --max_seq_length {positions} or less.")
    model = models.build_model(args, config)
    train_dl, eval_dl = _dataloaders(args, train_ds, val_ds, CausalCollator(tokenizer))
    return Task(args.task, model, models.model_source(args), train_dl, eval_dl, source, tokenizer)


def _image_classification(args, accelerator, train_raw, val_raw, source) -> Task:
    cols = [c for c in data.column_names(train_raw) if c != "classes"]
    image_col = data.pick_column(cols, args.image_column, data._IMAGE_GUESSES, "image", "image_column")
    label_col = data.pick_column(cols, args.label_column, data._LABEL_GUESSES, "label", "label_column")
    train_raw, val_raw = _limit(train_raw, args.max_train_samples), _limit(val_raw, args.max_eval_samples)
    train_labels, val_labels = list(train_raw[label_col]), list(val_raw[label_col])
    names = train_raw.get("classes") if isinstance(train_raw, dict) else None
    labels, mapping = _label_mapping(train_labels, val_labels)
    names = names or (list(mapping) if mapping else None)
    num_labels = len(names) if names else int(max(labels)) + 1
    to_id = (lambda v: mapping[str(v)]) if mapping else int  # noqa: E731
    mean, std = [0.5] * 3, [0.5] * 3
    if args.model_name_or_path:
        extra = {"id2label": dict(enumerate(names))} if names else {}
        config = models.load_pretrained_config(args, num_labels=num_labels, **extra)
        mean, std = _processor_stats(args, mean, std)
    else:
        config = models.preset_config(args.task, args.model_preset, num_labels=num_labels)
        if names:
            config.id2label = dict(enumerate(names))
    size = config.image_size
    train_ds = data.ImageDataset(list(train_raw[image_col]), [to_id(v) for v in train_labels], size, mean, std)
    val_ds = data.ImageDataset(list(val_raw[image_col]), [to_id(v) for v in val_labels], size, mean, std)
    model = models.build_model(args, config)
    train_dl, eval_dl = _dataloaders(args, train_ds, val_ds, None)
    return Task(args.task, model, models.model_source(args), train_dl, eval_dl, source)


def _processor_stats(args, mean: list[float], std: list[float]) -> tuple[list[float], list[float]]:
    """The pretrained model's normalization, when it ships an image processor config."""
    try:
        from transformers import AutoImageProcessor

        proc = AutoImageProcessor.from_pretrained(args.model_name_or_path, use_fast=False)
        return list(proc.image_mean), list(proc.image_std)
    except (OSError, ValueError, AttributeError):
        return mean, std
