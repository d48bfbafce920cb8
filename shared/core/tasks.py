"""A task bundles what differs between the families: model, data, loss and metric. Recipes never branch on it.

Each task is one module of shared/tasks/ (text_classification.py, causal_lm.py, image_classification.py), loaded
by name, so a copied recipe carries only the task modules it was copied with. What you change first (the model, the
columns, the loss, the metrics) is there; this module holds what every task shares."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.utils.data import DataLoader

from . import data, datareport, losses, models, rules
from .args import task_module
from .boundary import loading
from .errors import InputError

if TYPE_CHECKING:
    from .launch import Launch

logger = logging.getLogger("recipes")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model",
                    "spiece.model", "sentencepiece.bpe.model")
NO_EXAMPLES = "The training data ({source}) has no usable examples. Check the file and the columns."


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
    packing: str = "none"  # causal LM: how documents became samples (shared/tasks/packing.py)
    stats: dict[str, object] = field(default_factory=dict)  # what the training data holds, for results.json
    router_aux_loss: torch.Tensor | None = None  # a mixture of experts: the last batch's load-balancing loss
    # Your own columns and loss (docs/adapting_a_copy.md): load_task(keep_columns=) keeps data columns in each batch,
    # never passed to the model; loss_fn(logits, labels, kept) -> a summed loss, count_fn(labels, kept) -> what it
    # is divided by (unset: the task's summed cross-entropy, and count_items' tokens or samples).
    keep_columns: tuple[str, ...] = ()
    loss_fn: Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor] | None = None
    count_fn: Callable[[torch.Tensor, dict], torch.Tensor] | None = None
    # Your own evaluation metrics (classification): compute_metrics(predictions, labels) -> {name: value}, over the
    # whole validation set (gathered over processes); each name is reported as eval_<name> in results.json. Unset:
    # accuracy. With loss_fn set, evaluation also reports eval_loss, the mean of your loss over the validation set.
    compute_metrics: Callable[[torch.Tensor, torch.Tensor], dict[str, float]] | None = None
    inputs_fn: Callable[[dict], dict] | None = None  # the task module's change to the model's inputs (causal_lm.py)
    # The data report (shared/core/datareport.py): the columns (or folders) used for each role, what was skipped.
    columns: dict[str, str] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    report: dict = field(default_factory=dict)
    output_dir: str = ""  # the run's (load_task sets it): where a task writes what it makes beside results.json

    def refuse_hooks(self, hooks: tuple[str, ...], why: str) -> None:
        """A recipe that computes its loss or metrics its own way refuses the user's hooks it cannot honour."""
        if given := [h for h in hooks if getattr(self, h)]:
            raise InputError(f"Task.{' / '.join(given)}: {why} (docs/adapting_a_copy.md).")

    def kept(self, batch: dict) -> dict:
        return {k: batch[k] for k in self.keep_columns}

    # ---- loss: a sum over items divided by a count, so accumulation can normalize over the whole global batch
    def count_items(self, batch: dict) -> torch.Tensor:
        """What the loss averages over: target tokens for a causal LM, samples for classification."""
        if self.count_fn is not None:
            return self.count_fn(batch["labels"], self.kept(batch))
        return losses.count_items(self.name, batch["labels"])

    def loss(self, model: nn.Module, batch: dict, num_items: torch.Tensor | float | None = None) -> torch.Tensor:
        """Summed cross-entropy over the batch divided by `num_items` (default: this batch's own count). A mixture
        of experts adds its router's load-balancing loss (router_aux_loss_coef x aux_loss), weighted by this batch's
        share of the items, so accumulated or data-parallel batches add up to one global batch's."""
        out = model(**self._inputs(batch))
        count = self.count_items(batch)
        summed = (self.loss_fn(out.logits, batch["labels"], self.kept(batch)) if self.loss_fn is not None
                  else losses.summed_loss(self.name)(out.logits, batch["labels"]))
        total = summed / (count if num_items is None else num_items)
        return total + self.router_loss(out, count, num_items)

    def router_loss(self, out: object, count: torch.Tensor, num_items: torch.Tensor | float | None
                    ) -> torch.Tensor | float:
        """router_aux_loss_coef x the model output's aux_loss, x this batch's share (count of num_items) of the
        items; 0 for a model without one. Also for losses computed outside Task.loss (chunked, sequence parallel)."""
        aux = getattr(out, "aux_loss", None)  # set when the config has output_router_logits (tiny-moe does)
        if aux is None:
            return 0.0
        self.router_aux_loss = aux.detach()  # the meter reports it (shared/core/meter.py)
        return self.model.config.router_aux_loss_coef * aux * (1.0 if num_items is None else count / num_items)

    def user_loss(self, logits: torch.Tensor, labels: torch.Tensor, batch: dict, accelerator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """One validation batch's loss_fn sum and what it is divided by (count_fn, or count_items), as in training;
        gathered per batch, not per sample, so the samples that even out the last batch count too."""
        value, count = self.loss_fn(logits, labels, self.kept(batch)).reshape(1), self.count_items(batch)
        return accelerator.gather((value, count.reshape(1).to(value.device)))

    def _inputs(self, batch: dict) -> dict:
        inputs = {k: v for k, v in batch.items() if k != "labels" and k not in self.keep_columns}
        return self.inputs_fn(inputs) if self.inputs_fn is not None else inputs

    def tokens_in(self, batch: dict) -> torch.Tensor | int:
        """Positions the model processed (non-padding tokens; images: image_classification.py), for throughput. A
        tensor where it is counted on the device: read on the host it would block every step (shared/core/meter.py)."""
        return batch["attention_mask"].sum() if "attention_mask" in batch else batch["input_ids"].numel()

    @torch.no_grad()
    def evaluate(self, model: nn.Module, eval_dataloader: DataLoader, accelerator) -> dict[str, float]:
        """Accuracy (or compute_metrics) over all processes, and with loss_fn set the mean of it (a causal LM's:
        causal_lm.py CausalLMTask)."""
        was_training = model.training
        model.eval()
        sums, counts, predictions, targets = [], [], [], []
        for batch in eval_dataloader:
            labels = batch["labels"]
            logits = model(**self._inputs(batch)).logits.float()
            if self.loss_fn is not None:
                value, count = self.user_loss(logits, labels, batch, accelerator)
                sums.append(value.sum().item())
                counts.append(count.sum().item())
            predicted, labels = accelerator.gather_for_metrics((logits.argmax(-1), labels))
            predictions.append(predicted.cpu())
            targets.append(labels.cpu())
        model.train(was_training)
        out = {"eval_loss": sum(sums) / max(1, sum(counts))} if self.loss_fn is not None else {}
        predicted, labels = torch.cat(predictions), torch.cat(targets)
        if self.compute_metrics is None:
            return {**out, "eval_accuracy": (predicted == labels).float().sum().item() / max(1, labels.numel())}
        return {**out, **{f"eval_{k}": float(v) for k, v in self.compute_metrics(predicted, labels).items()}}

    def save_preprocessing(self, output_dir: str) -> None:
        """What a user needs beside the weights to run the model: the tokenizer (the image processor: ImageTask)."""
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(output_dir)


def load_task(launch: Launch, accelerator, eval_batch_size: int | None = None, keep_columns: tuple[str, ...] = ()
              ) -> Task:
    """Data, tokenizer and model for --task. Bad input fails here, before any training step. `eval_batch_size`:
    the evaluation batch, where a recipe needs another than --per_device_eval_batch_size. `keep_columns`: data
    columns kept in each batch for Task.loss_fn (text tasks, one row a sample: not packed causal-LM blocks)."""
    args = launch.args
    module = task_module(args.task, launch.recipe)  # a copy that lacks it is refused before any work
    batches = (launch.per_device_train_batch_size, eval_batch_size or args.per_device_eval_batch_size)
    data.check_paths(args)
    models.check_model_path(args.model_name_or_path)
    # The model must serve the task, and its position embeddings the sequence length: checked before the data is
    # read and tokenized (the preset's positions are those of the model built later).
    config = models.model_config(args)
    models.check_positions(config, args.max_seq_length)
    models.check_router(config, models.model_source(args))
    # A mixture of experts whose task class drops its router loss: refused by the rule table, before the data is read
    rules.check_built(launch.recipe, task=args.task, no_router_loss=models.router_loss_missing(config, args.task))
    models.check_weights_dtype(args, config, launch.mixed_precision, accelerator.is_main_process)
    with accelerator.main_process_first():  # the first process fills the datasets cache, the others reuse it
        # A task module may bring its own built-in data (sft.py's): else data.py's, files or the hub
        train_raw, val_raw, source = getattr(module, "load_raw_splits", data.load_raw_splits)(args)
    if missing := [c for c in keep_columns if c not in data.column_names(train_raw)]:
        raise InputError(f"keep_columns: the training data has no column {missing} ({data.column_names(train_raw)}).")
    if keep_columns and (args.task in ("image-classification", "sft") or args.task == "causal-lm"
                         and args.packing != "none"):
        raise InputError("keep_columns serves text-classification, and causal-lm with --packing none (a packed block "
                         f"holds parts of many rows), not --task {args.task} --packing {args.packing}.")
    task = module.build(args, accelerator, train_raw, val_raw, source, batches, tuple(keep_columns))
    if fsdp := launch.run.support.fsdp:  # under FSDP: one unit per block (shared/techniques/fsdp_launch.py)
        fsdp.wrap_blocks(accelerator, task.model, models.transformer_layers)
    task.output_dir = launch.output_dir
    n_train = len(task.train_dataloader.dataset)
    packed = task.packing != "none"
    if n_train == 0:
        raise InputError(NO_EXAMPLES.format(source=source))
    if len(task.eval_dataloader.dataset) == 0:  # evaluation of nothing: a loss of 0 and a perplexity of 1, reported
        where = args.validation_file or args.validation_dir or "held out from the training data"
        raise InputError(f"The validation data ({where}) has no sample left to evaluate: every row was dropped (a "
                         f"prompt that alone fills --max_seq_length {args.max_seq_length}, or text shorter than one "
                         "block), and the run would report the evaluation of nothing (a loss of 0). Raise "
                         "--max_seq_length, or pass a --validation_file with rows that fit.")
    check_vocabulary(task, args)
    task.report = datareport.build_report(task, args, source)
    datareport.emit(task.report, accelerator, launch.output_dir)  # printed and saved before the first step
    global_batch = batches[0] * accelerator.num_processes
    if global_batch > n_train:
        what = f"{n_train} blocks of {args.max_seq_length} tokens" if packed else f"{n_train} examples"
        raise InputError(f"The global batch ({batches[0]} per device x "
                         f"{accelerator.num_processes} processes = {global_batch}) is larger than the training set "
                         f"({what}). Lower --per_device_train_batch_size{' or --max_seq_length' if packed else ''} "
                         "or add data.")
    return task


def check_vocabulary(task: Task, args) -> None:
    """A tokenizer whose ids run past the model's embedding rows fails mid-run (an index error) or, for a tokenizer of
    another model, trains rows that meant other tokens: refused before the first step."""
    if task.tokenizer is None:
        return
    rows = task.model.get_input_embeddings().num_embeddings
    if len(task.tokenizer) > rows:
        source = f"--tokenizer_name {args.tokenizer_name!r}" if args.tokenizer_name else "the tokenizer"
        raise InputError(f"{source} has {len(task.tokenizer)} tokens, and the model "
                         f"({models.model_source(args)}) embeds {rows}: the ids past {rows - 1} have no row. Pass the "
                         "model's own tokenizer (drop --tokenizer_name), or resize the model's embeddings "
                         "(model.resize_token_embeddings) and save it.")


def given_splits(train: object, val: object | None) -> list[tuple[str, object]]:
    """The splits as the source holds them (before any hold-out), so that checks name the source's own rows."""
    return [("training", train)] + ([("validation", val)] if val is not None else [])


def limit(split: object, n: int | None) -> object:
    if n is None:
        return split
    if isinstance(split, dict):
        return {k: (v[:n] if isinstance(v, list) and k != "classes" else v) for k, v in split.items()}
    return split.select(range(min(n, len(split))))


def to_dataset(split: object):
    import datasets

    return split if isinstance(split, datasets.Dataset) else datasets.Dataset.from_dict(split)


def preset_vocab(tokenizer, args) -> int:
    """The tiny presets size their embedding to the local tokenizer; base keeps the real model's vocabulary."""
    return len(tokenizer) if args.model_preset.startswith("tiny") else max(len(tokenizer), 30522)


def dataloaders(args, accelerator, train_ds, eval_ds, collate, batches: tuple[int, int]
                 ) -> tuple[DataLoader, DataLoader]:
    # Workers only load and collate: the order comes from the sampler in the main process, so a resumed run sees
    # the same batches with any number of them. Pinned memory speeds host-to-GPU copies and is pointless elsewhere.
    workers = args.dataloader_num_workers
    loading = dict(num_workers=workers, pin_memory=accelerator.device.type == "cuda",
                   persistent_workers=workers > 0)  # not respawned at every epoch of endless_batches
    # A generator of its own: each new epoch iterator then draws its seed from it, not from the global RNG that
    # dropout uses, so a resumed run sees the same dropout masks as an uninterrupted one.
    train = DataLoader(train_ds, batch_size=batches[0], shuffle=True, collate_fn=collate,
                       generator=torch.Generator().manual_seed(args.seed), **loading)
    evaluation = DataLoader(eval_ds, batch_size=batches[1], collate_fn=collate, **loading)
    return train, evaluation


def tokenizer_for(args, texts: list[str]):
    """--tokenizer_name or the model's own tokenizer; a word-level one trained on `texts` for a preset."""
    name = args.tokenizer_name or args.model_name_or_path
    if name is None:
        return data.build_word_tokenizer(texts, args.task)
    from transformers import AutoTokenizer

    if Path(name).is_dir() and not any((Path(name) / f).exists() for f in _TOKENIZER_FILES):
        # Transformers would guess a tokenizer class from config.json and ask for its dependencies (sentencepiece).
        flag = "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path"
        raise InputError(f"{flag} {name!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])} ...). Pass "
                         "--tokenizer_name with the tokenizer's directory or hub id (the checkpoint the model came "
                         "from), or save it there with tokenizer.save_pretrained(dir).")
    with loading("tokenizer", "--tokenizer_name" if args.tokenizer_name else "--model_name_or_path", name):
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=args.trust_remote_code)
    if Path(name).is_dir() and not (Path(name) / "tokenizer_config.json").exists() and not tok.all_special_tokens:
        # tokenizer.json holds the vocabulary; which token is eos, bos or pad is tokenizer_config.json's to say
        raise InputError(f"{'--tokenizer_name' if args.tokenizer_name else '--model_name_or_path'} {name!r}: the "
                         "tokenizer loads without special tokens (no eos, bos or pad: documents would run together "
                         "and no answer could end), because the folder has no tokenizer_config.json. Copy "
                         "tokenizer_config.json (and special_tokens_map.json) from where the model came from, or pass "
                         "--tokenizer_name with the whole tokenizer.")
    if tok.pad_token is None:  # GPT-2 style tokenizers have none; padding is masked out of the loss anyway
        tok.pad_token = tok.eos_token
    return tok
