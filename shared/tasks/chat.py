"""Chat and instruction data for --task sft (shared/tasks/sft.py): the layouts, the row checks, the chat template,
the target mask, and whole-conversation packing.

The mask does not read generation markers (many templates have none). Each conversation is rendered one turn at a
time: the tokens an assistant turn adds, after the generation prompt that introduces it, are its targets (the
answer and whatever end-of-turn tokens the template writes after it). A template whose rendering of a prefix is
not a prefix of the next rendering is refused: its mask could not be trusted.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import InputError

ROLES = ("system", "user", "assistant")
TOOL_ROLES = ("tool", "function", "ipython")
# For a tokenizer without a template (the presets' word-level one, GPT-2's): each turn on its own line under a role
# header; the answer ends with the tokenizer's EOS, which generation stops at.
BUILTIN_TEMPLATE = ("{{- bos_token if bos_token else '' }}{%- for message in messages %}"
                    "{{- '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}{%- endfor %}"
                    "{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}")
_SHOWN = 5


@dataclass(frozen=True)
class Layout:
    kind: str  # messages | conversational prompt/completion | prompt/completion | text
    columns: tuple[str, ...]  # messages: (col,); prompt/completion: (*prompt cols, completion col); text: (col,)


# Columns of the instruction layouts datasets ship (Alpaca, Dolly, OpenOrca, GSM8K, MetaMath ...), in the order
# their parts are read: a layout the guesses miss gets the flags that name its columns.
PROMPT_NAMES = ("system_prompt", "instruction", "question", "query", "problem", "context", "input")
ANSWER_NAMES = ("output", "response", "answer", "solution", "completion")


def _named_layout(columns: list[str]) -> str:
    """The flags for the columns found, in words ('' when none of the known names are there)."""
    if {"chosen", "rejected"} <= set(columns):  # DPO-style pairs: sft learns one answer, the chosen one
        prompt = "--prompt_column prompt --completion_column chosen" if "prompt" in columns else (
            "--messages_column chosen")
        return (f" (these are preference pairs, chosen/rejected, for DPO: sft trains on demonstrations; to train the "
                f"chosen answers: {prompt})")
    prompts = [c for c in PROMPT_NAMES if c in columns]
    answer = next((c for c in ANSWER_NAMES if c in columns), None)
    if prompts and answer:
        return f" (here: --prompt_column {','.join(prompts)} --completion_column {answer})"
    return ""


def pick_layout(columns: list[str], args) -> Layout:
    """The layout from the columns, or from the flags that name them; two layouts and no choice are refused."""
    given = {"messages": args.messages_column, "prompt/completion": args.prompt_column or args.completion_column,
             "text": args.text_column}
    chosen = [k for k, v in given.items() if v]
    if len(chosen) > 1:
        raise InputError(f"--messages_column, --prompt_column/--completion_column and --text_column choose a layout "
                         f"each; {', '.join(chosen)} were given. Pass the flags of one layout.")
    # ShareGPT-style data names its column "conversations" (its from/value turns are then refused with the renaming)
    conversations = next((c for c in ("messages", "conversations") if c in columns), None)
    found = {"messages": conversations is not None, "prompt/completion": {"prompt", "completion"} <= set(columns),
             "text": "text" in columns}
    kind = chosen[0] if chosen else None
    if kind is None:
        present = [k for k, v in found.items() if v]
        if len(present) > 1:
            raise InputError(f"The data has columns for {' and '.join(present)} ({columns}): which one to train is "
                             "a choice. Pass --messages_column messages, --prompt_column prompt, or --text_column "
                             "text.")
        if not present:
            raise InputError(f"Found no sft columns among {columns}: a 'messages' (or 'conversations') column of "
                             "conversations, 'prompt' and 'completion' columns, or a 'text' column. Pass "
                             f"--messages_column, --prompt_column with --completion_column{_named_layout(columns)}, "
                             "or --text_column.")
        kind = present[0]
    if kind == "prompt/completion":
        prompts = tuple(c.strip() for c in (args.prompt_column or "prompt").split(","))
        cols = (*prompts, args.completion_column or "completion")
    else:
        cols = (given[kind] or (conversations if kind == "messages" else kind),)
    if missing := [c for c in cols if c not in columns]:
        flag = {"messages": "--messages_column", "text": "--text_column"}.get(kind, "--prompt_column or "
                                                                                 "--completion_column")
        raise InputError(f"{flag}: the data has no column {missing} (columns: {columns}). Pass {flag} naming one.")
    return Layout(kind, cols)


def _rows_named(indices: list[int]) -> str:
    shown = ", ".join(str(i + 1) for i in indices[:_SHOWN])
    return f"{shown} and {len(indices) - _SHOWN} more" if len(indices) > _SHOWN else shown


def _turn_problem(turn: object) -> str | None:
    """What is wrong with one {role, content} turn, as a key of PROBLEMS (None: nothing)."""
    if not isinstance(turn, dict):
        return "not_dict"
    extra = [k for k, v in turn.items() if k not in ("role", "content") and v not in (None, [], "")]
    if "tool_calls" in extra or turn.get("role") in TOOL_ROLES:
        return "tool"
    if "from" in turn and "value" in turn:
        return "sharegpt"
    if not isinstance(turn.get("role"), str):
        return "no_role"
    if turn["role"] not in ROLES:
        return "developer" if turn["role"] == "developer" else "unknown_role"
    if extra:
        return "extra_keys"
    content = turn.get("content")
    if isinstance(content, list):
        return "parts"
    if not isinstance(content, str):
        return "not_text"
    if turn["role"] == "assistant" and not content.strip():
        return "empty_answer"
    return None


PROBLEMS = {  # key: (what, the fix)
    "not_list": ("is not a list of turns", "store each conversation as a JSON list of {\"role\", \"content\"} "
                 "objects (a JSON string must be parsed first: json.loads)"),
    "empty": ("has no turns", "remove the row"),
    "not_dict": ("holds a turn that is not a {role, content} object", "write every turn as {\"role\": ..., "
                 "\"content\": ...}"),
    "sharegpt": ("uses ShareGPT's from/value keys", "rename them to role/content (human -> user, gpt -> assistant)"),
    "no_role": ("holds a turn without a string 'role'", "give every turn a role: system, user or assistant"),
    "unknown_role": ("holds a role other than system, user, assistant", "map it to one of them (the template "
                     "would drop or mangle it)"),
    "developer": ("holds OpenAI's 'developer' role (its newer name for the system prompt), which chat templates do "
                  "not know", "rename it to system"),
    "tool": ("holds a tool call or a tool turn (tool_calls, role tool/function/ipython)", "remove those turns; tool "
             "use is not trained by this task"),
    "extra_keys": ("holds turn keys other than role and content (name, weight, ...)", "drop them: they would be "
                   "ignored silently"),
    "parts": ("holds content that is a list of parts (multimodal)", "flatten it to one string per turn; images are "
              "not trained by this task"),
    "not_text": ("holds content that is not a string (null, a number, an object)", "give every turn string content"),
    "empty_answer": ("holds an assistant turn with empty content", "fill it or remove the turn (an empty answer "
                     "would teach the model to say nothing)"),
    "no_assistant": ("has no assistant turn: nothing to learn", "add the answer or remove the row"),
    "ends_user": ("ends on a user or system turn, which no answer follows", "end every conversation on an assistant "
                  "turn (or drop the last turn)"),
    "not_string": ("is not a string", "store text (the prompt and completion as strings, or both as lists of turns)"),
    "mixed": ("mixes a conversational prompt (a list of turns) with a string completion, or the reverse",
              "store both as lists of turns, or both as strings"),
    "empty_completion": ("has an empty completion", "fill it or remove the row"),
}


def _conversation_problems(turns: object, trained_from: int = 0) -> str | None:
    if not isinstance(turns, list):
        return "not_list"
    if not turns:
        return "empty"
    for turn in turns:
        if problem := _turn_problem(turn):
            return problem
    roles = [t["role"] for t in turns]
    if "assistant" not in roles[trained_from:]:
        return "no_assistant"
    return "ends_user" if roles[-1] != "assistant" else None


def rows(split, layout: Layout, name: str) -> list[dict]:
    """Every row checked and brought to one form: {"messages", "trained_from"} (conversations: the turns, and the
    first that can be a target), {"prompt", "completion"} (strings) or {"text"}; "row" is the source's row index.
    One pass over every row; the refusal names each kind of problem, its rows, and the fix."""
    found: dict[str, list[int]] = {}
    out: list[dict] = []
    columns = {c: list(split[c]) for c in layout.columns}
    if not columns[layout.columns[0]]:
        raise InputError(f"The {name} data has no rows. Pass a file with rows.")
    for i in range(len(columns[layout.columns[0]])):
        problem, row = None, {"row": i}
        if layout.kind == "messages":
            turns = columns[layout.columns[0]][i]
            problem = _conversation_problems(turns)
            row.update(messages=turns, trained_from=0)
        elif layout.kind == "text":
            text = columns[layout.columns[0]][i]
            problem = None if isinstance(text, str) or text is None else "not_string"
            row.update(text=text or "")
        else:
            parts, completion = [columns[c][i] for c in layout.columns[:-1]], columns[layout.columns[-1]][i]
            if len(parts) == 1 and isinstance(parts[0], list) or isinstance(completion, list):
                if not (len(parts) == 1 and isinstance(parts[0], list) and isinstance(completion, list)):
                    problem = "mixed"
                else:  # conversational prompt/completion: the completion's assistant turns are the targets
                    problem = _conversation_problems(parts[0] + completion, trained_from=len(parts[0]))
                    row.update(messages=parts[0] + completion, trained_from=len(parts[0]))
            elif any(p is not None and not isinstance(p, str) for p in parts) or not isinstance(completion, str):
                problem = "not_string"
            elif not completion.strip():
                problem = "empty_completion"
            else:
                row.update(prompt="\n\n".join(p for p in parts if p), completion=completion)
        if problem:
            found.setdefault(problem, []).append(i)
        out.append(row)
    if found:
        what = "column " + "/".join(repr(c) for c in layout.columns)
        raise InputError(f"The {name} data ({layout.kind}, {what}) cannot be trained as it is: " + " ".join(
            f"row {_rows_named(ix)} {PROBLEMS[k][0]}: {PROBLEMS[k][1]}." for k, ix in found.items())
            + " Rows are counted from 1.")
    if layout.kind == "prompt/completion" and len({"messages" in r for r in out}) > 1:
        raise InputError(f"The {name} data mixes conversational prompt/completion rows (lists of turns) with string "
                         "ones. Store every row one way.")
    return out


def resolved(layout: Layout, rows: list[dict]) -> Layout:
    """Prompt/completion data is conversational when its cells are lists of turns (the rows say which)."""
    if layout.kind == "prompt/completion" and rows and "messages" in rows[0]:
        return Layout("conversational prompt/completion", layout.columns)
    return layout


def plain_text(row: dict) -> str:
    """The row's words, for training a preset's word-level tokenizer."""
    if "messages" in row:
        return " ".join(f"<|{t['role']}|> {t['content']}" for t in row["messages"])
    return row.get("text") or f"{row['prompt']} {row['completion']}"


def set_template(tokenizer, path: str | None, layout: Layout) -> str:
    """Set the chat template the run uses on the tokenizer (saved with it); say which."""
    if path:
        if not Path(path).is_file():
            raise InputError(f"--chat_template {path!r} is not a file. Pass a Jinja template file (for example a "
                             "model's chat_template.jinja).")
        if layout.kind != "messages":  # TRL's way too: only conversations are templated
            raise InputError(f"--chat_template renders conversations, and this data is {layout.kind} strings "
                             f"(columns {list(layout.columns)}), which are tokenized as they are. Drop "
                             "--chat_template, or store each row as a 'messages' list of {role, content} turns.")
        tokenizer.chat_template = Path(path).read_text()
        return _rendered(tokenizer, f"--chat_template {path}")
    if tokenizer.chat_template:
        return _rendered(tokenizer, "the tokenizer's own") if layout.kind == "messages" else "the tokenizer's own"
    if layout.kind in ("prompt/completion", "text"):
        return "none (string prompt/completion and text are not templated)"
    if tokenizer.eos_token is None:
        raise InputError("The tokenizer has no chat template and no eos_token, so no answer could end. Pass "
                         "--chat_template FILE.")
    tokenizer.chat_template = BUILTIN_TEMPLATE
    return "built-in plain template (shared/tasks/chat.py BUILTIN_TEMPLATE)"


def _rendered(tokenizer, source: str) -> str:
    """The template renders a plain exchange, or is refused before any row is encoded (a Jinja syntax error, or a
    template that raises, came out of the first row's encoding as a raw traceback)."""
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
                                      tokenize=False)
    except Exception as err:  # noqa: BLE001  (jinja2's TemplateSyntaxError, TemplateError, ...: the detail is shown)
        where = f" (line {err.lineno})" if getattr(err, "lineno", None) else ""
        raise InputError(f"The chat template ({source}) cannot render a user and an assistant turn{where}: "
                         f"{type(err).__name__}: {err}. Fix the template, or pass --chat_template FILE with one "
                         "that renders.") from err
    return source


class Encoder:
    """Token ids and labels (-100: no target) of each row, cut to `max_len` at the end."""

    def __init__(self, tokenizer, max_len: int, train_on_prompt: bool):
        self.tok, self.max_len, self.everything = tokenizer, max_len, train_on_prompt

    def ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False, verbose=False)["input_ids"]

    def render(self, turns: list[dict], generation: bool = False) -> list[int]:
        return self.ids(self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation))

    def conversation(self, row: dict) -> tuple[list[int], list[bool]]:
        """Ids and the target flag of each: the turns rendered one at a time, each rendering extending the last."""
        turns, ids, target = row["messages"], [], []
        for k, turn in enumerate(turns):
            answer = turn["role"] == "assistant" and k >= row["trained_from"]
            head = self.render(turns[:k], generation=True) if answer else ids
            full = self.render(turns[:k + 1])
            for before, what in ((ids, f"the first {k} turns"), (head, f"the first {k} turns and the generation "
                                                                         "prompt")):
                if full[:len(before)] != before:
                    raise InputError(
                        f"Row {row['row'] + 1}: the chat template renders {what} differently once turn {k + 1} "
                        f"({turn['role']}) is added (token {_first_difference(before, full)} differs), so the loss "
                        "mask cannot be trusted. Pass --chat_template FILE with a template whose every rendering "
                        "of a conversation starts with the rendering of its first turns.")
            target += [False] * (len(head) - len(ids)) + [answer] * (len(full) - len(head))
            ids = full
        return ids, target

    def encode(self, row: dict) -> tuple[list[int], list[bool]]:
        bos = [self.tok.bos_token_id] if self.tok.bos_token_id is not None else []
        if "messages" in row:
            return self.conversation(row)
        if "prompt" in row:  # as TRL tokenizes them: apart, EOS after the completion
            prompt, answer = bos + self.ids(row["prompt"]), self.ids(row["completion"]) + [self.tok.eos_token_id]
            return prompt + answer, [False] * len(prompt) + [True] * len(answer)
        ids = bos + self.ids(row["text"]) + [self.tok.eos_token_id] if row["text"].strip() else []
        return ids, [True] * len(ids)

    def all(self, rows: list[dict], name: str, refuse_long_prompts: bool) -> tuple[list[dict], dict[str, int]]:
        """The samples, and the rows dropped by reason. A training prompt that alone fills max_len is refused."""
        from jinja2 import TemplateError

        out, dropped, long, refused = [], {}, [], {}
        for row in rows:
            try:
                ids, target = self.encode(row)
            except TemplateError as err:  # raise_exception(...) in the template: roles must alternate, no system ...
                refused.setdefault(f"{type(err).__name__}: {err}", []).append(row["row"])
                continue
            if self.everything:
                target = [True] * len(ids)
            first = next((i for i, t in enumerate(target) if t and i > 0), None)
            if first is not None and first >= self.max_len:
                long.append((row["row"], first))
            labels = [i if t and n > 0 else -100 for n, (i, t) in enumerate(zip(ids, target, strict=True))]
            ids, labels = ids[:self.max_len], labels[:self.max_len]
            if all(x == -100 for x in labels):
                reason = "empty text" if not ids else "no target token left within --max_seq_length"
                dropped[reason] = dropped.get(reason, 0) + 1
                continue
            out.append({"input_ids": ids, "labels": labels, "truncated": len(target) > self.max_len})
        if refused:  # the template's own words, with the rows: one refusal for every row, before any step
            said = "; ".join(f"row {_rows_named(sorted(ix))} ({why})" for why, ix in refused.items())
            raise InputError(f"The chat template refuses the {name} data's {said}. Rows are counted from 1. Fix "
                             "those rows as the template asks (merge consecutive turns of one role; fold a system "
                             "turn into the first user turn), or pass --chat_template FILE with a template that "
                             "accepts them.")
        if long and refuse_long_prompts:
            rows_, need = [r for r, _ in long], max(n for _, n in long) + 1
            raise InputError(f"The {name} data's row {_rows_named(rows_)}: the prompt alone fills --max_seq_length "
                             f"{self.max_len} (it is {long[0][1]} tokens or more), leaving no answer to learn. Pass "
                             f"--max_seq_length {need} or more, or shorten or remove those rows.")
        return out, dropped

    def prompt(self, row: dict) -> dict:
        """What --generate answers: the turns before the first trained answer, with the generation prompt."""
        if "messages" in row:
            k = next(k for k, t in enumerate(row["messages"]) if t["role"] == "assistant" and k >= row["trained_from"])
            ids = self.render(row["messages"][:k], generation=True)
            reference = row["messages"][k]["content"]
        else:
            ids = ([self.tok.bos_token_id] if self.tok.bos_token_id is not None else []) + self.ids(row["prompt"])
            reference = row["completion"]
        normal = self.tok.decode(self.ids(reference), skip_special_tokens=True).strip()  # as the tokenizer spells it
        return {"ids": ids[-self.max_len:], "text": self.tok.decode(ids), "reference": normal}


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))) + 1


def pack(samples: list[dict], block: int, pad_id: int) -> list[dict]:
    """Whole conversations into blocks of `block` tokens (best fit, longest first); position ids restart at each,
    the block's end padded. A conversation is never split, so it attends only to itself (packing.py's mask)."""
    order = sorted(range(len(samples)), key=lambda i: (-len(samples[i]["input_ids"]), i))
    blocks: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (space left, block), sorted
    for i in order:
        n = len(samples[i]["input_ids"])
        j = bisect.bisect_left(free, (n, -1))
        if j == len(free):
            blocks.append([i])
            bisect.insort(free, (block - n, len(blocks) - 1))
        else:
            space, b = free.pop(j)
            blocks[b].append(i)
            bisect.insort(free, (space - n, b))
    out = []
    for members in blocks:
        ids, labels, positions = [], [], []
        for i in members:
            ids += samples[i]["input_ids"]
            labels += samples[i]["labels"]
            positions += list(range(len(samples[i]["input_ids"])))
        real, pad = len(ids), block - len(ids)
        # padding continues the last conversation's positions: it follows it, unseen and never a target
        out.append({"input_ids": ids + [pad_id] * pad, "labels": labels + [-100] * pad,
                    "attention_mask": [1] * real + [0] * pad,
                    "position_ids": positions + list(range(positions[-1] + 1, positions[-1] + 1 + pad))})
    return out


def as_dataset(samples: list[dict]):
    """A plain list serves as a map-style dataset; the loop's figures read only its length."""
    return [{k: v for k, v in s.items() if k != "truncated"} for s in samples]


# ---------------------------------------------------------------- the built-in instruction set
_WORDS = ("red green blue black white brown cat dog bird fox horse mouse owl wolf one two three four five six seven "
          "eight nine ten").split()
SYSTEM = "you reverse the order of the words you are given ."


def reverse_words(n: int, seed: int) -> dict[str, list]:
    """Conversations with a system turn: reverse 3 to 5 words; a third have a second exchange. Exact answers."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": SYSTEM}]
        for _ in range(1 + (rng.random() < 0.3)):
            words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 5))]
            turns += [{"role": "user", "content": "reverse : " + " ".join(words)},
                      {"role": "assistant", "content": " ".join(reversed(words))}]
        out.append(turns)
    return {"messages": out}
