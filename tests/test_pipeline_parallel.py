"""Pipeline parallel: the stage cut computes the unsplit model's loss and gradients, and the real 2-process pipeline
(torch.distributed.pipelining over gloo) trains like the unsplit model, each process holding only its stage (or its
2 stages under the interleaved and V schedules)."""

import copy
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shared.core.errors import RecipeError
from shared.core.launch import free_port
from shared.core.losses import count_items
from shared.core.models import preset_config, transformer_layers
from shared.core.rules import Run
from shared.techniques.pipeline_stages import (
    Stage,
    bubble_fraction,
    bubble_report,
    build_stages,
    checkpoint_per_process,
    evaluate,
    process_stages,
    schedule_order,
    split_layers,
    stage_list,
    sum_tied_grads,
    summed_loss,
    tied_weight,
)
from shared.tools.catalogue import recipe_run
from tests.conftest import launch, load_params, load_recipe, max_param_diff, run_recipe
from tests.parallel_runs import COMMON, single
from tests.probed_run import launch_probed, run_probed
from tests.quant_models import make_model_dir
from tests.test_reliability import _kill_tree, _start, _wait_for_checkpoint

GRAD_TOL = 1e-6  # fp32, same batch, stages chained in one process; measured 0.0
# fp32 AdamW at lr 3e-3, 6 steps, vs 1 process: micro-batch sums and fixed-length padding change last bits, which
# Adam's m/sqrt(v) magnifies where v is tiny; 5e-5 is under 2% of one update (as for FSDP vs DDP).
PARAM_TOL = 5e-5


def _model_and_batch(task: str, layers: int = 3, preset: str = "tiny"):
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSequenceClassification

    torch.manual_seed(0)
    cfg = preset_config(task, preset, vocab_size=50)
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    if task == "image-classification":
        cfg.num_hidden_layers = 3
        model = AutoModelForImageClassification.from_config(cfg)
        return model, torch.randn(4, 3, 32, 32), {}, torch.tensor([0, 1, 1, 0])
    cfg.num_hidden_layers, cfg.n_layer = layers, layers
    auto = AutoModelForCausalLM if task == "causal-lm" else AutoModelForSequenceClassification
    model = auto.from_config(cfg)
    ids = torch.randint(3, 50, (4, 12))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # padding must be masked the same way in every stage
    mask[3, 5:] = 0
    labels = ids.masked_fill(mask == 0, -100) if task == "causal-lm" else torch.tensor([0, 1, 1, 0])
    return model, ids, {"attention_mask": mask}, labels


@pytest.mark.parametrize("task, preset", [("causal-lm", "tiny"), ("text-classification", "tiny"),
                                          ("image-classification", "tiny"), ("causal-lm", "tiny-llama")])
def test_stages_compute_the_unsplit_loss_and_gradients(task, preset):
    model, x, kw, labels = _model_and_batch(task, preset=preset)
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
    embedding = whole.get_input_embeddings().weight if task == "causal-lm" else None
    is_tied = task == "causal-lm" and whole.get_output_embeddings().weight is embedding  # GPT-2; not tiny-llama
    if is_tied:  # lm_head is the embedding, held by the first and the last stage
        name = next(n for n, p in whole.named_parameters() if p is embedding)
        grads[name] = grads[name] + grads.pop("lm_head.weight")
    assert grads.keys() == ref.keys()
    diff = max((grads[n] - ref[n]).abs().max().item() for n in ref)
    print(f"{task} {preset}: |loss diff| {abs(loss.item() - ref_loss.item()):.1e}, max grad diff {diff:.1e}")
    assert diff <= GRAD_TOL

    # each stage holds only its own blocks (+ embeddings on the first, head on the last): count them
    blocks = transformer_layers(whole)
    per_block = [sum(p.numel() for p in b.parameters()) for b in blocks]
    block_params = {id(p) for p in blocks.parameters()}
    outside = sum(p.numel() for p in whole.parameters() if id(p) not in block_params)
    tied = embedding.numel() if is_tied else 0
    counts = [sum(p.numel() for p in s.parameters()) for s in stages]
    assert counts[0] + counts[1] == sum(per_block) + outside + tied
    for stage, r, count in zip(stages, ranges, counts, strict=True):
        own_blocks = sum(p.numel() for b in stage.blocks for p in b.parameters())
        assert own_blocks == sum(per_block[i] for i in r)  # the other stage's blocks are gone
        assert count > own_blocks  # plus its end of the model

def test_bad_split_fails_before_training(tmp_path):
    assert split_layers(4, 2) == [range(0, 2), range(2, 4)]
    with pytest.raises(RecipeError, match="2 stages of at least one block"):
        split_layers(4, 2, "1,2")
    with pytest.raises(SystemExit, match="not divisible by --n_microbatches"):
        run_recipe("pipeline_parallel", tmp_path, "--per_device_train_batch_size", "6", "--n_microbatches", "4")


def test_bubble_is_read_from_the_schedule_and_bad_counts_are_refused(tmp_path, monkeypatch):
    """The bubble, from each process's actions as torch's schedule classes order them, run against their inputs'
    readiness: 1F1B's and interleaved 1F1B's come out as the known (P-1)/(V*N+P-1) (P processes, V stages each, N
    micro-batches), and the zero-bubble schedules fill most of it. Counts a schedule cannot run, and models with
    fewer blocks than its stages, are refused with the fix."""
    from torch.distributed import pipelining

    classes = {name: getattr(pipelining, c) for name, c in load_recipe("pipeline_parallel").SCHEDULES.items()}
    for processes, n in ((2, 4), (4, 8)):
        found = {}
        for name, cls in classes.items():
            stages = sum(map(len, process_stages(cls, _run(processes, n, name)).values()))
            blocks = [len(r) for r in split_layers(2 * processes, stages)]  # the same model, cut in 1 or 2 a process
            found[name] = bubble_fraction(schedule_order(cls, processes, n), blocks)
        print(f"P={processes} N={n}: " + ", ".join(f"{k} {v:.4f}" for k, v in found.items()))
        assert found["1f1b"] == pytest.approx((processes - 1) / (n + processes - 1)) == found["gpipe"]
        assert found["interleaved_1f1b"] == pytest.approx((processes - 1) / (2 * n + processes - 1))
        assert max(found["interleaved_zb"], found["zbv"], found["dualpipev"]) < found["interleaved_1f1b"]

    # the rule table's words, torch's reason, and the nearest counts torch's schedule runs
    with pytest.raises(RecipeError, match=r"^Refused before training: --schedule interleaved_1f1b cannot run "
                                          r"--n_microbatches 5 on 2 processes \(torch: .*multiple of the number of "
                                          r"rounds \(2\), but got 5\)\. Fix: Pass --n_microbatches 4 or 6 "):
        process_stages(classes["interleaved_1f1b"], _run(2, 5, "interleaved_1f1b"))
    with pytest.raises(RecipeError, match=r"at least as many microbatches as stages.*Pass --n_microbatches 4 \("):
        process_stages(classes["dualpipev"], _run(2, 2, "dualpipev"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # what `accelerate launch` with accelerate_configs/pipeline.yaml sets
    monkeypatch.setenv("ACCELERATE_DYNAMO_MODE", "default")  # ... with its mark (else: leftovers, refused)
    with pytest.raises(SystemExit, match="--schedule interleaved_1f1b cannot run --n_microbatches 5"):
        run_recipe("pipeline_parallel", tmp_path / "out", "--schedule", "interleaved_1f1b", "--n_microbatches", "5",
                   "--per_device_train_batch_size", "10")
    assert not (tmp_path / "out" / "results.json").exists()
    shallow = _model_and_batch("causal-lm", layers=2)[0]  # the tiny preset's 2 blocks, for 2 x 2 stages
    with pytest.raises(RecipeError, match=r"The model has 2 blocks, fewer than the 4 stages \(--schedule zbv: 2 "
                                          r"stages on each of the 2 processes\)\. Fix: .*or a deeper model"):
        build_stages(shallow, process_stages(classes["zbv"], _run(2, 4, "zbv")), 0, flag="--schedule zbv")


def _run(processes: int, n_microbatches: int, schedule: str) -> Run:
    """The rules.Run of a pipeline launch, as resolve_launch makes it."""
    return recipe_run(recipe="pipeline_parallel", sharding="ddp", launched="ddp", num_processes=processes,
                      microbatches=n_microbatches, flags={"schedule": f"--schedule {schedule}"})


RUNS = [*((name, "tiny") for name in ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")),
        ("zbv", "tiny-llama")]  # (--schedule, --model_preset) of the 2-process test, 4 blocks each


def _unsplit(preset: str) -> tuple:
    """A 4-block model, a batch, and the unsplit model's loss (over the batch's items) and gradients."""
    model, ids, kw, labels = _model_and_batch("causal-lm", layers=4, preset=preset)
    whole = copy.deepcopy(model)
    loss = summed_loss("causal-lm")(whole(input_ids=ids, **kw).logits, labels) / count_items("causal-lm", labels)
    loss.backward()
    return model, ids, kw, labels, loss.item(), {n: p.grad for n, p in whole.named_parameters()}


def _two_process_step(rank: int, port: int, out_dir: str) -> None:
    """One of 2 processes: each schedule's training step and evaluation on this process's stages of a 4-block model,
    beside the unsplit model's loss and gradients."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from shared.core.tasks import Task

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    schedules, found = load_recipe("pipeline_parallel").SCHEDULES, {}
    for name, preset in RUNS:
        model, ids, kw, labels, _, ref = _unsplit(preset)
        loss_fn, item_count = summed_loss("causal-lm"), {"n": count_items("causal-lm", labels)}
        cls = getattr(pipelining, schedules[name])
        owners = process_stages(cls, _run(2, 4, name))
        stage, layers = build_stages(model, owners, rank)
        num_stages = len(layers)
        pipes = [pipelining.PipelineStage(s, i, num_stages, torch.device("cpu"))
                 for s, i in zip(stage_list(stage), owners[rank], strict=True)]
        schedule = cls(pipes if len(pipes) > 1 else pipes[0], n_microbatches=4, scale_grads=False,
                       loss_fn=lambda out, y, c=item_count, f=loss_fn: f(out, y) / c["n"])
        losses = []
        last = {"target": labels, "losses": losses, "return_outputs": False} if stage.is_last else {}
        schedule.step(*((ids,) if stage.is_first else ()), **kw, **last)
        ends = [r for r, held in owners.items() if {0, num_stages - 1} & set(held)]
        sum_tied_grads([t for t in map(tied_weight, stage_list(stage)) if t is not None], dist.new_group(ends))
        held = [(n, p) for part in stage_list(stage) for n, p in part.model.named_parameters()]
        diff = max((p.grad - ref.get(n, ref.get("transformer.wte.weight"))).abs().max().item() for n, p in held)
        last_rank = next(r for r, held in owners.items() if num_stages - 1 in held)
        task, batch = Task("causal-lm", model, "", None, None, ""), {"input_ids": ids, "labels": labels, **kw}
        metrics = evaluate(task, schedule, stage, [batch], item_count, last_rank)
        found[f"{name} {preset}"] = {"stages": owners[rank], "grad_diff": diff, "params": [n for n, _ in held],
                                     "loss": torch.stack(losses).sum().item() if losses else None, **metrics,
                                     **bubble_report(schedule, layers, 2, 4)}
    (Path(out_dir) / f"{rank}.json").write_text(json.dumps(found))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_schedule_computes_the_unsplit_loss_and_gradients(tmp_path):
    """2 real processes (gloo), torch's schedule classes: one step of each computes the unsplit model's loss and
    gradients, each process holding its own stages (interleaved: r and r+2; V: r and 3-r), and evaluates it alike.
    GPT-2 under every schedule (its head tied to the embedding: both copies get the summed gradient), and a
    Llama-style decoder (rotary positions, an untied head) under ZBV."""
    import torch.multiprocessing as mp

    # fork: the processes start with this one's imports (spawned, each would import transformers again)
    mp.start_processes(_two_process_step, args=(free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    runs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    held = {"gpipe": [[0], [1]], "1f1b": [[0], [1]], "interleaved_1f1b": [[0, 2], [1, 3]],
            "interleaved_zb": [[0, 2], [1, 3]], "zbv": [[0, 3], [1, 2]], "dualpipev": [[0, 3], [1, 2]]}
    assert sorted(runs[0]) == sorted(f"{name} {preset}" for name, preset in RUNS)
    for name, preset in RUNS:
        model, *_, ref_loss, ref = _unsplit(preset)
        names = set(ref) | ({"lm_head.weight"} if "lm_head.weight" not in ref else set())  # a tied head's copy
        a, b = runs[0][f"{name} {preset}"], runs[1][f"{name} {preset}"]
        assert [a["stages"], b["stages"]] == held[name]
        assert set(a["params"]) | set(b["params"]) == names and not set(a["params"]) & set(b["params"])
        (loss,) = [r["loss"] for r in (a, b) if r["loss"] is not None]  # the last stage's process
        print(f"{name} ({preset}): stages {held[name]}, |loss diff| {abs(loss - ref_loss):.1e}, max grad diff "
              f"{max(a['grad_diff'], b['grad_diff']):.1e}, bubble {a['bubble_fraction']:.4f} "
              f"(1F1B {a['bubble_fraction_1f1b']:.4f})")
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
        assert max(a["grad_diff"], b["grad_diff"]) <= GRAD_TOL
        assert a["eval_loss"] == b["eval_loss"] == pytest.approx(ref_loss, rel=1e-5)
        assert a["bubble_fraction"] == b["bubble_fraction"]
        assert a["bubble_fraction_1f1b"] == runs[0]["1f1b tiny"]["bubble_fraction"]
    bubble = {name: runs[0][f"{name} tiny"]["bubble_fraction"] for name in held}
    assert bubble["zbv"] < bubble["interleaved_1f1b"] < bubble["1f1b"] == bubble["gpipe"]


def _stage_params(out_dir) -> list[dict]:
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    return [load_file(out_dir / f) for f in sorted(set(index.values()))]


def test_gpt_1f1b_pipeline_trains_like_the_unsplit_model(tmp_path_factory, tmp_path):
    ref_dir, ref = single(tmp_path_factory)  # the same model unsplit, 1 process, same batches
    r = launch_probed("pipeline_parallel", tmp_path, *COMMON, "--per_device_train_batch_size", "16",
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
    with pytest.raises(RecipeError, match="holds the state of 2 processes.*this run has 3.*--num_processes 2"):
        process.hooks["load"]([], str(tmp_path))
    process = _Process(0, 2)
    checkpoint_per_process(process, *_stage_state(model, 0, layout="2,1"))
    with pytest.raises(RecipeError,
                       match="holds another stage.*Missing key.*same --pipeline_stages/--layers_per_stage"):
        process.hooks["load"]([], str(tmp_path))


@pytest.fixture(scope="module")
def deep_gpt(tmp_path_factory) -> Path:
    """A saved 4-block GPT-2 and the built-in word tokenizer: a block for each of 2 stages on each of 2 processes."""
    return make_model_dir(tmp_path_factory.getbasetemp() / "models", "causal-lm", hidden=64, layers=4)


@pytest.mark.slow
def test_pipeline_killed_resumes_to_the_same_parameters(deep_gpt, tmp_path):
    """Interleaved 1F1B, 2 stages on each of 2 processes, trains like the unsplit model; each process saves both its
    stages and their optimizer state, and after kill -9 of both processes `latest` restores them: no work lost."""
    # 6 batches an epoch: a run resumed from step 4 crosses into the second epoch
    args = ["--task", "causal-lm", "--model_name_or_path", deep_gpt, "--disable_dropout", "--max_train_steps", 12,
            "--max_train_samples", 24, "--per_device_train_batch_size", 4, "--max_eval_samples", 8,
            "--max_seq_length", 32, "--learning_rate", "1e-3", "--lr_scheduler_type", "constant"]
    pipe = ["--schedule", "interleaved_1f1b", "--checkpointing_steps", 4]
    ref = run_probed("data_parallel", tmp_path / "unsplit", *args)  # 1 process, the model whole, the same batches
    r = launch_probed("pipeline_parallel", tmp_path / "full", *args, *pipe, config="pipeline.yaml")
    assert (r["num_processes"], r["schedule"], r["process_stages"]) == (2, "interleaved_1f1b", [[0, 2], [1, 3]])
    assert r["stage_layers"] == [[0, 1], [1, 2], [2, 3], [3, 4]]
    print(f"loss {r['initial_loss']:.7f} vs {ref['initial_loss']:.7f}; grad norm {r['first_step_grad_norm']:.7f} vs "
          f"{ref['first_step_grad_norm']:.7f}; bubble {r['bubble_fraction']:.4f} vs 1F1B's "
          f"{r['bubble_fraction_1f1b']:.4f}")
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-5)
    assert r["first_step_grad_norm"] == pytest.approx(ref["first_step_grad_norm"], rel=1e-5)
    assert r["bubble_fraction"] < r["bubble_fraction_1f1b"]
    full = {k: v for part in _stage_params(tmp_path / "full") for k, v in part.items()}
    diff = max_param_diff(load_params(tmp_path / "unsplit"), full)
    print(f"max |param(interleaved pipeline) - param(unsplit)| after 12 steps = {diff:.2e}")
    assert diff <= PARAM_TOL
    for step in (tmp_path / "full" / "checkpoints").iterdir():
        assert (step / "rank_00000").is_dir() and (step / "rank_00001").is_dir(), step
    # each process's checkpoint: both its stages' blocks (Stages 0 and 1 of the process), an Adam state for each
    own = tmp_path / "full" / "checkpoints" / "step_00000012" / "rank_00000"
    saved = load_file(own / "model.safetensors")
    assert "0.model.transformer.wte.weight" in saved and "1.model.lm_head.weight" not in saved
    assert {k.split(".")[2] for k in saved if ".blocks." in k} == {"0", "2"}  # block i of stage i; safetensors names
    assert len(torch.load(own / "optimizer.pt", weights_only=True)["state"]) == len(saved)

    proc = _start(tmp_path / "cut", *args, *pipe, config="pipeline.yaml", recipe="pipeline_parallel")
    _wait_for_checkpoint(proc, tmp_path / "cut")
    _kill_tree(proc, signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0, "the run finished before the kill: nothing was tested"
    r = launch("pipeline_parallel", tmp_path / "cut", *args, *pipe, "--resume_from_checkpoint", "latest",
               config="pipeline.yaml")
    assert r["num_processes"] == 2 and 4 <= r["resumed_from_step"] < 12, r["resumed_from_step"]
    cut = {k: v for part in _stage_params(tmp_path / "cut") for k, v in part.items()}
    diff = max_param_diff(full, cut)
    print(f"pipeline killed, resumed at step {r['resumed_from_step']}: max abs param diff vs uninterrupted {diff:.1e}")
    assert diff <= 1e-6
    # GPT-2's tied head: the last stage's copy (process 1's second stage), restored from its own state, still equals
    # the first stage's
    last = tmp_path / "cut" / "checkpoints" / "step_00000012"
    first_copy = load_file(last / "rank_00000" / "model.safetensors")["0.model.transformer.wte.weight"]
    assert torch.equal(first_copy, load_file(last / "rank_00001" / "model.safetensors")["1.model.lm_head.weight"])


def test_an_epoch_is_the_batches_this_process_reads(deep_gpt, tmp_path):
    """The pipeline's processes all read the same batches: --num_train_epochs 1 is every batch once (it was half).
    Under ZBV, the V-shaped schedule: process 0 holds the first and the last stage (inputs, loss, both tied copies)."""
    r = launch("pipeline_parallel", tmp_path, "--task", "causal-lm", "--model_name_or_path", deep_gpt, "--schedule",
               "zbv", "--num_train_epochs", 1, "--max_train_samples", 64, "--max_eval_samples", 8,
               "--max_seq_length", 32, "--per_device_train_batch_size", 8, "--n_microbatches", 2,
               "--learning_rate", "3e-3", "--no_save_model", config="pipeline.yaml")
    blocks = r["train_examples"]  # packed blocks, --max_train_samples of them
    assert r["num_processes"] == 2 and r["max_train_steps"] == -(-blocks // 8) == 8
    assert (r["schedule"], r["process_stages"], r["tied_weight_copies"]) == ("zbv", [[0, 3], [1, 2]], 2)
    print(f"zbv: loss {r['initial_loss']:.3f} -> {r['train_loss']:.3f}, eval {r['eval_loss']:.3f}; bubble "
          f"{r['bubble_fraction']:.4f} vs 1F1B's {r['bubble_fraction_1f1b']:.4f}")
    assert r["bubble_fraction"] < r["bubble_fraction_1f1b"]
    assert r["train_loss"] < r["initial_loss"] and r["eval_loss"] < r["initial_loss"]
