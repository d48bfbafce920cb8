"""--task sft: the layouts, the row checks, the chat template, the mask on the answers, packing, and runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from shared.core.errors import InputError
from shared.tasks import chat
from tests.conftest import launch, load_params, max_param_diff, run_recipe

TEMPLATES = Path(__file__).parent / "chat_templates"
# Llama 3 and ChatML (Qwen2.5): the end-of-turn text each writes after an answer, which must be a target too.
END_OF_TURN = {"llama3": "<|eot_id|>", "chatml_qwen25": "<|im_end|>\n"}
SPECIALS = {"llama3": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                       "<|eot_id|>"],
            "chatml_qwen25": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
CONVERSATIONS = [
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital of France."},
     {"role": "user", "content": "And of Italy?\nBe brief."},
     {"role": "assistant", "content": "Rome."},
     {"role": "user", "content": "Thanks!"},
     {"role": "assistant", "content": "You are welcome; ask again any time."}],
    [{"role": "system", "content": "Reply with numbers."}, {"role": "user", "content": "2 + 2"},
     {"role": "assistant", "content": "4"}],
    [{"role": "user", "content": "No system turn here."}, {"role": "assistant", "content": "Fine, then."},
     {"role": "user", "content": "Two words?"}, {"role": "assistant", "content": "Two words."}],
]


def byte_level_tokenizer(name: str):
    """A byte-level BPE trained here (newlines are tokens, as in Llama 3's and Qwen's), with the template's specials
    and the template set: what a hub tokenizer of that family looks like, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [t["content"] for c in CONVERSATIONS for t in c] + ["assistant user system"] * 3
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS[name],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bos, eos = SPECIALS[name][0], SPECIALS[name][-1 if name == "llama3" else 0]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos if name == "llama3" else None, eos_token=eos,
                                   pad_token=SPECIALS[name][1] if name == "llama3" else eos)
    fast.chat_template = (TEMPLATES / f"{name}.jinja").read_text()
    return fast


def reference_mask(tok, turns: list[dict]) -> list[bool]:
    """The target tokens from strings alone: each assistant turn's characters are what rendering it adds after the
    generation prompt; a token is a target when its first character is one of them (offsets of the fast tokenizer)."""
    full = tok.apply_chat_template(turns, tokenize=False)
    spans = []
    for k, t in enumerate(turns):
        if t["role"] == "assistant":
            head = tok.apply_chat_template(turns[:k], tokenize=False, add_generation_prompt=True) if k else ""
            upto = tok.apply_chat_template(turns[:k + 1], tokenize=False)
            assert full.startswith(upto) and upto.startswith(head)
            spans.append((len(head), len(upto)))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    return [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]


@pytest.mark.parametrize("name", ["llama3", "chatml_qwen25"])
def test_mask_equals_reference_by_rendered_prefixes(name):
    tok = byte_level_tokenizer(name)
    encoder = chat.Encoder(tok, max_len=10_000, train_on_prompt=False)
    for turns in CONVERSATIONS:
        samples, dropped = encoder.all([{"row": 0, "messages": turns, "trained_from": 0}], "training", True)
        ids, labels = samples[0]["input_ids"], samples[0]["labels"]
        assert ids == tok(tok.apply_chat_template(turns, tokenize=False), add_special_tokens=False)["input_ids"]
        assert [x != -100 for x in labels] == reference_mask(tok, turns), name
        # Every answer, and the end-of-turn text after it (the model learns to stop), and nothing else.
        targets = [i for i, x in zip(ids, labels, strict=True) if x != -100]
        answers = "".join(t["content"] + END_OF_TURN[name] for t in turns if t["role"] == "assistant")
        assert tok.decode(targets) == answers
        assert not dropped


def test_system_turn_is_kept_and_train_on_prompt_counts_everything():
    tok = byte_level_tokenizer("chatml_qwen25")
    row = {"row": 0, "messages": CONVERSATIONS[0], "trained_from": 0}
    ids = chat.Encoder(tok, 10_000, False).encode(row)[0]
    assert "You answer in one short sentence." in tok.decode(ids)
    everything = chat.Encoder(tok, 10_000, True).all([row], "training", True)[0][0]["labels"]
    assert everything[0] == -100 and all(x != -100 for x in everything[1:])


def _args(**flags) -> argparse.Namespace:
    base = dict(messages_column=None, prompt_column=None, completion_column=None, text_column=None)
    return argparse.Namespace(**{**base, **flags})


def _turn(role, content):
    return {"role": role, "content": content}


GOOD = [_turn("user", "hi"), _turn("assistant", "hello")]
BAD_ROWS = {  # a bad conversation, and words its refusal must hold
    "unknown role": ([_turn("narrator", "x"), *GOOD], "role other than system, user, assistant"),
    "no assistant turn": ([_turn("system", "s"), _turn("user", "hi")], "no assistant turn"),
    "ends on a user turn": ([*GOOD, _turn("user", "more?")], "ends on a user or system turn"),
    "empty answer": ([_turn("user", "hi"), _turn("assistant", "  ")], "empty content"),
    "content parts": ([_turn("user", [{"type": "text", "text": "hi"}]), GOOD[1]], "list of parts"),
    "tool call": ([GOOD[0], {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]}], "tool call"),
    "tool turn": ([*GOOD, _turn("tool", "42"), _turn("assistant", "ok")], "tool call"),
    "non-string content": ([_turn("user", 42), GOOD[1]], "not a string"),
    "null content": ([_turn("user", None), GOOD[1]], "not a string"),
    "missing role": ([{"content": "hi"}, GOOD[1]], "without a string 'role'"),
    "sharegpt keys": ([{"from": "human", "value": "hi"}, GOOD[1]], "ShareGPT"),
    "extra keys": ([{**GOOD[0], "weight": 0}, GOOD[1]], "other than role and content"),
    "a turn that is a string": (["hi", GOOD[1]], "not a {role, content} object"),
    "a JSON string, not a list": (json.dumps(GOOD), "not a list of turns"),
    "no turns": ([], "has no turns"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_conversation_is_refused_naming_the_row(case):
    """One check over every row: the refusal names the row (counted from 1), the problem, and the fix."""
    bad, words = BAD_ROWS[case]
    split = {"messages": [GOOD, GOOD, bad, GOOD]}
    with pytest.raises(InputError) as err:
        chat.rows(split, chat.pick_layout(["messages"], _args()), "training")
    assert "row 3 " in str(err.value) and words in str(err.value), str(err.value)


def test_every_bad_row_is_named_in_one_refusal():
    split = {"messages": [GOOD, [_turn("user", "hi")], GOOD, [_turn("user", "hi")], [*GOOD, _turn("bot", "x")]]}
    with pytest.raises(InputError) as err:
        chat.rows(split, chat.pick_layout(["messages"], _args()), "training")
    assert "row 2, 4 " in str(err.value) and "row 5 " in str(err.value)


@pytest.mark.parametrize("columns,flags,words", [
    (["messages", "text"], {}, "which one to train is a choice"),
    (["prompt", "completion", "text"], {}, "which one to train is a choice"),
    (["instruction", "input", "output"], {}, "--prompt_column instruction,input --completion_column output"),
    (["messages"], {"text_column": "text", "messages_column": "messages"}, "Pass the flags of one layout"),
    (["messages"], {"messages_column": "chat"}, "no column ['chat']"),
])
def test_layout_refusals(columns, flags, words):
    with pytest.raises(InputError) as err:
        chat.pick_layout(columns, _args(**flags))
    assert words in str(err.value), str(err.value)


def test_prompt_completion_layouts_and_their_type_errors():
    layout = chat.pick_layout(["instruction", "input", "output"], _args(prompt_column="instruction,input",
                                                                          completion_column="output"))
    rows = chat.rows({"instruction": ["Add", "Say hi"], "input": ["2 and 3", ""], "output": ["5", "hi"]}, layout,
                     "training")
    assert rows[0]["prompt"] == "Add\n\n2 and 3" and rows[1]["prompt"] == "Say hi"  # an empty input is left out
    conv = chat.rows({"prompt": [[GOOD[0]]], "completion": [[GOOD[1]]]}, chat.pick_layout(["prompt", "completion"],
                                                                                          _args()), "training")
    assert conv[0]["messages"] == GOOD and conv[0]["trained_from"] == 1
    for prompt, completion, words in [([GOOD[0]], "hello", "mixes a conversational prompt"),
                                      ("hi", 5, "is not a string"), ("hi", " ", "empty completion")]:
        with pytest.raises(InputError, match=words):
            chat.rows({"prompt": ["a", prompt], "completion": ["b", completion]},
                      chat.pick_layout(["prompt", "completion"], _args()), "training")


def test_template_that_is_not_prefix_stable_is_refused():
    tok = byte_level_tokenizer("chatml_qwen25")
    # Marks the last turn differently from the others: rendering a prefix is then no prefix of the next rendering.
    tok.chat_template = ("{%- for m in messages %}{{ '<|im_start|>' + m.role + ('*' if loop.last else '') + '\n' + "
                         "m.content + '<|im_end|>\n' }}{%- endfor %}")
    with pytest.raises(InputError, match="mask cannot be trusted"):
        chat.Encoder(tok, 10_000, False).encode({"row": 6, "messages": CONVERSATIONS[0], "trained_from": 0})


def test_prompt_that_fills_max_seq_length_is_refused_and_cut_answers_are_kept():
    tok = byte_level_tokenizer("llama3")
    encoder = chat.Encoder(tok, max_len=20, train_on_prompt=False)  # the prompts: 34, 27 and 17 tokens
    with pytest.raises(InputError, match=r"row 2: the prompt alone fills --max_seq_length 20.*--max_seq_length 35 "):
        encoder.all([{"row": 0, "messages": CONVERSATIONS[2], "trained_from": 0},
                     {"row": 1, "messages": CONVERSATIONS[0], "trained_from": 0}], "training", True)
    # In the validation split the same row is dropped and counted, never scored as a zero-loss row.
    kept, dropped = encoder.all([{"row": 1, "messages": CONVERSATIONS[0], "trained_from": 0}], "validation", False)
    assert not kept and dropped == {"no target token left within --max_seq_length": 1}
    long = chat.Encoder(tok, max_len=40, train_on_prompt=False)
    sample = long.all([{"row": 0, "messages": CONVERSATIONS[0], "trained_from": 0}], "training", True)[0][0]
    full = tok.apply_chat_template(CONVERSATIONS[0], tokenize=False)
    assert sample["truncated"] and tok.decode(sample["input_ids"]) == tok.decode(tok(full, add_special_tokens=False)[
        "input_ids"][:40])  # the end is cut, the start (with the system turn) kept


def test_packed_equals_unpacked_per_conversation():
    """Whole conversations packed into blocks, each attending only to itself: every conversation's summed target
    loss equals its loss alone, padded, within 1e-5."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from shared.core.losses import causal_lm_loss
    from shared.tasks.packing import per_document_inputs

    tok = byte_level_tokenizer("llama3")
    rows = [{"row": i, "messages": c, "trained_from": 0} for i, c in enumerate(CONVERSATIONS * 3)]
    samples, _ = chat.Encoder(tok, 64, False).all(rows, "training", True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                         attn_implementation="sdpa")).eval()
    alone = []
    with torch.no_grad():
        for s in samples:
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits
            alone.append(causal_lm_loss(logits, torch.tensor([s["labels"]])).item())
        blocks = chat.pack(samples, 64, pad_id=0)
        assert len(blocks) < len(samples)  # several conversations share a block
        batch = {k: torch.tensor([b[k] for b in blocks]) for k in ("input_ids", "attention_mask", "position_ids")}
        logits = model(**per_document_inputs(batch, "sdpa")).logits
    labels = torch.tensor([b["labels"] for b in blocks])
    per_token = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                                  reduction="none")
    packed = []  # each conversation's sum, read back from the block that holds it
    for b, block in enumerate(blocks):
        starts = [i for i, p in enumerate(block["position_ids"]) if p == 0] + [sum(block["attention_mask"])]
        packed += [per_token[b, a:z - 1].sum().item() for a, z in zip(starts, starts[1:], strict=False)]
    assert sorted(packed) == pytest.approx(sorted(alone), abs=1e-5)
    assert sum(alone) > 0


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_sft_run_on_a_users_jsonl_with_a_llama3_template(tmp_path):
    """A run as a user starts one: their tokenizer, the template file, a multi-turn JSONL; the report, the samples
    and the saved tokenizer's template."""
    from transformers import AutoTokenizer

    tok = byte_level_tokenizer("llama3")
    tok.chat_template = None  # the template comes from --chat_template
    tok.save_pretrained(tmp_path / "tok")
    rows = [{"messages": CONVERSATIONS[i % 3]} for i in range(40)]
    data = _jsonl(tmp_path / "chat.jsonl", rows)
    r = run_recipe("baseline", tmp_path / "out", "--task", "sft", "--model_preset", "tiny-llama", "--train_file", data,
                   "--tokenizer_name", tmp_path / "tok", "--chat_template", TEMPLATES / "llama3.jinja",
                   "--max_train_steps", 2, "--per_device_train_batch_size", 2, "--max_seq_length", 128,
                   "--generate", 2)
    assert r["task"] == "sft" and r["sft_layout"] == "messages"
    assert r["sft_chat_template"] == f"--chat_template {TEMPLATES / 'llama3.jinja'}"
    assert r["sft_conversations_kept"] == 36 and r["sft_conversations_dropped"] == {}  # 10% held out
    assert r["train_target_tokens"] > 0 and r["train_prompt_tokens"] > r["train_target_tokens"]
    assert r["generated_samples"] == 2 and r["eval_perplexity"] > 1
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and samples[0]["prompt"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert saved.chat_template == (TEMPLATES / "llama3.jinja").read_text()
    assert saved.apply_chat_template(CONVERSATIONS[1], tokenize=False).startswith("<|begin_of_text|><|start_header")


def test_accumulation_equals_one_large_batch(tmp_path):
    """4 micro-batches of 4 with accumulation 4 == one batch of 16: conversations of unequal answers, one per row,
    weigh each target token the same (the loss is normalised over the global batch's target tokens)."""
    common = ["--task", "sft", "--model_preset", "tiny-llama", "--packing", "none", "--disable_dropout",
              "--max_train_steps", 1, "--max_grad_norm", 0, "--max_train_samples", 64, "--max_eval_samples", 8,
              "--max_seq_length", 64]
    run_recipe("baseline", tmp_path / "big", *common, "--per_device_train_batch_size", 16)
    run_recipe("gradient_accumulation", tmp_path / "acc", *common, "--per_device_train_batch_size", 4,
               "--gradient_accumulation_steps", 4)
    assert max_param_diff(load_params(tmp_path / "big"), load_params(tmp_path / "acc")) <= 1e-5


def test_ddp_equals_one_process(tmp_path):
    """SFT in 2 processes (recipes/data_parallel.py, gloo) == 1 process, packed per document; a bad row refused."""
    common = ["--task", "sft", "--model_preset", "tiny-llama", "--disable_dropout", "--max_train_steps", 2,
              "--max_train_samples", 256, "--max_eval_samples", 16, "--max_seq_length", 64]
    one = run_recipe("data_parallel", tmp_path / "one", *common, "--per_device_train_batch_size", 8)
    two = launch("data_parallel", tmp_path / "two", *common, "--per_device_train_batch_size", 4)
    assert (two["num_processes"], one["num_processes"]) == (2, 1)
    assert two["train_target_tokens"] == one["train_target_tokens"] and two["packing"] if "packing" in two else True
    assert max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "two")) <= 1e-5
    assert abs(two["eval_loss"] - one["eval_loss"]) <= 1e-5


SFT_REFUSED = {  # recipe -> words of its refusal of --task sft at its own launch, per-document packed (the default)
    "sequence_parallel": "sft's whole conversations need a per-document mask",
    "pipeline_parallel": "Use --packing none with it",
    "data_model_parallel": "Use --packing none with it",
}


def test_every_recipe_takes_sft_or_its_rule_refuses_it_with_the_reason():
    from shared.core import rules
    from shared.tools.catalogue import recipe_run, recipes_support

    for recipe, support in recipes_support().items():
        sharding = support.shardings[-1] if support.min_processes > 1 else support.shardings[0]
        run = recipe_run(recipe, sharding, sharding, num_processes=max(support.min_processes, 1), task="sft",
                        packing="per_document", precision=support.precision or "no", offload="cpu" if
                        support.needs_offload else "none", model_given=support.needs_trained_model)
        found = " ".join(rules.refusals(run))
        if recipe in SFT_REFUSED:
            assert SFT_REFUSED[recipe] in found, (recipe, found)
        else:
            assert not found, (recipe, found)
    # --packing none takes the pipelines; concat is refused for sft everywhere (conversations would be cut)
    for recipe in ("pipeline_parallel", "data_model_parallel"):
        n = recipes_support()[recipe].min_processes
        assert not rules.refusals(recipe_run(recipe, "ddp", "ddp", num_processes=n, task="sft", packing="none"))
    found = rules.refusals(recipe_run("baseline", "none", "none", task="sft", packing="concat"))
    assert found and "cut mid-answer" in found[0] and "--packing none" in found[0]
    # Mixtral's load-balancing loss cannot read per-document packing's 4-D mask (found running expert_parallel)
    found = rules.refusals(recipe_run("expert_parallel", "ddp", "ddp", num_processes=2, task="sft",
                                      packing="per_document", preset="tiny-moe"))
    assert found and "load-balancing loss" in found[0] and "Pass --packing none" in found[0]


def test_sft_flags_with_another_task_are_refused():
    from shared.core.args import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--task", "causal-lm", "--chat_template", "x.jinja"])


SMALL = ["--task", "sft", "--model_preset", "tiny-llama", "--max_train_samples", 64, "--max_eval_samples", 8,
         "--max_seq_length", 64, "--per_device_train_batch_size", 4, "--max_train_steps", 2]
ONE_PROCESS = ["baseline", "mixed_precision", "gradient_accumulation", "activation_checkpointing", "optim_8bit",
               "optim_low_bit", "pruning", "qat", "optimizer_in_backward", "fp8", "activation_offloading",
               "chunked_loss", "combined", "qlora", "model_parallel"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ONE_PROCESS)
def test_one_process_recipe_trains_sft(recipe, tmp_path):
    r = run_recipe(recipe, tmp_path, *SMALL, "--generate", 1, "--no_save_model")
    assert r["task"] == "sft" and r["train_target_tokens"] > 0 and r["eval_perplexity"] > 1
    assert r["generated_samples"] == 1 and (tmp_path / "samples.jsonl").exists()


@pytest.mark.slow
def test_ptq_quantizes_an_sft_model(tmp_path):
    run_recipe("baseline", tmp_path / "trained", *SMALL)
    r = run_recipe("ptq", tmp_path / "ptq", "--task", "sft", "--model_name_or_path", tmp_path / "trained",
                   "--max_eval_samples", 8, "--max_seq_length", 64)
    assert r["task"] == "sft"


EQUAL = ["--disable_dropout", "--max_train_samples", 128, "--max_eval_samples", 16, "--max_seq_length", 64,
         "--max_train_steps", 2, "--task", "sft", "--model_preset", "tiny-llama"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,config,extra", [
    ("zero", "zero3.yaml", []), ("fsdp", "fsdp.yaml", []), ("tensor_parallel", "multi_cpu.yaml", [])])
def test_sharded_sft_equals_one_process(recipe, config, extra, tmp_path):
    """ZeRO-3, FSDP2 and tensor parallel in 2 processes == 1 process (baseline), per-document packed, with
    --generate run on the sharded model."""
    # A saved start (model, tokenizer and its template): ZeRO-3 builds a fresh model under zero.Init, which draws
    # other random weights than a plain build with the same seed; from_pretrained loads the same ones.
    run_recipe("baseline", tmp_path / "init", *EQUAL, "--max_train_steps", 1, "--learning_rate", "1e-12")
    start = ["--model_name_or_path", tmp_path / "init", "--learning_rate", "1e-3"]
    run_recipe("baseline", tmp_path / "one", *EQUAL, *start, "--per_device_train_batch_size", 8)
    batch = 4 if recipe != "tensor_parallel" else 8  # TP: every process reads the whole batch
    r = launch(recipe, tmp_path / "two", *EQUAL, *start, *extra, "--per_device_train_batch_size", batch,
               "--generate", 2, config=config)
    assert r["num_processes"] == 2 and r["generated_samples"] == 2
    assert max_param_diff(load_params(tmp_path / "one"), load_params(tmp_path / "two")) <= 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("recipe,config,extra", [
    ("expert_parallel", "multi_cpu.yaml", ["--model_preset", "tiny-moe", "--packing", "none"]),
    ("pipeline_parallel", "pipeline.yaml", ["--packing", "none"]),
    ("zero3_offload", "zero3_offload.yaml", [])])
def test_other_multi_process_recipes_train_sft(recipe, config, extra, tmp_path):
    r = launch(recipe, tmp_path, *SMALL, *extra, "--no_save_model", config=config)
    assert r["task"] == "sft" and r["eval_perplexity"] > 1


def test_copied_baseline_runs_sft_on_a_users_jsonl_outside_the_repository(tmp_path):
    """`python -m shared.tools.cp baseline DEST --task sft`: the copy carries the sft modules (and what they import)
    and trains a user's chat JSONL, prompt/completion this time, from DEST."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "OMP_NUM_THREADS": "1"}
    dest = tmp_path / "myproj"
    proc = subprocess.run([sys.executable, "-m", "shared.tools.cp", "baseline", str(dest), "--task", "sft",
                           "--vendor"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {"sft.py", "chat.py", "causal_lm.py", "packing.py"} <= {p.name for p in (dest / "recipe_core" / "tasks")
                                                                    .iterdir()}
    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "completion": [{"role": "assistant", "content": w}]}
            for w in ("yes", "no", "maybe", "later") * 8]
    _jsonl(tmp_path / "mine.jsonl", rows)
    proc = subprocess.run([sys.executable, "baseline.py", "--task", "sft", "--model_preset", "tiny-llama",
                           "--train_file", str(tmp_path / "mine.jsonl"), "--max_train_steps", "2", "--report_to",
                           "none", "--per_device_train_batch_size", "4", "--packing", "none", "--generate", "1",
                           "--output_dir", "out"],
                          cwd=dest, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(root) not in proc.stdout + proc.stderr.replace(str(Path(sys.prefix).resolve()), "<venv>")
    r = json.loads((dest / "out" / "results.json").read_text())
    assert r["sft_layout"] == "conversational prompt/completion" and r["sft_conversations_kept"] == 29
    assert r["train_examples"] == 29  # --packing none: one conversation a row
    assert (dest / "out" / "samples.jsonl").exists()


def test_saved_dataset_directory_and_string_prompt_completion(tmp_path):
    """A `datasets` save_to_disk directory is read; string prompt/completion is not templated: the completion and
    the EOS after it are the targets (as TRL's SFTTrainer)."""
    import datasets

    from shared.tasks import sft

    split = datasets.Dataset.from_dict({"prompt": ["Add 2 and 3."] * 4, "completion": [" 5"] * 4})
    datasets.DatasetDict({"train": split}).save_to_disk(tmp_path / "d")
    args = argparse.Namespace(dataset_name=str(tmp_path / "d"), train_file=None)
    train, val, source = sft.load_raw_splits(args)
    assert len(train) == 4 and val is None and "saved dataset" in source
    rows = chat.rows(train, chat.pick_layout(train.column_names, _args()), "training")
    tok = byte_level_tokenizer("llama3")
    sample = chat.Encoder(tok, 64, False).all(rows, "training", True)[0][0]
    targets = [i for i, x in zip(sample["input_ids"], sample["labels"], strict=True) if x != -100]
    assert tok.decode(targets) == " 5<|eot_id|>" and tok.decode(sample["input_ids"]).startswith("<|begin_of_text|>Add")


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_data_file_is_refused(tmp_path, content):
    from shared.core import data

    (tmp_path / "chat.jsonl").write_text(content)
    with pytest.raises(InputError, match="is empty. Pass a file with rows"):
        data._load_file(str(tmp_path / "chat.jsonl"))
