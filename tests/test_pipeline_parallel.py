"""Pipeline parallel: the stage cut computes the unsplit model's loss and gradients, and the real 2-process pipeline
(torch.distributed.pipelining over gloo) trains like the unsplit model, each process holding only its stage."""

import copy
import json
import signal

import pytest
import torch
from safetensors.torch import load_file

from shared.core.models import preset_config, transformer_layers
from shared.techniques.pipeline_stages import Stage, checkpoint_per_process, split_layers, summed_loss
from tests.conftest import launch, load_params, max_param_diff, run_recipe
from tests.parallel_runs import COMMON, single
from tests.test_reliability import _kill_tree, _start, _wait_for_checkpoint

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


class _Process:
    """What checkpoint_per_process uses of an Accelerator: this process's place, and the save/load hook lists."""

    def __init__(self, index: int, count: int):
        self.process_index, self.num_processes, self.device = index, count, torch.device("cpu")
        self.hooks = {}

    def register_save_state_pre_hook(self, hook):
        self.hooks["save"] = hook

    def register_load_state_pre_hook(self, hook):
        self.hooks["load"] = hook


def _stage_state(model, i: int, layout: str = "1,2"):
    stage = Stage(copy.deepcopy(model), split_layers(3, 2, layout)[i], is_first=i == 0, is_last=i == 1)
    optimizer = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return stage, optimizer, scheduler


def test_each_process_saves_and_resumes_its_own_stage(tmp_path):
    """The hooks save_state/load_state run on every process: rank_0000k/ holds stage k, its optimizer, schedule."""
    model = _model_and_batch("causal-lm")[0]
    saved = []
    for i in range(2):
        stage, optimizer, scheduler = _stage_state(model, i)
        for p in stage.parameters():
            p.grad = torch.ones_like(p)
        optimizer.step()
        scheduler.step()
        process = _Process(i, 2)
        checkpoint_per_process(process, stage, optimizer, scheduler)
        process.hooks["save"]([], [], str(tmp_path))
        saved.append((stage, optimizer))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank_00000", "rank_00001"]

    for i, (stage, optimizer) in enumerate(saved):  # fresh stages, as a resumed run builds them
        fresh, fresh_opt, fresh_sched = _stage_state(model, i)
        process = _Process(i, 2)
        checkpoint_per_process(process, fresh, fresh_opt, fresh_sched)
        process.hooks["load"]([], str(tmp_path))
        for (name, a), b in zip(stage.named_parameters(), fresh.parameters(), strict=True):
            assert torch.equal(a, b), name
            assert torch.equal(optimizer.state[a]["exp_avg_sq"], fresh_opt.state[b]["exp_avg_sq"]), name
        assert fresh_sched.last_epoch == 1 and fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]

    # another number of processes, or another cut of the model: refused with the fix
    process = _Process(2, 3)
    checkpoint_per_process(process, *_stage_state(model, 1))
    with pytest.raises(SystemExit, match="holds the state of 2 processes.*this run has 3.*--num_processes 2"):
        process.hooks["load"]([], str(tmp_path))
    process = _Process(0, 2)
    checkpoint_per_process(process, *_stage_state(model, 0, layout="2,1"))
    with pytest.raises(SystemExit, match="holds another stage.*Missing key.*same --pipeline_stages/--layers_per_stage"):
        process.hooks["load"]([], str(tmp_path))


@pytest.mark.slow
def test_pipeline_killed_resumes_to_the_same_parameters(tmp_path):
    """kill -9 of both stages after a checkpoint; `latest` restores each stage's own state: no work lost."""
    # 12 batches an epoch: the resumed run crosses into the second epoch
    args = ["--task", "causal-lm", "--disable_dropout", "--max_train_steps", 24, "--checkpointing_steps", 4,
            "--max_train_samples", 48, "--per_device_train_batch_size", 4, "--max_eval_samples", 16]
    launch("pipeline_parallel", tmp_path / "full", *args, config="pipeline.yaml")
    for step in (tmp_path / "full" / "checkpoints").iterdir():
        assert (step / "rank_00000").is_dir() and (step / "rank_00001").is_dir(), step
    proc = _start(tmp_path / "cut", *args, config="pipeline.yaml", recipe="pipeline_parallel")
    _wait_for_checkpoint(proc, tmp_path / "cut")
    _kill_tree(proc, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0, "the run finished before the kill: nothing was tested"
    r = launch("pipeline_parallel", tmp_path / "cut", *args, "--resume_from_checkpoint", "latest",
               config="pipeline.yaml")
    assert r["num_processes"] == 2 and 4 <= r["resumed_from_step"] < 24, r["resumed_from_step"]
    full, cut = ({k: v for part in _stage_params(tmp_path / d) for k, v in part.items()} for d in ("full", "cut"))
    diff = max_param_diff(full, cut)
    print(f"pipeline killed, resumed at step {r['resumed_from_step']}: max abs param diff vs uninterrupted {diff:.1e}")
    assert diff <= 1e-6
    # GPT-2's tied head: the last stage's copy, restored from its own state, still equals the first stage's
    last = tmp_path / "cut" / "checkpoints" / "step_00000024"
    first_copy = load_file(last / "rank_00000" / "model.safetensors")["model.transformer.wte.weight"]
    assert torch.equal(first_copy, load_file(last / "rank_00001" / "model.safetensors")["model.lm_head.weight"])


def test_an_epoch_is_the_batches_this_process_reads(tmp_path):
    """The pipeline's processes all read the same batches: --num_train_epochs 1 is every batch once (it was half)."""
    r = launch("pipeline_parallel", tmp_path, "--task", "causal-lm", "--num_train_epochs", 1, "--max_train_samples",
               64, "--max_eval_samples", 8, "--per_device_train_batch_size", 8, "--n_microbatches", 2,
               "--no_save_model", config="pipeline.yaml")
    blocks = r["train_examples"]  # packed blocks, --max_train_samples of them
    assert r["num_processes"] == 2 and r["max_train_steps"] == -(-blocks // 8) == 8
