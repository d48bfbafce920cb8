"""Causal language modelling (GPT-2, Llama-style decoders, mixtures of experts): what you change first is here.

- the data: the text column, packing (--packing concat | per_document | none, shared/tasks/packing.py), in `build`;
- the model: a hub id or local directory, or a preset, in `build`;
- the loss: next-token cross-entropy summed over the target tokens (shared/core/losses.py), or your own;
- the metrics: the token-weighted loss and perplexity over the validation set (CausalLMTask.evaluate).
"""

from __future__ import annotations

import logging
import math
import random

import torch
import torch.nn.functional as F

from ..core import data, datacheck, datastats, models
from ..core.errors import InputError
from ..core.tasks import NO_EXAMPLES, Task, dataloaders, given_splits, limit, preset_vocab, to_dataset, tokenizer_for
from . import decoder_presets, packing  # noqa: F401  (decoder_presets: copied with the task, loaded by name)
from .packing import add_args  # noqa: F401  (--packing: shared/core/args.py adds the chosen task's flags)

logger = logging.getLogger("recipes")


# Your own loss: def loss_fn(logits, labels, kept) -> the batch's summed next-token loss, which the loop divides by the
# global batch's items (`kept`: the columns load_task(keep_columns=) kept). None: the task's summed cross-entropy
# (shared/core/losses.py). chunked_loss and sequence_parallel, which compute the loss their own way, refuse
# one; the pipeline recipes train with it. docs/adapting_a_copy.md: class weights.
loss_fn = None


# The built-in data (data.builtin_split): templated stories and counting runs.
_ANIMALS = "cat dog bird fox horse mouse owl wolf".split()
_COLORS = "red green blue black white brown".split()
_PLACES = "garden house forest river field road".split()
_NUMBERS = "one two three four five six seven eight nine ten".split()


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


builtin_data = story_dataset


def model_inputs(packing_mode: str, model) -> callable:
    """The batch as the model takes it: no KV cache (it only serves generation; in training it costs memory, and a
    checkpointed block recomputed in backward would append to it twice); per-document packing's position ids."""
    def inputs(batch: dict) -> dict:
        batch = {**batch, "use_cache": False}
        if packing_mode == "per_document":
            batch = packing.per_document_inputs(batch, model.config._attn_implementation, model.config)
        return batch
    return inputs


class CausalLMTask(Task):
    """A causal LM's evaluation: the token-weighted next-token loss and its perplexity (or the mean of loss_fn)."""

    @torch.no_grad()
    def evaluate(self, model, eval_dataloader, accelerator) -> dict[str, float]:
        was_training = model.training
        model.eval()
        sums, counts = [], []
        for batch in eval_dataloader:
            labels = batch["labels"]
            logits = model(**self._inputs(batch)).logits.float()
            if self.loss_fn is not None:  # the user's loss, divided as in training
                value, count = self.user_loss(logits, labels, batch, accelerator)
            else:
                logits, labels = logits[:, :-1], labels[:, 1:]
                per_token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
                # gather_for_metrics drops the samples duplicated to even out the last batch across processes
                value, count = accelerator.gather_for_metrics((per_token.sum(dim=1), (labels != -100).sum(dim=1)))
            sums.append(value.sum().item())
            counts.append(count.sum().item())
        model.train(was_training)
        mean = sum(sums) / max(1, sum(counts))
        return {"eval_loss": mean, "eval_perplexity": math.exp(min(mean, 50.0))}


class CausalCollator:
    """Pads a batch; padding is masked out of the labels (-100) so it never counts as a target token."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.tokenizer.pad(features, return_tensors="pt")
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return dict(batch)



def build(args, accelerator, train_raw, val_raw, source, batches: tuple[int, int], keep: tuple[str, ...] = ()
          ) -> Task:
    cols = data.column_names(train_raw)
    text_col = data.pick_column(cols, args.text_column, data._TEXT_GUESSES, "text", "text_column")
    for split, ds in given_splits(train_raw, val_raw):
        datacheck.check_texts(list(ds[text_col]), text_col, split, allow_empty=True)  # blank lines are dropped
    datacheck.check_held_out(train_raw, val_raw, [text_col])
    train_raw, val_raw = data.hold_out(train_raw, val_raw, source)
    train_ds, val_ds = to_dataset(train_raw), to_dataset(val_raw)
    # Blank lines (wikitext has many) hold no target token.
    rows = len(train_ds), len(val_ds)
    train_ds, val_ds = (ds.filter(lambda b: [bool(t and t.strip()) for t in b[text_col]], batched=True)
                        for ds in (train_ds, val_ds))
    skipped = [f"{n - len(ds)} blank {split} row(s) (no text to predict)"
               for split, n, ds in (("training", rows[0], train_ds), ("validation", rows[1], val_ds)) if n > len(ds)]
    if len(train_ds) == 0:
        raise InputError(NO_EXAMPLES.format(source=source))
    packed = args.packing != "none"
    if not packed:  # a sample is a line: the limits count lines (packed, they count blocks, as in run_clm)
        train_ds, val_ds = limit(train_ds, args.max_train_samples), limit(val_ds, args.max_eval_samples)
    tokenizer = tokenizer_for(args, list(train_ds[text_col]))
    datacheck.check_seq_length(args.max_seq_length, tokenizer.num_special_tokens_to_add(), args.task)
    if args.model_name_or_path:
        config = models.load_pretrained_config(args)
    else:
        config = models.preset_config(args.task, args.model_preset, vocab_size=preset_vocab(tokenizer, args),
                                      pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    with accelerator.main_process_first():
        train_ds, text_tokens = packing.samples(train_ds, tokenizer, text_col, args.packing, args.max_seq_length,
                                                train=True, keep=keep)
        val_ds, _ = packing.samples(val_ds, tokenizer, text_col, args.packing, args.max_seq_length, train=False,
                                    keep=keep)
    if len(train_ds) == 0:
        raise InputError(f"The training text ({source}) holds {text_tokens} tokens, fewer than one block of "
                         f"--max_seq_length {args.max_seq_length}. Lower --max_seq_length, add text, or pass "
                         "--packing none.")
    held = sum(train_ds["n_real"])  # before --max_train_samples: what packing or the cut left of the text
    if packed:
        train_ds, val_ds = limit(train_ds, args.max_train_samples), limit(val_ds, args.max_eval_samples)
    stats = datastats.text_stats(train_ds["n_real"], train_ds["n_targets"], batches[0],
                                 args.seed, block=args.max_seq_length if packed else None)
    stats["train_text_tokens"] = text_tokens
    stats["dropped_token_fraction"] = round(1.0 - held / max(1, text_tokens), 6)
    _report_packing(args, accelerator, stats)
    train_ds, val_ds = (ds.remove_columns(["n_real", "n_targets"]) for ds in (train_ds, val_ds))
    model = models.build_model(args, config)
    collate = packing.BlockCollator() if packed else CausalCollator(tokenizer)
    train_dl, eval_dl = dataloaders(args, accelerator, train_ds, val_ds, collate, batches)
    return CausalLMTask(args.task, model, models.model_source(args), train_dl, eval_dl, source, tokenizer,
                        packing=args.packing, stats=stats, keep_columns=keep, loss_fn=loss_fn,
                        columns={"text": text_col}, skipped=skipped + _dropped_tokens(args, stats),
                        inputs_fn=model_inputs(args.packing, model))



def _dropped_tokens(args, stats: dict) -> list[str]:
    """The data report's line for the tokens packing or the cut leaves out ([]: none)."""
    if not stats.get("dropped_token_fraction"):
        return []
    why = "cut beyond --max_seq_length" if args.packing == "none" else "partial blocks dropped"
    return [f"{100 * stats['dropped_token_fraction']:.1f}% of the training text's tokens ({why}, --packing "
            f"{args.packing})"]


def _report_packing(args, accelerator, stats: dict) -> None:
    if not accelerator.is_main_process:
        return
    dropped = stats["dropped_token_fraction"]
    if args.packing == "none" and dropped > 0:
        logger.warning("--packing none: --max_seq_length %d cut %.1f%% of the training text's %d tokens. "
                       "--packing concat (the default) packs whole documents into blocks and keeps them.",
                       args.max_seq_length, 100 * dropped, stats["train_text_tokens"])
    logger.info("causal-lm data, --packing %s: %d training samples of up to %d tokens, %d target tokens per epoch, "
                "%.1f%% of the text's tokens left out, %.1f%% padding", args.packing, stats["train_examples"],
                args.max_seq_length, stats["train_target_tokens"], 100 * dropped, 100 * stats["padding_fraction"])
