"""Chunked cross-entropy (shared/techniques/chunked_loss.py, recipes/chunked_loss.py): the plain loss's value and
gradients, a small fraction of its saved-for-backward bytes, and the recipe trained under ZeRO-3 and FSDP2 in 2
processes."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python tests/test_chunked_loss.py`: the docs' table

from shared.core.errors import RecipeError
from shared.core.tasks import Task
from shared.techniques.chunked_loss import ChunkedLoss, chunked_cross_entropy, output_head
from shared.techniques.probes import saved_activation_bytes
from tests.conftest import launch, max_param_diff, run_recipe
from tests.test_zero import causal_lm_dir, params

FP32_TOL = 1e-5  # loss and every gradient, chunked vs plain, fp32 (measured: at most ~1e-6)
B, T = 3, 17  # 51 tokens per batch


def tiny_gpt2(vocab: int = 300, n_embd: int = 32) -> torch.nn.Module:
    """GPT-2: lm_head tied to the input embedding (wte)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocab, n_embd=n_embd, n_layer=2, n_head=2, n_positions=64, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def tiny_llama(vocab: int = 300) -> torch.nn.Module:
    """Llama-style: RMSNorm, rotary positions, grouped-query attention, an untied lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


def make_batch(vocab: int, b: int = B, t: int = T) -> dict[str, torch.Tensor]:
    """Random tokens; the last row right-padded (as CausalCollator pads), plus two targets masked mid-sequence."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[-1, t - 5:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 3:5] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("build", [tiny_gpt2, tiny_llama], ids=["gpt2-tied", "llama-untied"])
@pytest.mark.parametrize("chunk_size, max_tokens", [(17, B * T), (10, B * T), (1000, B * T), (4, 400)],
                         ids=["divides", "does-not-divide", "one-chunk", "more-chunks-than-tokens"])
def test_same_loss_and_every_gradient_as_the_plain_loss(build, chunk_size, max_tokens):
    model = build()
    batch = make_batch(model.config.vocab_size)
    task = Task("causal-lm", model, "tiny", None, None, "random")  # the plain loss every other recipe trains with
    num_items = task.count_items(batch)
    assert 0 < num_items < B * (T - 1)  # -100 labels are present

    plain = task.loss(model, batch, num_items)
    plain.backward()
    expected = grads(model)
    chunked_loss = ChunkedLoss(chunk_size, max_tokens)
    chunked = chunked_loss(model, batch, num_items)
    chunked.backward()
    got = grads(model)

    assert chunked_loss.num_chunks == math.ceil(max_tokens / chunk_size)
    assert abs(chunked.item() - plain.item()) <= FP32_TOL, (chunked.item(), plain.item())
    assert got.keys() == expected.keys() == {n for n, p in model.named_parameters()}
    worst = max((got[n] - expected[n]).abs().max().item() for n in expected)
    head = output_head(model).weight
    tied = head is model.get_input_embeddings().weight
    assert tied == (build is tiny_gpt2)
    print(f"{model.config.model_type} (tied head: {tied}), {chunked_loss.num_chunks} chunks: |loss diff| = "
          f"{abs(chunked.item() - plain.item()):.1e}, max |grad diff| = {worst:.1e} over {len(expected)} tensors")
    assert worst <= FP32_TOL


def test_saved_bytes_fall_by_over_90_percent_at_the_gpt2_vocabulary():
    """A tiny GPT-2 body with GPT-2's 50257-token vocabulary: what autograd keeps for the loss's backward."""
    vocab, b, t, chunk = 50257, 4, 64, 64
    model = tiny_gpt2(vocab=vocab)
    batch = make_batch(vocab, b, t)
    measured = ChunkedLoss(chunk, b * t).saved_bytes(model, batch)  # what results.json reports
    chunked, plain = measured["loss_saved_bytes"], measured["loss_saved_bytes_plain"]
    log_probs = b * (t - 1) * vocab * 4  # the fp32 log-softmax the plain cross-entropy keeps
    assert plain >= log_probs
    assert chunked <= 0.1 * plain, (chunked, plain)

    # The same count taken directly around the loss on the model's own (tied) head, from its hidden states on.
    head = output_head(model)
    with torch.no_grad():
        hidden = model.transformer(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[0]
    hidden.requires_grad_()
    with saved_activation_bytes(model) as direct:
        chunked_cross_entropy(hidden, batch["labels"], head, num_chunks=b * t // chunk)
    assert direct["bytes"] == chunked
    assert abs(measured["loss_chunked_minus_plain"]) < 1e-6
    print(f"vocab {vocab}, {b * t} tokens, chunk {chunk}: plain {plain / 2**20:.2f} MiB, chunked "
          f"{chunked / 2**20:.3f} MiB ({1 - chunked / plain:.1%} less)")


def test_models_that_change_logits_after_the_head_are_refused():
    model = tiny_gpt2()
    model.config.final_logit_softcapping = 30.0  # Gemma-2 soft-caps in its forward, after the head
    with pytest.raises(RecipeError, match="final_logit_softcapping"):
        output_head(model)


def test_other_tasks_are_refused_before_loading(tmp_path):
    with pytest.raises(SystemExit, match="Pass --task causal-lm"):
        run_recipe("chunked_loss", tmp_path, "--task", "text-classification")
    assert not (tmp_path / "results.json").exists()


SHORT = ("--disable_dropout", "--max_train_steps", 4, "--max_train_samples", 128, "--max_seq_length", 64,
         "--max_eval_samples", 32, "--logging_steps", 1)


def test_one_process_run_reports_both_byte_counts_and_matches_baseline(tmp_path):
    r = run_recipe("chunked_loss", tmp_path / "chunked", *SHORT, "--loss_chunk_size", 100, "--no_save_model")
    ref = run_recipe("baseline", tmp_path / "baseline", "--task", "causal-lm", *SHORT, "--no_save_model")
    assert (r["recipe"], r["task"], r["num_processes"], r["sharding"]) == ("chunked_loss", "causal-lm", 1, "none")
    assert r["loss_chunks"] == math.ceil(16 * 64 / 100) and r["loss_chunk_size"] == 100
    assert 0 < r["loss_saved_bytes"] < r["loss_saved_bytes_plain"]
    assert r["loss_saved_bytes_tokens"] > 0 and abs(r["loss_chunked_minus_plain"]) < 1e-6
    assert r["train_loss"] < r["initial_loss"]
    # The same data, model and seed as baseline.py, plain loss: the same losses (fp32).
    for key in ("initial_loss", "train_loss", "eval_loss"):
        assert r[key] == pytest.approx(ref[key], abs=FP32_TOL), key


def test_combined_chunked_loss_trains_as_the_plain_loss(tmp_path):
    """combined.py --chunked_loss: the same losses as combined.py's plain loss on the same data and seed (fp32)."""
    r = run_recipe("combined", tmp_path / "chunked", "--task", "causal-lm", *SHORT, "--chunked_loss",
                   "--loss_chunk_size", 100, "--no_save_model")
    ref = run_recipe("combined", tmp_path / "plain", "--task", "causal-lm", *SHORT, "--no_save_model")
    assert r["chunked_loss"] and not ref["chunked_loss"] and r["loss_chunks"] == math.ceil(16 * 64 / 100)
    assert 0 < r["loss_saved_bytes"] < r["loss_saved_bytes_plain"]
    for key in ("initial_loss", "train_loss", "eval_loss"):
        assert r[key] == pytest.approx(ref[key], abs=FP32_TOL), key


@pytest.mark.slow
def test_combined_chunked_loss_on_a_4bit_lora_model_in_two_processes(tmp_path):
    """The combination only combined.py has: a 4-bit base, LoRA adapters and the chunked loss, under DDP. (The
    chunked loss's measuring pass runs the model in eval mode first, which broke the 4-bit training step before
    shared/techniques/quant.py's no_cpu_4bit_repacking.)"""
    r = launch("combined", tmp_path, "--task", "causal-lm", *SHORT, "--chunked_loss", "--lora", "--load_in", "4bit",
               "--no_save_model")
    assert (r["distributed_type"], r["num_processes"], r["load_in"], r["chunked_loss"]) == ("MULTI_CPU", 2, "4bit",
                                                                                             True)
    assert 0 < r["loss_saved_bytes"] < r["loss_saved_bytes_plain"] and abs(r["loss_chunked_minus_plain"]) < 1e-5
    assert math.isfinite(r["train_loss"]) and r["train_loss"] < r["initial_loss"]


# 2 processes x 8 vs 1 process x 16: the same global batches, and the same weights for both (ZeRO-3's zero.Init would
# draw other random weights from a config). Measured after 4 steps (fp32, AdamW): max |param diff| 2.4e-6 under
# ZeRO-3 and 1.2e-6 under FSDP2, |train_loss diff| 9e-6 and 0: reduce-scatter sums the gradients in another order
# than one process does, and Adam magnifies the last bits where its second moment is tiny. 1e-5 and 5e-5 leave room.
PARAM_TOL, LOSS_TOL = 1e-5, 5e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    base = tmp_path_factory.mktemp("chunked")
    init = causal_lm_dir(base / "init")
    out = base / "plain"
    return init, out, run_recipe("baseline", out, "--task", "causal-lm", *SHORT, "--model_name_or_path", init,
                                 "--per_device_train_batch_size", 16)


@pytest.mark.slow
@pytest.mark.parametrize("config, sharding", [("zero3.yaml", "zero3"), ("fsdp.yaml", "fsdp")])
def test_two_processes_train_as_the_plain_one_process_run(reference, config, sharding, tmp_path):
    init, plain_dir, plain = reference
    # 16-token chunks: 32 per batch (8 x 64 tokens at most), the count fixed by the flags. Counted per batch instead,
    # the two processes' first batches need 13 and 17 (padded to different lengths), and ZeRO-3, which gathers the
    # head's weight at each head call, fails in a mismatched collective (measured).
    r = launch("chunked_loss", tmp_path, *SHORT, "--model_name_or_path", init, "--per_device_train_batch_size", 8,
               "--loss_chunk_size", 16, config=config)
    assert (r["num_processes"], r["sharding"], r["loss_chunks"]) == (2, sharding, 32)
    assert 0 < r["loss_saved_bytes"] < r["loss_saved_bytes_plain"]
    assert math.isfinite(r["train_loss"]) and r["train_loss"] < r["initial_loss"]
    for key in ("initial_loss", "train_loss"):
        assert abs(r[key] - plain[key]) <= LOSS_TOL, (key, r[key], plain[key])
    diff = max_param_diff(params(plain_dir), params(tmp_path))  # the saved models (ZeRO-3 and FSDP2 gather them)
    print(f"{sharding}: max |param - plain 1-process param| after 4 steps = {diff:.1e}, train_loss "
          f"{r['train_loss']:.6f} vs {plain['train_loss']:.6f}")
    assert diff <= PARAM_TOL


# ---------------------------------------------------------------- the figures of docs/chunked_loss.md


def benchmark(rows: tuple[tuple[int, int], ...] = ((16384, 1024), (32000, 2048), (50257, 2048), (50257, 8192),
                                                   (128256, 2048)),
              hidden: int = 256, chunk: int = 1024, repeats: int = 3) -> list[dict]:
    """Plain vs chunked loss from (1, tokens, hidden) hidden states through an untied head: saved-for-backward bytes
    (shared.core.meter), growth of this process's peak resident memory during forward + backward, and the best of
    `repeats` forward + backward times, plain and chunked interleaved (a shared machine's load hits both alike)."""
    import time
    from functools import partial

    from torch import nn

    from shared.core.measure import current_memory_bytes, peak_memory_bytes, reset_peak_memory
    from shared.techniques.chunked_loss import plain_cross_entropy

    cpu = torch.device("cpu")
    out = []
    for vocab, tokens in rows:
        torch.manual_seed(0)
        head = nn.Linear(hidden, vocab, bias=False)
        h = torch.randn(1, tokens, hidden, requires_grad=True)
        labels = torch.randint(0, vocab, (1, tokens))
        num_chunks = math.ceil(tokens / chunk)
        runs = {"plain": partial(plain_cross_entropy, h, labels, head),
                "chunked": partial(chunked_cross_entropy, h, labels, head, num_chunks)}
        row = {"vocab": vocab, "tokens": tokens, "hidden": hidden, "chunk": chunk}
        for name, run in runs.items():
            with saved_activation_bytes(head) as saved:
                loss = run()
            row[f"{name}_saved"] = saved["bytes"]
            del loss
        for _ in range(repeats):
            for name, run in runs.items():
                before = current_memory_bytes(cpu)
                reset_peak_memory(cpu)
                start = time.perf_counter()
                run().backward()
                seconds = time.perf_counter() - start
                row[f"{name}_peak_growth"] = max(row.get(f"{name}_peak_growth", 0), peak_memory_bytes(cpu) - before)
                row[f"{name}_s"] = min(row.get(f"{name}_s", math.inf), seconds)
                h.grad = head.weight.grad = None
        out.append(row)
    return out


if __name__ == "__main__":
    import os
    import platform

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("| vocab | tokens | plain saved | chunked saved | less | plain peak growth | chunked peak growth | "
          "plain fwd+bwd | chunked fwd+bwd | time ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in benchmark():
        mib = 2**20
        print(f"| {r['vocab']} | {r['tokens']} | {r['plain_saved'] / mib:.1f} MiB | {r['chunked_saved'] / mib:.2f} MiB "
              f"| {1 - r['chunked_saved'] / r['plain_saved']:.1%} | {r['plain_peak_growth'] / mib:.0f} MiB | "
              f"{r['chunked_peak_growth'] / mib:.0f} MiB | {r['plain_s']:.2f} s | {r['chunked_s']:.2f} s | "
              f"{r['chunked_s'] / r['plain_s']:.2f} |")
