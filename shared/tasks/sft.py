"""Supervised fine-tuning of a decoder on instruction and chat data (--task sft): what you change first is here.

- the data: TRL's four layouts, {"text"}, {"messages": [{role, content} ...]}, {"prompt", "completion"} as strings, and
  the conversational prompt/completion (lists of turns); Alpaca columns with --prompt_column instruction,input
  --completion_column output. Every row is checked before the first step (shared/tasks/chat.py check_rows);
- the template: the tokenizer's chat template, --chat_template FILE, or a plain built-in one; the saved tokenizer
  carries the one used. String prompt/completion and text are not templated (as TRL's SFTTrainer);
- the loss: next-token cross-entropy on the assistant turns (each answer and the end-of-turn tokens the template
  writes after it) or the completion; --train_on_prompt counts every token. The mask comes from rendering each
  conversation one turn at a time (chat.py), never from generation markers;
- the samples: --packing per_document (default) packs whole conversations into blocks, each attending only to
  itself; none pads one conversation per row. Longer than --max_seq_length: the end is cut (the start, with the
  system turn, is kept);
- the metrics: loss and perplexity on the target tokens; --generate N writes greedy answers to samples.jsonl.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from ..core import data, datacheck, datastats, models
from ..core.args import number
from ..core.errors import InputError
from ..core.tasks import Task, dataloaders, preset_vocab, tokenizer_for
from . import chat, packing
from .causal_lm import CausalLMTask, model_inputs
from .packing import BlockCollator

logger = logging.getLogger("recipes")
MAX_NEW_TOKENS = 64  # --generate: the longest answer written

FLAGS = ("chat_template", "messages_column", "prompt_column", "completion_column", "train_on_prompt", "generate")


def add_args(g) -> None:
    """sft's flags (shared/core/args.py adds the chosen task's), --packing among them."""
    packing.add_args(g)
    g.add_argument("--messages_column", default=None, help="sft: the column of conversations (a list of {role, "
                   "content}); guessed: messages, conversations.")
    g.add_argument("--prompt_column", default=None, help="sft: the prompt column, or several joined by a blank line "
                   "(Alpaca: instruction,input); guessed: prompt.")
    g.add_argument("--completion_column", default=None, help="sft: the answer column (Alpaca: output); guessed: "
                   "completion.")
    g.add_argument("--chat_template", default=None, help="sft: a Jinja chat template file, used instead of the "
                   "tokenizer's own (a tokenizer without one gets a plain built-in template).")
    g.add_argument("--train_on_prompt", action="store_true", help="sft: every token is a target, the prompts too "
                   "(default: the assistant turns or the completion only).")
    g.add_argument("--generate", type=number(int, low=0), default=0, help="sft: after training, greedy answers to "
                   "the first N validation prompts, written to samples.jsonl beside results.json.")


def check_args(args, error) -> None:
    """sft's flags given to another task would do nothing: refused as argparse refuses (`error`)."""
    if args.task != "sft" and (given := [f"--{f}" for f in FLAGS if f in args.explicit_flags]):
        error(f"{', '.join(given)} {'serve' if len(given) > 1 else 'serves'} --task sft (chat and instruction "
              f"data), not --task {args.task}. Pass --task sft, or drop them.")


# Your own loss: as in causal_lm.py (summed over the target tokens, divided by the global batch's by the loop).
loss_fn = None


def load_raw_splits(args) -> tuple[object, object, str]:
    """The user's data (data.py), or the built-in instruction set: reverse a few words, exact answers."""
    saved = args.dataset_name and any((Path(args.dataset_name) / f).exists() for f in ("dataset_dict.json",
                                                                                         "state.json"))
    if saved:  # a directory written by datasets' save_to_disk, which load_dataset does not read
        import datasets

        loaded = datasets.load_from_disk(args.dataset_name)
        if isinstance(loaded, datasets.Dataset):
            return loaded, None, f"saved dataset {args.dataset_name}"
        if "train" not in loaded:
            raise InputError(f"--dataset_name {args.dataset_name}: the saved dataset has no 'train' split (it has "
                             f"{sorted(loaded)}). Save one named train.")
        val = next((loaded[s] for s in ("validation", "valid", "test") if s in loaded), None)
        return loaded["train"], val, f"saved dataset {args.dataset_name}"
    if args.train_file or args.dataset_name:
        return data.load_raw_splits(args)
    return chat.reverse_words(2000, seed=1), chat.reverse_words(400, seed=2), "built-in offline dataset (reverse)"


class SFTCollator:
    """Pads conversations of a batch to its longest; padding is never a target."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(f["input_ids"]) for f in features)
        pad = lambda key, value: torch.tensor([f[key] + [value] * (width - len(f[key])) for f in features])  # noqa: E731
        return {"input_ids": pad("input_ids", self.pad_id), "attention_mask": pad("attention_mask", 0),
                "labels": pad("labels", -100)}


class SFTTask(CausalLMTask):
    """A causal-LM task whose evaluation may also write greedy answers (--generate N)."""

    generate: int = 0
    prompts: list[dict] = []

    @torch.no_grad()
    def evaluate(self, model, eval_dataloader, accelerator) -> dict[str, float]:
        metrics = super().evaluate(model, eval_dataloader, accelerator)
        if not self.generate:
            return metrics
        was_training = model.training
        model.eval()
        samples = [self._answer(model, p, accelerator.device) for p in self.prompts[:self.generate]]
        model.train(was_training)
        if accelerator.is_main_process:
            path = Path(self.output_dir) / "samples.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(json.dumps(s) + "\n" for s in samples))
            logger.info("wrote %d greedy answers to %s", len(samples), path)
        matched = [s["exact_match"] for s in samples if s["reference"] is not None]
        return {**metrics, "generated_samples": len(samples),
                **({"generated_exact_match": sum(matched) / len(matched)} if matched else {})}

    def _answer(self, model, prompt: dict, device) -> dict:
        """Greedy decoding without a KV cache: every process runs the same forwards (sharded models need all)."""
        ids = torch.tensor([prompt["ids"]], device=device)
        stop = set(self.tokenizer.all_special_ids) - {self.tokenizer.unk_token_id}
        new: list[int] = []
        for _ in range(MAX_NEW_TOKENS):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
            token = int(logits.argmax())
            if token in stop:
                break
            new.append(token)
            ids = torch.cat([ids, torch.tensor([[token]], device=device)], dim=1)
        answer = self.tokenizer.decode(new, skip_special_tokens=True).strip()
        return {"prompt": prompt["text"], "generated": answer, "reference": prompt["reference"],
                "exact_match": answer == prompt["reference"]}


def build(args, accelerator, train_raw, val_raw, source, batches: tuple[int, int], keep: tuple[str, ...] = ()
          ) -> Task:
    layout = chat.pick_layout(data.column_names(train_raw), args)
    train_rows = chat.rows(train_raw, layout, "training")  # refused here, naming the rows, before any work
    val_rows = chat.rows(val_raw, layout, "validation") if val_raw is not None else None
    if val_rows and chat.resolved(layout, val_rows) != chat.resolved(layout, train_rows):
        raise InputError("The training and the validation data hold prompt/completion in two ways (lists of turns, "
                         "strings). Store both one way.")
    layout = chat.resolved(layout, train_rows)
    if val_rows is None:  # 10% held out, the same rows for every seed (as data.hold_out)
        datacheck.check_can_hold_out(len(train_rows), source)
        cut = max(1, len(train_rows) // 10)
        order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(0)).tolist()
        val_rows, train_rows = [train_rows[i] for i in order[:cut]], [train_rows[i] for i in order[cut:]]
    train_rows, val_rows = train_rows[:args.max_train_samples], val_rows[:args.max_eval_samples]  # conversations
    lm_args = type(args)(**{**vars(args), "task": "causal-lm"})  # the model and a preset's tokenizer: a causal LM's
    texts = [chat.plain_text(r) for r in train_rows[:20000]]  # what a preset's word-level tokenizer learns
    tokenizer = tokenizer_for(lm_args, texts)
    template = chat.set_template(tokenizer, args.chat_template, layout)
    if accelerator.is_main_process:
        logger.info("sft data: %s layout; chat template: %s", layout.kind, template)
    if args.generate and layout.kind == "text":
        raise InputError("--generate answers prompts, and the text layout has none. Use messages or "
                         "prompt/completion data, or drop --generate.")
    encode = chat.Encoder(tokenizer, args.max_seq_length, args.train_on_prompt)
    train, train_dropped = encode.all(train_rows, "training", refuse_long_prompts=True)
    val, val_dropped = encode.all(val_rows, "validation", refuse_long_prompts=False)
    if not train:
        raise InputError(f"The training data ({source}) has no conversation with a target token left "
                         f"({train_dropped}). Check the file and the columns.")
    mode = args.packing if "packing" in args.explicit_flags else "per_document"
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if mode == "per_document":
        train_ds, val_ds = chat.pack(train, args.max_seq_length, pad_id), chat.pack(val, args.max_seq_length, pad_id)
        collate = BlockCollator()
    else:
        train_ds, val_ds = ([{**s, "attention_mask": [1] * len(s["input_ids"])} for s in split]
                            for split in (train, val))
        collate = SFTCollator(pad_id)
    n_real = [sum(s["attention_mask"]) for s in train_ds]
    n_targets = [sum(x != -100 for x in s["labels"][1:]) for s in train_ds]
    stats = datastats.text_stats(n_real, n_targets, batches[0], args.seed,
                                 block=args.max_seq_length if mode == "per_document" else None)
    stats.update({"sft_layout": layout.kind, "sft_chat_template": template, "sft_conversations_kept": len(train),
                  "sft_conversations_dropped": train_dropped, "sft_eval_conversations": len(val),
                  "sft_eval_conversations_dropped": val_dropped,
                  "train_prompt_tokens": sum(n_real) - stats["train_target_tokens"],
                  "sft_truncated_conversations": sum(s["truncated"] for s in train)})
    if accelerator.is_main_process:
        logger.info("sft data, --packing %s: %d conversations kept (dropped: %s) in %d samples, %d target and %d "
                    "prompt tokens per epoch", mode, len(train), train_dropped or "none", len(train_ds),
                    stats["train_target_tokens"], stats["train_prompt_tokens"])
    config = (models.load_pretrained_config(lm_args) if args.model_name_or_path else
              models.preset_config("causal-lm", args.model_preset, vocab_size=preset_vocab(tokenizer, args),
                                   pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                                   eos_token_id=tokenizer.eos_token_id))
    model = models.build_model(lm_args, config)
    train_dl, eval_dl = dataloaders(args, accelerator, chat.as_dataset(train_ds), chat.as_dataset(val_ds), collate,
                                    batches)
    task = SFTTask(args.task, model, models.model_source(args), train_dl, eval_dl, source, tokenizer, packing=mode,
                   stats=stats, loss_fn=loss_fn, inputs_fn=model_inputs(mode, model))
    task.generate, task.prompts = args.generate, [encode.prompt(r) for r in val_rows[:args.generate]]
    return task
