"""Data a user really has: long documents packed into blocks, documents kept apart inside a block, sentence pairs,
decoder-only classifiers, dataloader workers, image models that a pipeline loads, a learning rate that fits."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from shared.core import data
from shared.core.tasks import Task
from shared.tasks import causal_lm, images, packing
from shared.tasks import text_classification as reviews
from shared.tasks.packing import PACKING
from tests.conftest import load_params, max_param_diff, run_recipe

VOCAB = "the cat dog ran to a red blue house and field one two three fox owl river road garden".split()


def review_pairs_dataset(n: int, seed: int) -> dict[str, list]:
    """Sentence pairs from the built-in reviews' words: three sentiment clauses split into two sentences (1 + 2 or
    2 + 1 clauses); the label is the polarity most of the three hold. sentence1 alone decides it 3 times in 4 at
    best; the pair, always."""
    rng = random.Random(seed)
    first, second, labels = [], [], []
    for _ in range(n):
        polarities = [rng.randint(0, 1) for _ in range(3)]
        clauses = [f"{rng.choice(reviews._FILLER)} {rng.choice(reviews._NOUNS)} was "
                   f"{rng.choice(reviews._POSITIVE if p else reviews._NEGATIVE)}" for p in polarities]
        cut = rng.randint(1, 2)
        first.append(" and ".join(clauses[:cut]))
        second.append(" and ".join(clauses[cut:]))
        labels.append(int(sum(polarities) >= 2))
    return {"sentence1": first, "sentence2": second, "label": labels}



def _long_lines(path, lines: int, words: int, seed: int):
    rng = random.Random(seed)
    path.write_text("\n".join(" ".join(rng.choice(VOCAB) for _ in range(words)) for _ in range(lines)) + "\n")
    return path


def _file_tokens(tokenizer_dir, path) -> int:
    """The file's tokens as the run's own tokenizer (saved beside the model) counts them, line by line."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    lines = [t for t in path.read_text().splitlines() if t.strip()]
    return sum(len(ids) for ids in tok(lines)["input_ids"])


# ---------------------------------------------------------------- 1. causal LM packing
def test_packing_keeps_the_tokens_of_long_lines(tmp_path, caplog):
    """20 lines of 1000 words: packed, nearly every token is a target and no position is padding; per line, the
    cut at --max_seq_length loses most of them, and the run says so."""
    train = _long_lines(tmp_path / "train.txt", 20, 1000, seed=0)
    val = _long_lines(tmp_path / "val.txt", 2, 1000, seed=1)
    common = ["--task", "causal-lm", "--train_file", train, "--validation_file", val, "--max_train_steps", 2]
    packed = run_recipe("baseline", tmp_path / "concat", *common)
    tokens = _file_tokens(tmp_path / "concat", train)
    print(f"long lines: {tokens} tokens in the file; concat: {packed['train_target_tokens']} target tokens in "
          f"{packed['train_examples']} blocks, padding {packed['padding_fraction']}")
    assert packed["train_text_tokens"] == tokens  # what the run counted is what its tokenizer gives
    assert packed["train_target_tokens"] >= 0.95 * tokens
    assert packed["train_examples"] == tokens // 128  # one group of 20 documents: only its last partial block goes
    assert packed["padding_fraction"] == 0.0
    assert packed["train_target_tokens"] == packed["train_examples"] * 127  # every position but a block's first

    with caplog.at_level(logging.WARNING, logger="recipes"):
        per_line = run_recipe("baseline", tmp_path / "none", *common, "--packing", "none", "--no_save_model")
    kept = per_line["train_target_tokens"] / tokens
    print(f"--packing none: {per_line['train_target_tokens']} target tokens ({kept:.1%} of the file), "
          f"dropped_token_fraction {per_line['dropped_token_fraction']}")
    assert per_line["train_examples"] == 20 and per_line["train_target_tokens"] == 20 * 127  # each line cut at 128
    assert per_line["dropped_token_fraction"] == pytest.approx(1 - 20 * 128 / tokens, abs=1e-6)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "--packing none" in r.msg]
    assert warned and f"{100 * per_line['dropped_token_fraction']:.1f}%" in warned[0], warned


def test_builtin_data_packs_without_padding(tmp_path):
    """The built-in stories, short lines: per line, batches are largely padding; packed, none."""
    common = ["--task", "causal-lm", "--max_train_steps", 2, "--no_save_model", "--max_eval_samples", 16]
    runs = {m: run_recipe("baseline", tmp_path / m, *common, "--packing", m) for m in PACKING}
    for mode, r in runs.items():
        print(f"built-in stories, --packing {mode}: {r['train_examples']} samples, {r['train_target_tokens']} target "
              f"tokens, padding {r['padding_fraction']}, left out {r['dropped_token_fraction']}")
    assert runs["none"]["padding_fraction"] > 0.2 and runs["concat"]["padding_fraction"] == 0.0
    assert runs["per_document"]["train_examples"] == runs["concat"]["train_examples"]
    assert runs["none"]["dropped_token_fraction"] == 0.0  # short lines: the cut at 128 costs nothing here
    # per_document predicts no document's first token from the previous document: fewer targets than concat
    assert runs["per_document"]["train_target_tokens"] < runs["concat"]["train_target_tokens"]


def _tiny_decoder(kind: str, attn: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from shared.core.models import preset_config

    if kind == "gpt2":
        config = preset_config("causal-lm", "tiny", vocab_size=100, bos_token_id=1, eos_token_id=2)
    elif kind != "llama":  # today's attention variants (tests/shipped_models.py), a window of 8 tokens
        from tests.shipped_models import config_of

        config = config_of(kind, dict(vocab_size=100, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    else:
        config = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


@pytest.mark.parametrize("kind, attn", [(k, a) for k in ("gpt2", "llama") for a in ("sdpa", "eager")]
                         + [("gemma3", "sdpa"), ("mistral", "sdpa"), ("gemma2", "eager"), ("gpt-oss", "eager")])
def test_per_document_logits_equal_each_document_alone(kind, attn):
    """Packed per_document, every token's logits are those of its document run alone (fp32, 1e-5); the same
    blocks with a plain padding mask let documents see each other. Also with a sliding window of 8 tokens (mixed
    with full layers: Gemma 3, Gemma 2, gpt-oss; in every layer: Mistral), Gemma 2's soft caps and gpt-oss's sinks:
    the window is in each sliding layer's mask (one causal mask for all measured 0.54 off on Gemma 3)."""
    model = _tiny_decoder(kind, attn)
    rng = random.Random(0)
    docs = [[rng.randrange(5, 100) for _ in range(rng.randint(3, 40))] + [2] for _ in range(12)]
    blocks = packing.pack(docs, block_size=48, per_document=True, keep_last=True, pad_id=0)
    batch = packing.BlockCollator()([{k: v[i] for k, v in blocks.items()} for i in range(len(blocks["input_ids"]))])
    batch = {k: v for k, v in batch.items() if k not in ("n_real", "n_targets")}
    task = Task("causal-lm", model, kind, None, None, "test", packing="per_document",
                inputs_fn=causal_lm.model_inputs("per_document", model))
    with torch.no_grad():
        packed = model(**task._inputs(batch)).logits
        leaky = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                      position_ids=batch["position_ids"]).logits
    worst, leak, segments = 0.0, 0.0, 0
    for b, (ids, pos, real) in enumerate(zip(batch["input_ids"], batch["position_ids"], batch["attention_mask"],
                                             strict=True)):
        starts = [i for i in range(len(ids)) if pos[i] == 0] + [int(real.sum())]
        for s, e in zip(starts, starts[1:], strict=False):
            with torch.no_grad():
                alone = model(input_ids=ids[None, s:e]).logits[0]
            worst = max(worst, (packed[b, s:e] - alone).abs().max().item())
            leak = max(leak, (leaky[b, s:e] - alone).abs().max().item())
            segments += 1
            # labels: the document's first token is no target of the previous one's last; the rest are
            assert batch["labels"][b, s] == -100 and (batch["labels"][b, s + 1:e] == ids[s + 1:e]).all()
    print(f"{kind}/{attn}: {segments} segments in {len(ids)}-token blocks, max |packed - alone| {worst:.2e}; "
          f"with a 2-D mask {leak:.2e}")
    assert segments > len(batch["input_ids"])  # blocks really hold several documents
    assert worst <= 1e-5
    assert leak > 1e-3  # the check can fail: without the document mask, later documents see earlier ones


def test_flash_varlen_segments_are_the_documents():
    """The flash-attention path (a GPU with flash-attn; not run here): cu_seqlens cut the flattened batch into the
    same segments as the 4-D mask."""
    docs = [[7] * 5 + [2], [8] * 9 + [2], [9] * 3 + [2]]
    blocks = packing.pack(docs, block_size=8, per_document=True, keep_last=True, pad_id=0)
    pos = torch.tensor(blocks["position_ids"])
    kwargs = packing.per_document_inputs({"input_ids": torch.tensor(blocks["input_ids"]), "position_ids": pos,
                                          "attention_mask": torch.tensor(blocks["attention_mask"])},
                                         "flash_attention_2")
    assert "attention_mask" not in kwargs
    # blocks [d0 x6, d1 x2] [d1 x8] [d2 x4, pad x4]: segments start at 0, 6, 8 and 16 of the 24 positions
    assert kwargs["cu_seq_lens_q"].tolist() == [0, 6, 8, 16, 24] and kwargs["max_length_q"] == 8


def test_per_document_accumulation_equals_one_large_batch(tmp_path):
    """per_document blocks hold different numbers of targets: 4 micro-batches of 4 == one batch of 16 still."""
    common = ["--task", "causal-lm", "--packing", "per_document", "--disable_dropout", "--max_train_steps", 1,
              "--max_grad_norm", 0, "--max_train_samples", 64, "--max_eval_samples", 8]
    run_recipe("baseline", tmp_path / "big", *common, "--per_device_train_batch_size", 16)
    run_recipe("gradient_accumulation", tmp_path / "acc", *common, "--per_device_train_batch_size", 4,
               "--gradient_accumulation_steps", 4)
    diff = max_param_diff(load_params(tmp_path / "big"), load_params(tmp_path / "acc"))
    print(f"per_document: accumulation 4x4 vs batch 16, max abs param diff {diff:.2e}")
    assert diff <= 1e-5


def test_concat_blocks_are_run_clm_blocks():
    """concat: documents end in EOS, are joined and cut into full blocks; labels are the inputs; the rest goes."""
    docs = [[1, 2, 3, 9], [4, 5, 9], [6, 7, 8, 9]]
    blocks = packing.pack(docs, block_size=4, per_document=False, keep_last=False, pad_id=0)
    assert blocks["input_ids"] == [[1, 2, 3, 9], [4, 5, 9, 6]] and blocks["labels"] == blocks["input_ids"]
    assert blocks["n_targets"] == [3, 3] and "position_ids" not in blocks
    evaluation = packing.pack(docs, block_size=4, per_document=False, keep_last=True, pad_id=0)
    assert evaluation["input_ids"][-1] == [7, 8, 9, 0] and evaluation["labels"][-1] == [7, 8, 9, -100]
    assert evaluation["attention_mask"][-1] == [1, 1, 1, 0]


def test_too_little_text_for_one_block(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("one two three\nfour five six\n")
    val = tmp_path / "val.txt"
    val.write_text("seven eight nine\n")
    with pytest.raises(SystemExit, match="fewer than one block of --max_seq_length 128.*--packing none"):
        run_recipe("baseline", tmp_path / "out", "--task", "causal-lm", "--train_file", path, "--validation_file",
                   val, "--max_train_steps", 1)


# ---------------------------------------------------------------- 2. sentence pairs
def _pairs_csv(path, n: int, seed: int):
    import pandas as pd

    pd.DataFrame(review_pairs_dataset(n, seed)).to_csv(path, index=False)
    return path


def test_sentence_pair_classification_learns(tmp_path):
    """A review split in two: the pair decides the label, the first sentence alone at most 3 times in 4."""
    train, val = _pairs_csv(tmp_path / "train.csv", 2000, 1), _pairs_csv(tmp_path / "val.csv", 200, 2)
    common = ["--train_file", train, "--validation_file", val, "--text_column", "sentence1", "--max_train_steps", 100,
              "--learning_rate", "3e-3", "--no_save_model"]
    pair = run_recipe("baseline", tmp_path / "pair", *common, "--text_pair_column", "sentence2")
    alone = run_recipe("baseline", tmp_path / "alone", *common)
    print(f"sentence pairs: eval_accuracy {pair['eval_accuracy']:.3f}; first sentence alone "
          f"{alone['eval_accuracy']:.3f} (100 steps)")
    assert pair["eval_accuracy"] > 0.9, pair["eval_accuracy"]
    assert pair["eval_accuracy"] > alone["eval_accuracy"] + 0.1  # the second sentence really reached the model


def test_word_tokenizer_marks_the_second_segment():
    tok = data.build_word_tokenizer(["good film", "bad plot"], "text-classification")
    enc = tok("good film", "bad plot")
    assert tok.convert_ids_to_tokens(enc["input_ids"]) == ["[CLS]", "good", "film", "[SEP]", "bad", "plot", "[SEP]"]
    assert enc["token_type_ids"] == [0, 0, 0, 0, 1, 1, 1]


# ---------------------------------------------------------------- 3. decoder-only classifiers
def _gpt2_classifier_dir(path):
    """A tiny GPT2ForSequenceClassification with no pad id, and a tokenizer with no pad token: as `gpt2` on the hub."""
    from transformers import GPT2Config, GPT2ForSequenceClassification, PreTrainedTokenizerFast

    word = data.build_word_tokenizer(data.builtin_split("text-classification", "train")["text"], "causal-lm")
    tok = PreTrainedTokenizerFast(tokenizer_object=word.backend_tokenizer, bos_token="[BOS]", eos_token="[EOS]",
                                  unk_token="[UNK]", model_input_names=["input_ids", "attention_mask"])
    assert tok.pad_token is None
    config = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=2, n_positions=128, num_labels=2,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    assert config.pad_token_id is None
    torch.manual_seed(0)
    GPT2ForSequenceClassification(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_gpt2_sequence_classifier_learns(tmp_path):
    model_dir = _gpt2_classifier_dir(tmp_path / "gpt2-cls")
    r = run_recipe("baseline", tmp_path / "out", "--model_name_or_path", model_dir, "--max_train_steps", 60,
                   "--learning_rate", "3e-3", "--max_eval_samples", 200)
    print(f"GPT-2 sequence classifier: eval_accuracy {r['eval_accuracy']:.3f} after 60 steps")
    assert r["eval_accuracy"] > 0.8, r["eval_accuracy"]
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["model_type"] == "gpt2" and saved["pad_token_id"] == saved["eos_token_id"]


# ---------------------------------------------------------------- 4. dataloader workers
def test_resume_with_dataloader_workers_is_exact(tmp_path):
    """2 workers: stopped at step 6 and resumed == uninterrupted, bit for bit (dropout on, several epochs)."""
    common = ["--max_train_steps", 10, "--max_train_samples", 48, "--dataloader_num_workers", 2]
    full = run_recipe("baseline", tmp_path / "full", *common, "--checkpointing_steps", 3)
    checkpoint = tmp_path / "full" / "checkpoints" / "step_00000006"
    run_recipe("baseline", tmp_path / "resumed", *common, "--resume_from_checkpoint", checkpoint)
    run_recipe("baseline", tmp_path / "single", *common[:4], "--dataloader_num_workers", 0)
    diff = max_param_diff(load_params(tmp_path / "full"), load_params(tmp_path / "resumed"))
    print(f"2 dataloader workers: resumed at step 6 of 10 vs uninterrupted: max abs param diff {diff:.2e}")
    assert diff == 0.0
    # the workers change where batches are built, not which: the same parameters as without them
    assert max_param_diff(load_params(tmp_path / "full"), load_params(tmp_path / "single")) == 0.0
    assert full["train_examples"] == 48


# ---------------------------------------------------------------- 5. image models a pipeline loads
def test_image_pipeline_loads_the_output_directory(tmp_path):
    from PIL import Image
    from transformers import pipeline

    out = tmp_path / "out"
    run_recipe("baseline", out, "--task", "image-classification", "--max_train_steps", 2)
    classify = pipeline("image-classification", model=str(out), device="cpu")
    config = json.loads((out / "config.json").read_text())
    image = Image.fromarray(images.pattern_images(1, seed=3, image_size=48)["image"][0])  # not the model's size
    preds = classify(image, top_k=4)
    assert {p["label"] for p in preds} == set(config["id2label"].values())
    assert sum(p["score"] for p in preds) == pytest.approx(1.0, abs=1e-4)
    # The saved processor prepares an image exactly as training did.
    ds = images.ImageDataset([image], [0], config["image_size"], [0.5] * 3, [0.5] * 3)
    served = classify.image_processor(image, return_tensors="pt")["pixel_values"][0]
    assert (served - ds[0]["pixel_values"]).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- 6. the learning-rate default
def test_learning_rate_default_fits_what_is_trained(tmp_path):
    """Resolved by the launch, not when parsed: a copied recipe that sets args.model_name_or_path after parse_args
    gets the pretrained default."""
    from shared.core.args import FROM_SCRATCH_LR, PRETRAINED_LR, parse_args
    from shared.core.launch import resolve_launch

    def lr(argv, **defaults):
        return resolve_launch(parse_args([*argv, "--output_dir", str(tmp_path)], **defaults), "baseline").learning_rate

    assert lr([]) == FROM_SCRATCH_LR == 1e-3
    assert lr(["--model_name_or_path", "gpt2"]) == PRETRAINED_LR == 5e-5
    assert lr(["--model_name_or_path", "gpt2", "--learning_rate", "2e-4"]) == 2e-4
    assert lr(["--model_name_or_path", "gpt2"], learning_rate=1e-4) == 1e-4  # a recipe's own
    assert parse_args([]).learning_rate is None and "learning_rate" not in parse_args([]).explicit_flags
    adapted = parse_args(["--output_dir", str(tmp_path)])
    adapted.model_name_or_path = "gpt2"  # a copied recipe's own default model, set after parsing
    assert resolve_launch(adapted, "baseline").learning_rate == PRETRAINED_LR
