"""One parser for every recipe: the common flags (named as in Transformers' example scripts) and the recipe's own."""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from difflib import get_close_matches
from pathlib import Path

from .boundary import expand_user
from .errors import InputError, LaunchError

# --model_preset (shared/core/models.py; the decoders' configs: shared/tasks/decoder_presets.py). The decoders:
# tiny-llama and tiny-moe as the recipes' own (fp32, untied, router loss on, full attention), and three shaped as
# today's checkpoints ship (all stored in bf16).
DECODERS = ("tiny-llama", "tiny-moe", "tiny-qwen2", "tiny-qwen3-moe", "tiny-mistral")
PRESETS = ("tiny", "base", *DECODERS)

TASKS = ("text-classification", "causal-lm", "image-classification", "sft")
DECODER_TASKS = ("causal-lm", "sft")  # trained with the next-token loss (sft: on its target tokens only)
# A task's own flags are its module's (add_args in shared/tasks/<task>.py). The spine keeps their tasks and defaults:
# another task's run records them at these (results.json, a checkpoint's run), and a copy without their task says so.
TASK_FLAGS = {"packing": (("causal-lm", "sft"), "concat"), "train_on_prompt": (("sft",), False),
              "generate": (("sft",), 0), **dict.fromkeys(("train_dir", "validation_dir", "image_column"),
                                                        (("image-classification",), None)),
              **dict.fromkeys(("messages_column", "prompt_column", "completion_column", "chat_template"),
                              (("sft",), None))}
# The spine's data flags that only some tasks read: typed for another task they would be ignored, so they are refused.
READ_BY = {"text_column": ("text-classification", "causal-lm", "sft"), "text_pair_column": ("text-classification",),
           "label_column": ("text-classification", "image-classification"), "image_column": ("image-classification",)}
# Resolved after parsing when --learning_rate is unset: fine-tuning pretrained weights (the Transformers examples'
# default) wants a far smaller step than training a randomly initialised preset from scratch.
PRETRAINED_LR, FROM_SCRATCH_LR = 5e-5, 1e-3


def number(kind: type = int, low: float | None = None, high: float | None = None, above: float | None = None,
           below: float | None = None, note: str = "") -> Callable[[str], float]:
    """An argparse `type` that refuses a value out of range at parse time: `low`/`high` inclusive, `above`/`below`
    exclusive; `note` says what the bound means. NaN and infinities are never a valid setting."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        bounds = [(low, value >= low if low is not None else True, "at least"),
                  (high, value <= high if high is not None else True, "at most"),
                  (above, value > above if above is not None else True, "greater than"),
                  (below, value < below if below is not None else True, "less than")]
        wrong = [f"{words} {bound:,}" for bound, ok, words in bounds if bound is not None and not ok]
        if kind is float and not math.isfinite(value):
            wrong.append("finite")
        if wrong:
            raise argparse.ArgumentTypeError(f"must be {' and '.join(wrong)}{note}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


COUNT = number(int, low=1)  # batch sizes, steps, lengths: 0 would silently do nothing
STEPS = number(int, low=1, note=" (unset: never)")

# --optim names: the library is part of the name, so one name means one implementation in every recipe.
OPTIMIZERS = {"adamw": "torch", "adamw_bnb_8bit": "bitsandbytes", "adamw_torchao_8bit": "torchao",
              "adamw_torchao_4bit": "torchao", "adamw_torchao_fp8": "torchao"}
# Spellings of earlier versions, refused at parse time with today's name: `adamw_8bit` was bitsandbytes' AdamW8bit in
# recipes/combined.py and torchao's in recipes/optim_low_bit.py, so no single meaning can be kept for it.
RENAMED_VALUES = {"adamw_8bit": ("adamw_bnb_8bit", "adamw_torchao_8bit"), "bnb_adamw_8bit": ("adamw_bnb_8bit",),
                  "adamw8bit": ("adamw_bnb_8bit",), "adamw_4bit": ("adamw_torchao_4bit",),
                  "adamw_fp8": ("adamw_torchao_fp8",)}
# Flags of earlier versions: (today's flag, how it spells the old flag's value). Refused where the new flag exists.
RENAMED_FLAGS = {"--bits": ("--load_in", "{}bit")}  # recipes/qlora.py's --bits 4 / 8
# Other tools' flags (Trainer, TRL, axolotl, run_clm, timm) -> ours, by meaning: an unknown flag is answered from
# this table first, and difflib's nearest spelling only for flags it lacks. A hint never names a flag that changes
# the run's length (--max_train_steps, --num_train_epochs ...) unless the flag it answers meant that too.
SPELLINGS = {
    "--lr": "--learning_rate", "--epochs": "--num_train_epochs", "--wd": "--weight_decay",
    "--bs": "--per_device_train_batch_size", "--batch_size": "--per_device_train_batch_size",
    "--micro_batch_size": "--per_device_train_batch_size", "--train_batch_size": "--per_device_train_batch_size",
    "--eval_batch_size": "--per_device_eval_batch_size", "--max_steps": "--max_train_steps",
    "--warmup_steps": "--num_warmup_steps", "--fp16": "--mixed_precision fp16", "--bf16": "--mixed_precision bf16",
    "--save_steps": "--checkpointing_steps", "--save_strategy": "--checkpointing_steps",
    "--save_limit": "--save_total_limit", "--block_size": "--max_seq_length", "--max_length": "--max_seq_length",
    "--sequence_len": "--max_seq_length", "--max_len": "--max_seq_length", "--seq_length": "--max_seq_length",
    "--model": "--model_name_or_path", "--base_model": "--model_name_or_path", "--model_name": "--model_name_or_path",
    "--tokenizer": "--tokenizer_name", "--dataset": "--dataset_name", "--dataset_text_field": "--text_column",
    "--text_field": "--text_column", "--train_data": "--train_file", "--data_path": "--train_file",
    "--eval_file": "--validation_file", "--val_file": "--validation_file", "--test_file": "--validation_file",
    "--train_on_inputs": "--train_on_prompt", "--train_on_input": "--train_on_prompt",
    "--completion_only_loss": "--train_on_prompt", "--chat_template": "--chat_template",
    "--gradient_checkpointing": "gradient checkpointing is a recipe here: recipes/activation_checkpointing.py",
    "--use_peft": "LoRA adapters are a recipe here: recipes/qlora.py", "--lora_r": "a flag of recipes/qlora.py",
    "--load_in_4bit": "recipes/qlora.py --load_in 4bit is the recipe for it",
    "--load_in_8bit": "recipes/qlora.py --load_in 8bit is the recipe for it",
    "--deepspeed": "DeepSpeed is a recipe here: recipes/zero.py with a launch config (docs/zero.md)",
    "--fsdp": "FSDP is a recipe here: recipes/fsdp.py with accelerate_configs/fsdp.yaml",
    "--evaluation_strategy": "not needed: these recipes evaluate once, after training (results.json)",
    "--eval_strategy": "not needed: these recipes evaluate once, after training (results.json)",
    "--eval_steps": "not needed: these recipes evaluate once, after training (results.json)",
    "--do_train": "not needed: every run trains", "--do_eval": "not needed: every run evaluates after training",
    "--logging_dir": "--output_dir (tracker logs go there)", "--lr_scheduler": "--lr_scheduler_type",
    "--scheduler": "--lr_scheduler_type", "--optimizer": "--optim",
    "--warmup_ratio": "--num_warmup_steps (a count of steps)",
    "--gradient_accumulation": "--gradient_accumulation_steps", "--torch_compile_mode": "--torch_compile",
    "--num_epochs": "--num_train_epochs", "--n_epochs": "--num_train_epochs", "--train_steps": "--max_train_steps",
    "--local_rank": "not needed: accelerate launch starts the processes and sets their ranks",
}
# What changes how long a run trains: a spelling match may point there only when the flag typed speaks of the same
# thing (--max_step, --num_epoch), never from a look-alike (--save_steps is not --max_steps).
_LENGTH_WORDS = {"--max_train_steps": ("max", "step"), "--num_train_epochs": ("epoch",),
                 "--max_train_samples": ("train", "sample"), "--max_eval_samples": ("eval", "sample")}


def flag_hint(flag: str, options: dict) -> str:
    """The hint for an unknown flag: the table of other tools' names (SPELLINGS), then a close spelling of one of
    ours or of the table's, never a flag of another meaning that changes the run's length."""
    name = "--" + flag.lstrip("-").replace("-", "_")
    meant = SPELLINGS.get(flag, SPELLINGS.get(name))
    if meant is None and flag in _launcher_options():  # accelerate launch's own (--config_file, --num_processes ...)
        return (f"an option of `accelerate launch`, which goes before the recipe: accelerate launch {flag} ... "
                "recipes/<recipe>.py [the recipe's flags]")
    if meant is None:
        near = [m for m in get_close_matches(name, [*options, *SPELLINGS], 5)
                if all(w in name for w in _LENGTH_WORDS.get(SPELLINGS.get(m, m), ()))]
        meant = SPELLINGS.get(near[0], near[0]) if near else None
    if meant is None:
        return "no such flag (see --help)"
    if not meant.startswith("--"):
        return meant
    if meant.split()[0] in options:
        return f"did you mean {meant}?"
    return f"these recipes call it {meant.split()[0]}, and this recipe has no such flag (see --help)"


@functools.cache
def _launcher_options() -> frozenset[str]:
    """The options of `accelerate launch`, read from its own parser."""
    from accelerate.commands.launch import launch_command_parser

    return frozenset(launch_command_parser()._option_string_actions)


def one_of(*names: str) -> dict:
    """add_argument's `choices` and `type` for a flag of named values: a spelling of an earlier version
    (RENAMED_VALUES) is refused with the name it has now, where argparse alone would say only 'invalid choice'."""

    def parse(text: str) -> str:
        new = [n for n in RENAMED_VALUES.get(text, ()) if n in names]
        if text not in names and new:
            spelled = " or ".join(f"{n} ({OPTIMIZERS[n]})" if n in OPTIMIZERS else n for n in new)
            raise argparse.ArgumentTypeError(f"{text!r} is an old name that is no longer accepted: pass {spelled}")
        return text

    parse.__name__ = "choice"
    return {"choices": names, "type": parse}


def _renamed_flag(old: str, new: str, value: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        raise argparse.ArgumentTypeError(f"{old} was renamed: pass {new} {value.format(text)}")

    return parse


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:
        if message.startswith("unrecognized arguments: "):  # argparse says no more: name the flag meant
            for flag in [t.split("=")[0] for t in message.split()[2:] if t[:1] == "-" and t.strip("-")[:1].isalpha()]:
                message += f". {flag}: {flag_hint(flag, {**self._option_string_actions, **_TASK_OPTIONS})}"
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under a launcher: shown once, in its summary (entrypoint)
            raise LaunchError(f"{self.prog}: error: {message}")
        super().error(message)


_TASK_OPTIONS = {f"--{f}": None for f in TASK_FLAGS}  # hinted as ours: typed, they load their task's module


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """--help keeps the recipe docstring's line breaks (its launch examples) and shows every flag's default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "%(default)" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


def parse_args(
    argv: Sequence[str] | None = None,
    add_recipe_args: Callable[[argparse.ArgumentParser], None] | None = None,
    description: str | None = None,
    **defaults: object,
) -> argparse.Namespace:
    """Parse the common flags and the recipe's own; `defaults` override the common defaults for one recipe."""
    p = _Parser(description=description, formatter_class=HelpFormatter, allow_abbrev=False)
    g = p.add_argument_group("task and model")
    g.add_argument("--task", default="text-classification", choices=TASKS)
    g.add_argument("--model_name_or_path", default=None,
                   help="Hub id or local directory. Unset: a model built from the --model_preset config (no download).")
    g.add_argument("--model_preset", default="tiny", choices=PRESETS,
                   help="Used when --model_name_or_path is unset. tiny: trains in seconds on CPU. base: the dimensions "
                        "of BERT-base / GPT-2 124M / ViT-B/16, random weights, for benchmarks. tiny-llama, tiny-moe: "
                        "a Llama-style decoder (RMSNorm, rotary, GQA, SwiGLU) and a Mixtral-style mixture of experts, "
                        "for text tasks. As checkpoints ship (bf16 in config.json): tiny-qwen2 (head tied to the "
                        "embedding), tiny-qwen3-moe (output_router_logits false), tiny-mistral (a 16-token sliding "
                        "window).")
    g.add_argument("--tokenizer_name", default=None, help="Defaults to --model_name_or_path; unset: built locally.")
    g.add_argument("--disable_dropout", action="store_true",
                   help="Set every dropout probability to 0: runs that differ only in batching then match exactly.")
    g.add_argument("--trust_remote_code", action="store_true",
                   help="Run code shipped with a hub model. Off unless passed.")
    g.add_argument("--ignore_mismatched_sizes", action="store_true", help="A classifier of other labels: a new head.")
    g.add_argument("--weights_dtype", default="fp32", choices=("fp32", "bf16", "auto"),
                   help="The dtype the weights (and so their gradients and AdamW moments) train in. fp32: fp32 master "
                        "weights, a bf16 checkpoint upcast on load; --mixed_precision bf16/fp16 then computes in 16 "
                        "bits over them. bf16: pure bf16 on purpose (torchtune's choice: half the model-state memory, "
                        "no fp32 copy). auto: as the checkpoint stores them (transformers' dtype='auto'), said on "
                        "the console.")
    g.add_argument("--attn_implementation", default=None,
                   help="eager, sdpa, flash_attention_2 ... Unset: Transformers' choice (sdpa where the model has it).")

    g = p.add_argument_group("data (unset: a built-in offline dataset the model can learn)")
    g.add_argument("--dataset_name", default=None, help="Hub dataset id.")
    g.add_argument("--dataset_config_name", default=None)
    g.add_argument("--train_file", default=None, help="csv, json/jsonl, parquet (txt for causal-lm).")
    g.add_argument("--validation_file", default=None)
    g.add_argument("--text_column", default=None)
    g.add_argument("--text_pair_column", default=None,
                   help="text-classification of sentence pairs (GLUE MRPC, MNLI): the second text's column; the "
                        "tokenizer gets (text, text_pair).")
    g.add_argument("--label_column", default=None)
    g.add_argument("--max_seq_length", type=COUNT, default=128,
                   help="Tokens per sample: the block length when packed, the cut otherwise.")
    g.add_argument("--dataloader_num_workers", type=number(int, low=0), default=0,
                   help="Processes that load and collate batches (0: the training process itself). Memory is pinned "
                        "when the device is CUDA.")
    g.add_argument("--max_train_samples", type=COUNT, default=None)
    g.add_argument("--max_eval_samples", type=COUNT, default=None)

    g = p.add_argument_group("training")
    g.add_argument("--per_device_train_batch_size", type=COUNT, default=16)
    g.add_argument("--per_device_eval_batch_size", type=COUNT, default=32)
    g.add_argument("--learning_rate", type=number(float, above=0), default=None,
                   help=f"None: {PRETRAINED_LR:g} with --model_name_or_path (fine-tuning pretrained weights, as the "
                        f"Transformers examples), {FROM_SCRATCH_LR:g} for a --model_preset model (random weights).")
    g.add_argument("--weight_decay", type=number(float, low=0), default=0.01)
    g.add_argument("--num_train_epochs", type=number(float, above=0), default=2.0)
    g.add_argument("--max_train_steps", type=COUNT, default=None, help="Overrides --num_train_epochs.")
    g.add_argument("--gradient_accumulation_steps", type=COUNT, default=1)
    g.add_argument("--lr_scheduler_type", default="linear",
                   choices=("linear", "cosine", "constant", "constant_with_warmup", "polynomial"))
    g.add_argument("--num_warmup_steps", type=number(int, low=0), default=0)
    g.add_argument("--max_grad_norm", default=1.0,
                   type=number(float, low=0, note=" (0: no clipping; a negative norm would flip the gradient)"),
                   help="0 disables clipping.")
    g.add_argument("--mixed_precision", default=None, choices=("no", "fp16", "bf16"),
                   help="Unset: the accelerate config's value, else the recipe's default (both set, differently: "
                   "refused).")
    g.add_argument("--torch_compile", default=None, choices=("regional", "full"),
                   help="torch.compile (inductor) through Accelerate's TorchDynamoPlugin, applied in prepare(). "
                        "regional: each repeated transformer block compiled once and reused (Accelerate's "
                        "use_regional_compilation; the shortest cold start), the rest of the model compiled apart. "
                        "full: the whole model as one graph. Unset: eager. Recipes that do not compile through "
                        "prepare() refuse it (shared/core/rules.py).")
    g.add_argument("--seed", type=number(int, low=0, high=2**32 - 1, note=" (numpy's seed range)"), default=42)
    g.add_argument("--ddp_timeout", default=1800, type=number(int, low=60, note=" seconds (start-ups take 5-30 s)"),
                   help="Seconds a process waits for the others in a collective before failing.")

    g = p.add_argument_group("output")
    g.add_argument("--output_dir", default=None, help="Default: outputs/<recipe>-<task>.")
    g.add_argument("--overwrite_output_dir", action="store_true",
                   help="Replace the finished run in --output_dir (its files are removed first).")
    g.add_argument("--checkpointing_steps", type=STEPS, default=None, help="Save a resumable checkpoint every N steps.")
    g.add_argument("--save_total_limit", type=COUNT, default=None, help="Keep only the newest N checkpoints.")
    g.add_argument("--resume_from_checkpoint", default=None, help="A checkpoint directory, or 'latest' in output_dir.")
    g.add_argument("--async_checkpoint", action="store_true", help="Write checkpoints' DCP shards while training "
                   "goes on (torch.distributed.checkpoint.async_save); complete once written.")
    g.add_argument("--record_samples", action="store_true", help="Append each step's samples (a CRC32 per row) to "
                   "<output_dir>/samples_<process>.jsonl: the data position a resume continues (docs/resharding.md).")
    g.add_argument("--report_to", default="tensorboard", help="Tracker(s) for Accelerate, comma-separated, or 'none'.")
    g.add_argument("--logging_steps", type=COUNT, default=10)
    g.add_argument("--no_save_model", action="store_true", help="Skip saving the final model (tests, benchmarks).")
    g.add_argument("--debug", action="store_true", help="After a refusal, print the library's traceback that "
                   "caused it (also RECIPES_DEBUG=1).")
    g.add_argument("--preflight", action="store_true",
                   help="Resolve and check the configuration, print it, and stop before the first step.")

    # The chosen task's flags, and those of another task's flag typed (its module's checks then refuse it, as in a
    # run of that task); a copy without that module is refused with the copy command that adds it.
    tokens, recipe = [str(t) for t in (sys.argv[1:] if argv is None else argv)], os.path.splitext(p.prog)[0]
    chosen = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    chosen.add_argument("--task", default=defaults.get("task", "text-classification"))
    task = chosen.parse_known_args(tokens)[0].task
    modules = {task: task_module(task, recipe)} if task in TASKS else {}
    for flag in (t.split("=")[0][2:] for t in tokens if t.startswith("--")):
        serves = TASK_FLAGS.get(flag, ((),))[0]
        if serves and not set(serves) & set(modules):
            modules[serves[0]] = task_module(serves[0], recipe, f"--{flag} serves --task {serves[0]}")
    for name, module in modules.items():
        title = f"--task {name} ({module.__name__.replace('.', '/')}.py)"
        getattr(module, "add_args", lambda _: None)(p.add_argument_group(title))
    if add_recipe_args is not None:
        add_recipe_args(p.add_argument_group("this recipe"))
    for old, (new, value) in RENAMED_FLAGS.items():  # hidden: refused with the new spelling, not 'unrecognized'
        if new in p._option_string_actions and old not in p._option_string_actions:
            p.add_argument(old, dest=f"renamed_{old.lstrip('-')}", type=_renamed_flag(old, new, value),
                           help=argparse.SUPPRESS)
    p.set_defaults(**defaults)
    for action in p._actions:  # argparse prints a default only beside some help text
        if action.help is None and action.option_strings:
            action.help = "default: %(default)s"
    args = p.parse_args(argv)
    for dest, value in vars(args).items():  # a quoted '~/x' reaches us unexpanded: one meaning for every path flag
        setattr(args, dest, expand_user(value))
    seen = {}  # argparse keeps the last silently
    for i, (flag, eq, value) in enumerate(t.partition("=") for t in tokens):
        action = p._option_string_actions.get(flag) if flag.startswith("--") else None
        value = value if eq else tokens[i + 1] if action and action.nargs != 0 and i + 1 < len(tokens) else ""
        if action and seen.setdefault(action.dest, value) != value:
            p.error(f"{flag} is given twice, as {seen[action.dest]} and {value}: only the last counts. Pass it once.")
    # Which flags the user really passed (not defaults): a recipe can then tell a choice from a default when
    # another source (an accelerate config, a DeepSpeed JSON) sets the same thing. argparse fills a default only
    # where the namespace lacks the attribute, so a namespace pre-filled with a marker keeps it for unset flags.
    marker = object()
    probe = p.parse_args(argv, namespace=argparse.Namespace(**{a.dest: marker for a in p._actions}))
    args.explicit_flags = {k for k, v in vars(probe).items() if v is not marker}
    if args.model_preset in DECODERS and not args.model_name_or_path:  # a copy without the decoders says so now
        task_module("decoder-presets", recipe, f"--model_preset {args.model_preset}", "causal-lm")
    for name, (_, default) in TASK_FLAGS.items():  # another task's flags, at their defaults (TASK_FLAGS)
        if not hasattr(args, name):
            setattr(args, name, default)
    # Combinations that would silently do less than asked: a task module's own first (sft's flags for another task).
    for module in modules.values():
        if hasattr(module, "check_args"):
            module.check_args(args, p.error)
    for flag, tasks in READ_BY.items():
        if flag in args.explicit_flags and args.task not in tasks:
            p.error(f"--{flag} serves --task {' and '.join(tasks)}, not --task {args.task}, which would ignore it. "
                    f"Drop it, or pass --task {tasks[0]}.")
    if args.save_total_limit is not None and args.checkpointing_steps is None:
        p.error("--save_total_limit keeps the newest N checkpoints, but none are written without "
                "--checkpointing_steps. Pass --checkpointing_steps N too, or drop --save_total_limit.")
    if args.async_checkpoint and args.checkpointing_steps is None:
        p.error("--async_checkpoint writes checkpoints in the background, but none are written without "
                "--checkpointing_steps. Pass --checkpointing_steps N too, or drop --async_checkpoint.")
    if args.max_train_steps is not None and args.num_warmup_steps >= args.max_train_steps:
        p.error(f"--num_warmup_steps {args.num_warmup_steps} >= --max_train_steps {args.max_train_steps}: the "
                "learning rate would never reach --learning_rate. Lower --num_warmup_steps.")
    # INFO on the main process from here on: where the launch config's and a DeepSpeed JSON's settings came from is
    # logged before the Accelerator exists.
    if not logging.root.handlers:
        handler = _StderrNow()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.root.addHandler(handler)
        logging.root.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    return args  # as typed: values resolved from it (the learning rate, the output dir, ...) are the Launch's


def tasks_package() -> str:
    """The package task modules load from: shared in the repository, recipe_core in a copy. A copy that imports this
    core installed (as accelerate_recipes: `python -m shared.tools.cp` without --vendor) carries its task modules in
    recipe_core/ beside the recipe, and trains with those, as the user edited them; without one, the installed."""
    package = __package__.rsplit(".", 1)[0]  # shared, accelerate_recipes installed, or recipe_core vendored
    if package == "accelerate_recipes" and importlib.util.find_spec("recipe_core") is not None:
        return "recipe_core"
    return package


def task_module(name: str, recipe: str = "", why: str = "", task: str = ""):
    """shared/tasks/<name>.py, by name: a copied recipe carries the task modules it was copied with. `why`: what asked
    for it, where --task did not; `task`: the task it is copied with, where it is not one itself."""
    package = tasks_package()
    module = name.replace("-", "_")
    try:
        return importlib.import_module(f"{package}.tasks.{module}")
    except ModuleNotFoundError as err:
        own = __package__.rsplit(".", 1)[0]
        if package != own and (err.name or "").startswith(f"{package}.") and err.name != f"{package}.tasks.{module}":
            # A linked copy's task module, edited with an import of the vendored layout (`from ..core import data`).
            raise InputError(f"{package}/tasks/{module}.py (or a module it imports) imports {err.name}, which this "
                             "copy does not carry: a copy made without --vendor holds its task modules alone and "
                             f"imports the rest of the core installed. Import {own}{err.name[len(package):]} instead "
                             f"(`from ..core import data` is `from {own}.core import data` there), or copy the recipe "
                             "with --vendor.") from None
        if err.name != f"{package}.tasks.{module}":
            raise
        vendor = " --vendor" if package == own == "recipe_core" else ""  # its folder takes vendored copies alone
        raise InputError(f"{why or '--task ' + name}: this copy carries no {package}/tasks/{module}.py. Copy the "
                         f"recipe again with it: python -m shared.tools.cp {recipe or Path(sys.argv[0]).stem} DEST "
                         f"--task {task or name}{vendor}") from None


class _StderrNow(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record: a notebook or a test harness that swaps sys.stderr between runs
    in one process would otherwise leave the handler on a closed stream ("--- Logging error ---" tracebacks)."""

    @property
    def stream(self):  # noqa: D102
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass
