"""Pipeline parallel: the stage cut computes the unsplit model's loss and gradients, and the real 2-process pipeline
(torch.distributed.pipelining over gloo) trains like the unsplit model, each process holding only its stage."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from shared.models import preset_config, transformer_layers
from shared.pipeline_stages import Stage, split_layers, summed_loss
from tests.conftest import launch, load_params, max_param_diff, run_recipe
from tests.parallel_runs import COMMON, single

GRAD_TOL = 1e-6  # fp32, same batch, stages chained in one process; measured 0.0
# fp32 AdamW at lr 3e-3, 6 steps, vs 1 process: micro-batch sums and fixed-length padding change last bits, which
# Adam's m/sqrt(v) magnifies where v is tiny; 5e-5 is under 2% of one update (as for FSDP vs DDP).
PARAM_TOL = 5e-5


def _model_and_batch(task: str):
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = preset_config(task, "tiny", vocab_size=50)
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    if task == "image-classification":
        cfg.num_hidden_layers = 3
        model = AutoModelForImageClassification.from_config(cfg)
        return model, torch.randn(4, 3, 32, 32), {}, torch.tensor([0, 1, 1, 0])
    cfg.num_hidden_layers, cfg.n_layer = 3, 3
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    model = auto.from_config(cfg)
    ids = torch.randint(3, 50, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding must be masked the same way in every stage
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100) if task == "causal-lm" else torch.tensor([0, 1, 1, 0])
    return model, ids, {"attention_mask": mask}, labels


@pytest.mark.parametrize("task", ["causal-lm", "text-classification", "image-classification"])
def test_stages_compute_the_unsplit_loss_and_gradients(task):
    model, x, kw, labels = _model_and_batch(task)
    loss_fn = summed_loss(task)
    whole = copy.deepcopy(model)
    key = "pixel_values" if task == "image-classification" else "input_ids"
    ref_loss = loss_fn(whole(**{key: x}, **kw).logits, labels)
    ref_loss.backward()
    ref = {n: p.grad for n, p in whole.named_parameters()}

    ranges = split_layers(3, 2, "1,2")
    stages = [Stage(copy.deepcopy(model), r, is_first=i == 0, is_last=i == 1) for i, r in enumerate(ranges)]
    loss = loss_fn(stages[1](stages[0](x, **kw), **kw), labels)  # what the pipeline sends between processes
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())

    grads = {}
    for stage in stages:
        for name, p in stage.model.named_parameters():
            grads[name] = grads[name] + p.grad if name in grads else p.grad  # a tied copy's gradients are summed
    if task == "causal-lm":  # lm_head is the embedding, held by the first and the last stage
        grads["transformer.wte.weight"] = grads["transformer.wte.weight"] + grads.pop("lm_head.weight")
    assert grads.keys() == ref.keys()
    diff = max((grads[n] - ref[n]).abs().max().item() for n in ref)
    print(f"{task}: |loss diff| {abs(loss.item() - ref_loss.item()):.1e}, max grad diff {diff:.1e}")
    assert diff <= GRAD_TOL

    # each stage holds only its own blocks (+ embeddings on the first, head on the last): count them
    blocks = transformer_layers(whole)
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    block_params = {id(p) for p in blocks.parameters()}
    outside = sum(p.numel() for p in whole.parameters() if id(p) not in block_params)
    tied = whole.transformer.wte.weight.numel() if task == "causal-lm" else 0
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert counts[0] + counts[1] == sum(per_block) + outside + tied
    for stage, r, count in zip(stages, ranges, counts, strict=True):
        own_blocks = sum(p.numel() for b in stage.blocks for p in b.parameters())
        assert own_blocks == sum(per_block[i] for i in r)  # the other stage's blocks are gone
        assert count > own_blocks  # plus its end of the model

def test_bad_split_fails_before_training(tmp_path):
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(SystemExit, match="2 stages of at least one block"):
        split_layers(4, 2, "1,2")
    with pytest.raises(SystemExit, match="not divisible by --n_microbatches"):
        run_recipe("pipeline_parallel", tmp_path, "--per_device_train_batch_size", "6", "--n_microbatches", "4")


def _stage_params(out_dir) -> list[dict]:
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return [load_file(out_dir / f) for f in sorted(set(index.values()))]


@pytest.mark.slow
def test_gpt_1f1b_pipeline_trains_like_the_unsplit_model(tmp_path_factory, tmp_path):
    ref_dir, ref = single(tmp_path_factory)  # the same model unsplit, 1 process, same batches
    r = launch("pipeline_parallel", tmp_path, *COMMON, "--per_device_train_batch_size", "16",
               "--schedule", "1f1b", "--n_microbatches", "4", config="pipeline.yaml")
    assert (r["num_processes"], r["distributed_type"], r["schedule"]) == (2, "MULTI_CPU", "1f1b")
    # the same first batch through the 2-stage pipeline: the same loss, the same gradient norm
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-5)
    assert r["first_step_grad_norm"] == pytest.approx(ref["first_step_grad_norm"], rel=1e-4)
    print(f"loss {r['initial_loss']:.7f} vs {ref['initial_loss']:.7f}; grad norm {r['first_step_grad_norm']:.6f} "
          f"vs {ref['first_step_grad_norm']:.6f}; eval loss {r['eval_loss']:.4f} vs {ref['eval_loss']:.4f}")
    assert r["train_loss"] < r["initial_loss"] - 0.5
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-3)
    merged = {k: v for part in _stage_params(tmp_path) for k, v in part.items()}
    diff = max_param_diff(load_params(ref_dir), merged)
    print(f"param diff: max |param(2-stage pipeline) - param(unsplit)| after 6 steps = {diff:.2e}")
    assert diff <= PARAM_TOL

    # each process saved, and held, only its stage: embeddings + block 0 | block 1 + final norm (+ tied head)
    first, last = _stage_params(tmp_path)
    assert any(k.startswith("transformer.h.0.") for k in first) and not any(".h.1." in k for k in first)
    assert any(k.startswith("transformer.h.1.") for k in last) and not any(".h.0." in k for k in last)
    assert "transformer.wte.weight" in first and "transformer.ln_f.weight" in last
    wte = first["transformer.wte.weight"].numel()
    assert r["stage_param_count"] == [sum(t.numel() for t in first.values()),
                                      sum(t.numel() for t in last.values()) + wte]  # + its copy of the tied head
    assert r["param_bytes"] == [4 * n for n in r["stage_param_count"]]

    from transformers import AutoModelForCausalLM  # the shards + index load as one model

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(model.lm_head.weight, first["transformer.wte.weight"])


@pytest.mark.slow
def test_bert_gpipe_pipeline_trains(tmp_path):
    r = launch("pipeline_parallel", tmp_path, "--task", "text-classification", "--schedule", "gpipe",
               "--n_microbatches", "2", "--max_train_steps", "12", "--max_train_samples", "192",
               "--max_eval_samples", "32", "--max_seq_length", "32", "--learning_rate", "3e-3", "--logging_steps", "4",
               "--no_save_model", config="pipeline.yaml")
    assert (r["num_processes"], r["schedule"], r["stage_layers"]) == (2, "gpipe", [[0, 1], [1, 2]])
    assert r["train_loss"] < r["initial_loss"], r
    assert 0.0 <= r["eval_accuracy"] <= 1.0 and len(r["peak_memory_bytes"]) == 2
