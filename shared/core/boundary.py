"""The loading boundary: every call that loads or parses what the user gave (a model, config, tokenizer, image
processor, data file or folder, image, checkpoint, DeepSpeed JSON) runs inside `loading(...)`, which turns any
exception into an InputError naming the flag or file, what was found there, and the fix where it is knowable.

The library's exception is chained (`raise ... from err`): `--debug` or RECIPES_DEBUG=1 prints its traceback after
the message (shared/core/launch.py entrypoint). Without it the user sees the message alone, never a raw traceback."""

from __future__ import annotations

import difflib
import json
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import InputError, RecipeError

DEBUG_ENV = "RECIPES_DEBUG"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# What each kind of load expects at its path: a folder (a model, a checkpoint) or a file (a data file).
_FOLDERS = ("model", "config", "tokenizer", "image processor", "checkpoint", "image folder", "saved dataset")


def debugging(argv: list[str] | None = None) -> bool:
    """--debug on the command line, or RECIPES_DEBUG=1: show the chained library traceback after a refusal."""
    import sys

    return "--debug" in (sys.argv[1:] if argv is None else [str(a) for a in argv]) or os.environ.get(
        DEBUG_ENV, "") not in ("", "0")


@contextmanager
def loading(what: str, flag: str | None, path: object) -> Iterator[None]:
    """Run a load of `what` (model, config, tokenizer, image processor, data file, image, checkpoint ...) that
    `flag` fed with `path`. Our own refusals pass through unchanged; any other exception becomes an InputError."""
    try:
        yield
    except RecipeError:
        raise
    except (KeyboardInterrupt, MemoryError):  # not a property of the input
        raise
    except Exception as err:  # noqa: BLE001 (the boundary: whatever a library raises on a user's input)
        raise InputError(explain(what, flag, path, err)) from err


def explain(what: str, flag: str | None, path: object, err: BaseException | None = None) -> str:
    """The message: the flag and path, what is there, the library's own one-line reason, and the fix."""
    name = f"{flag} {str(path)!r}" if flag else str(path)
    found, fix = diagnose(what, None if path is None else str(path))
    if not found and what == "model" and "mismatched_sizes" in str(err):  # (a classifier of other labels: refused
        # earlier, models.load_pretrained_config) the saved tensors are not the shapes config.json describes
        found, fix = ("its weights' shapes differ from the ones config.json describes (a field edited or dropped, "
                      "or the config.json of another model)", "Use the config.json saved with these weights "
                      "(save_pretrained writes both), or the weights of the model that config describes.")
    if not found and what == "config" and isinstance(err, (KeyError, ValueError, TypeError)) and path is not None \
            and (Path(str(path)).expanduser() / "config.json").is_file():  # read, then refused by the config's class
        found, fix = ("config.json is there, and its config class refuses one of its fields (a hand edit, or a "
                      "field written by another version of Transformers)", "Fix the field the reason names in "
                      "config.json (or use the config.json saved with these weights).")
    reason = ""
    if err is not None:
        cause = err.__cause__ if isinstance(err, InputError) and err.__cause__ else err
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        reason = f" ({type(cause).__name__}: {first[:200]}{'...' if len(first) > 200 else ''})"
    fix = fix or _default_fix(what, flag)
    debug = f" (--debug or {DEBUG_ENV}=1 shows the library's traceback.)" if err is not None else ""
    return f"{name}: could not load the {what}{': ' + found if found else ''}{reason}. {fix}{debug}"


def _default_fix(what: str, flag: str | None) -> str:
    if what in ("model", "config", "tokenizer", "image processor"):
        return (f"Pass {flag or '--model_name_or_path'} a directory saved with save_pretrained (config.json, weights, "
                "tokenizer or preprocessor files) or a hub id, or leave --model_name_or_path unset for --model_preset.")
    if what == "checkpoint":
        return "Pass a checkpoint directory (<output_dir>/checkpoints/step_N) or 'latest'."
    if what == "image":
        return "Remove or replace the file (save it again as PNG or JPEG)."
    if what == "DeepSpeed JSON":
        return ("Pass a JSON file of DeepSpeed settings, e.g. accelerate_configs/ds_config_zero3_auto.json (JSON "
                "allows no comments or trailing commas: python -m json.tool FILE shows where it breaks).")
    return "Fix or replace the file; csv, tsv, json/jsonl (also .gz), parquet and txt are read."


def diagnose(what: str, path: str | None) -> tuple[str, str]:
    """(what is at `path`, the fix) for the usual mistakes of each class; ("", "") when nothing is known."""
    if not path:
        return "", ""
    p = Path(path).expanduser()
    wants_folder = what in _FOLDERS
    if not p.exists():
        if not path.startswith(("/", ".", "~")) and "/" in path and what in ("model", "config", "tokenizer",
                                                                             "image processor", "dataset"):
            return ("no such local path, and the hub did not serve it (offline, a typo, or private)",
                    "Check the id and the network (HF_HUB_OFFLINE=1 forbids downloads), or pass a local directory.")
        return "it does not exist", _near_miss(p) or f"Pass an existing path (relative to {Path.cwd()})."
    if p.is_file() and p.stat().st_size == 0:
        return "the file is empty (0 bytes)", "Pass the file with its content (an interrupted copy or download?)."
    if p.is_file() and wants_folder:
        return ("it is a file, and a folder is expected",
                f"Pass the folder that holds it: {str(p.parent)!r}." if (p.parent / "config.json").exists()
                or what == "checkpoint" else "Pass a folder.")
    if p.is_dir() and what in ("data file", "DeepSpeed JSON"):
        files = sorted(x.name for x in p.iterdir() if x.is_file() and (what == "data file" or x.suffix == ".json"))[:5]
        return "it is a folder, and a file is expected", (f"Pass one of its files ({files})." if files
                                                          else f"Pass a {what}.")
    if p.is_dir():
        return _folder_kind(p, what)
    return "", ""


def _folder_kind(p: Path, what: str) -> tuple[str, str]:
    """A folder of another kind than the load expects: an adapter, a checkpoint, a saved dataset, a model."""
    adapter = p / "adapter_config.json"
    if adapter.exists() and what != "checkpoint":
        base = _json(adapter).get("base_model_name_or_path")
        if (p / "config.json").exists() and any((p / w).exists() for w in _WEIGHTS):  # a merged model, left beside
            return (f"it holds a whole model and a PEFT adapter (adapter_config.json): Transformers would load the "
                    f"adapter's base{f' ({base!r})' if base else ''} with the adapter, not this folder's model",
                    "Move adapter_config.json and adapter_model.* out of it to train the folder's model, or pass the "
                    "adapter's base as --model_name_or_path.")
        return ("a PEFT adapter (LoRA weights only), not a whole model",
                f"Pass its base model as --model_name_or_path{f' ({base!r})' if base else ''}; to train on from "
                "the adapter, merge it first: PeftModel.from_pretrained(base, dir).merge_and_unload()"
                ".save_pretrained(out).")
    is_checkpoint = (p / "manifest.json").exists() or (p / "trainer_state.json").exists() or (
        re.fullmatch(r"step_\d+", p.name) and p.parent.name == "checkpoints")
    if is_checkpoint and what != "checkpoint":
        run = p.parent.parent
        return ("a training checkpoint (optimizer and data position), not a saved model",
                f"Pass the finished run's folder {str(run)!r} (its model.safetensors), or continue the run with "
                f"--resume_from_checkpoint {str(p)!r} --output_dir {str(run)!r}.")
    if what == "checkpoint" and (steps := sorted((p / "checkpoints" if (p / "checkpoints").is_dir() else p)
                                                 .glob("step_*"))):  # a run's folder, or its checkpoints/: too high
        run = steps[-1].parent.parent
        return (f"a folder of {len(steps)} checkpoint(s), not one checkpoint", f"Pass one of them (the newest: "
                f"{str(steps[-1])!r}), or --resume_from_checkpoint latest --output_dir {str(run)!r}.")
    if what == "checkpoint" and (p / "config.json").exists() and any((p / w).exists() for w in _WEIGHTS):
        return ("a saved model (a finished run's output), not a checkpoint: it has weights but no optimizer or data "
                "position", f"To train it further pass --model_name_or_path {str(p)!r}; to resume a run, pass its "
                "<output_dir>/checkpoints/step_N or 'latest'.")
    if (p / "dataset_dict.json").exists() or (p / "state.json").exists() and (p / "dataset_info.json").exists():
        return ("a dataset saved with save_to_disk", "It is read with datasets.load_from_disk: pass it as "
                "--dataset_name (these recipes load such folders), or save it as files (ds.to_json(path)).")
    if what in ("model", "config") and (p / "config.json").exists() and not any((p / w).exists() for w in _WEIGHTS):
        if what == "model":
            return "config.json but no weights (model.safetensors or pytorch_model.bin)", \
                "Copy the weights beside config.json, or save the model again with save_pretrained."
    if what in ("model", "config") and not (p / "config.json").exists():
        inner = sorted(x.name for x in p.iterdir() if x.is_dir() and (x / "config.json").exists())
        return "no config.json in it", (f"The model is in a subfolder: pass {str(p / inner[0])!r}." if inner else
                                        "Pass the folder save_pretrained wrote (it holds config.json).")
    return "", ""


def _near_miss(p: Path) -> str:
    """'Did you mean ...?' from the nearest existing ancestor's entries."""
    parent = p.parent
    missing = [p.name]
    while not parent.exists() and parent != parent.parent:
        missing.insert(0, parent.name)
        parent = parent.parent
    if not parent.is_dir():
        return ""
    names = [x.name for x in parent.iterdir()]
    near = difflib.get_close_matches(missing[0], names, n=1, cutoff=0.6)
    if near:
        return f"Did you mean {str(parent / near[0] / Path(*missing[1:])) if missing[1:] else str(parent / near[0])!r}?"
    return ""


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def expand_user(value: object) -> object:
    """A path flag's value with a leading ~ expanded: a quoted '~/x' reaches Python unexpanded, and the lock, the
    model and the results would otherwise go to different places ($HOME/x and ./~/x)."""
    if isinstance(value, str) and (value == "~" or value.startswith("~/")):
        return os.path.expanduser(value)
    return value
