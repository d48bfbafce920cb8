"""Text classification (BERT-style, or a decoder with a classification head): what you change first is here.

- the data: the columns (--text_column, --text_pair_column, --label_column), read and checked in `build`;
- the model: a hub id or local directory (--model_name_or_path), or a preset, in `build`;
- the loss: the summed cross-entropy of shared/core/losses.py, or your own (Task.loss_fn, docs/adapting_a_copy.md);
- the metrics: `compute_metrics`, over the whole validation set (add F1 there).
"""

from __future__ import annotations

import random

import torch  # noqa: F401  (for a loss_fn or compute_metrics of your own below)

from ..core import data, datacheck, datastats, models
from ..core.tasks import Task, dataloaders, given_splits, limit, preset_vocab, to_dataset, tokenizer_for

# Your own loss: def loss_fn(logits, labels, kept) -> the batch's summed loss, which the loop divides by the
# global batch's items (`kept`: the columns load_task(keep_columns=) kept). None: the task's summed cross-entropy
# (shared/core/losses.py). chunked_loss and sequence_parallel, which compute the loss their own way, refuse
# one; the pipeline recipes train with it. docs/adapting_a_copy.md: class weights.
loss_fn = None


# Your own metrics: def compute_metrics(predictions, labels) -> {name: value}, over the whole validation set gathered
# from every process; each name is reported as eval_<name> (results.json, the trackers). None: eval_accuracy.
# docs/adapting_a_copy.md: F1.
compute_metrics = None


# The built-in data (data.builtin_split): short reviews whose label is their polarity.
_POSITIVE = "great excellent superb wonderful delightful brilliant enjoyable charming moving fresh clever".split()
_NEGATIVE = "awful terrible boring dull dreadful poor painful mediocre bland clumsy tedious weak".split()
_NOUNS = "movie film plot acting script cast ending story music pacing dialogue camera".split()
_FILLER = "the a this that really quite very somewhat rather honestly overall frankly".split()


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


builtin_data = sentiment_dataset


def build(args, accelerator, train_raw, val_raw, source, batches: tuple[int, int], keep: tuple[str, ...] = ()
          ) -> Task:
    cols = data.column_names(train_raw)
    text_col = data.pick_column(cols, args.text_column, data._TEXT_GUESSES, "text", "text_column")
    # Sentence pairs (GLUE MRPC, MNLI ...): the tokenizer joins the two its own way ([SEP] and segment ids for BERT).
    pair_col = (data.pick_column(cols, args.text_pair_column, (), "text pair", "text_pair_column")
                if args.text_pair_column else None)
    label_col = data.pick_column(cols, args.label_column, data._LABEL_GUESSES, "label", "label_column")
    roles = {"text": text_col, "text pair": pair_col, "label": label_col}
    datacheck.check_roles(roles)
    for split, ds in given_splits(train_raw, val_raw):
        for col in filter(None, (text_col, pair_col)):
            datacheck.check_texts(list(ds[col]), col, split)
        datacheck.check_label_values(list(ds[label_col]), label_col, split)
    datacheck.check_held_out(train_raw, val_raw, [text_col, pair_col])
    train_raw, val_raw = data.hold_out(train_raw, val_raw, source)
    train_raw, val_raw = limit(train_raw, args.max_train_samples), limit(val_raw, args.max_eval_samples)
    train_ds, val_ds = to_dataset(train_raw), to_dataset(val_raw)
    labels, mapping = datacheck.label_set(list(train_ds[label_col]), list(val_ds[label_col]), label_col)
    to_id = datacheck.label_index(mapping)
    # The names a pipeline answers with: the label strings, or a hub dataset's ClassLabel names (its values are ids)
    names = data.class_names(train_ds, label_col, labels) or (labels if mapping else None)
    id2label = dict(enumerate(names)) if names else {}
    texts = list(train_ds[text_col]) + (list(train_ds[pair_col]) if pair_col else [])
    tokenizer = tokenizer_for(args, texts)
    datacheck.check_seq_length(args.max_seq_length, tokenizer.num_special_tokens_to_add(bool(pair_col)), args.task)

    def encode(batch):
        pairs = (batch[pair_col],) if pair_col else ()
        enc = tokenizer(batch[text_col], *pairs, truncation=True, max_length=args.max_seq_length)
        enc["labels"] = [to_id(v) for v in batch[label_col]]
        enc.update({c: batch[c] for c in keep if c in batch})  # validation may lack them
        return enc

    with accelerator.main_process_first():
        train_ds, val_ds = (ds.map(encode, batched=True, remove_columns=ds.column_names) for ds in (train_ds, val_ds))
    from transformers import DataCollatorWithPadding

    if args.model_name_or_path:
        extra = {"id2label": id2label} if id2label else {}
        config = models.load_pretrained_config(args, num_labels=len(labels), **extra)
        if getattr(config, "pad_token_id", None) is None:
            # Decoder-only classifiers (GPT-2, Llama) score the last token that is not padding and refuse a batch
            # of more than one without a pad id: the tokenizer's (its EOS, for GPT-2-style tokenizers).
            config.pad_token_id = tokenizer.pad_token_id
    else:
        config = models.preset_config(args.task, args.model_preset, vocab_size=preset_vocab(tokenizer, args),
                                      num_labels=len(labels), pad_token_id=tokenizer.pad_token_id)
        if id2label:
            config.id2label = id2label
    model = models.build_model(args, config)
    train_dl, eval_dl = dataloaders(args, accelerator, train_ds, val_ds, DataCollatorWithPadding(tokenizer), batches)
    lengths = [len(x) for x in train_ds["input_ids"]]
    stats = datastats.text_stats(lengths, None, batches[0], args.seed)
    return Task(args.task, model, models.model_source(args), train_dl, eval_dl, source, tokenizer, stats=stats,
                columns={k: v for k, v in roles.items() if v}, keep_columns=keep, loss_fn=loss_fn,
                compute_metrics=compute_metrics)
