"""DeepSpeed ZeRO 1/2/3 and offload, 2 processes via `accelerate launch` on CPU: sharding, parity, save, resume."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIGS, ROOT, launch, launch_command, load_params, load_recipe, max_param_diff

# The same data, steps and accumulation for DDP and every ZeRO stage. fp32, no dropout: runs that differ only in
# how state is sharded must end with the same parameters.
STEPS, GA, MICRO = 6, 2, 4
COMMON = ("--task", "causal-lm", "--max_train_steps", STEPS, "--gradient_accumulation_steps", GA,
          "--per_device_train_batch_size", MICRO, "--max_train_samples", 256, "--max_eval_samples", 64,
          "--disable_dropout", "--logging_steps", 3,
          "--learning_rate", 1e-3)  # random weights loaded from a directory: not the 5e-5 of a pretrained model
PARITY_TOL = 1e-5  # fp32: max |param difference| vs DDP after STEPS optimizer steps (measured ~1e-7, see report)
JSON_EXAMPLE = CONFIGS / "ds_config_zero3_auto.json"


def causal_lm_dir(path: Path, vocab_size: int | None = None, n_embd: int = 64) -> Path:
    """A saved GPT-2 (random weights, seed 0) and the built-in word tokenizer: a "pretrained" starting point.

    Runs compared for parity start from it: ZeRO-3 builds a model from a config under zero.Init, which draws
    different random weights than a plain build with the same seed; from_pretrained loads the same ones.
    """
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from shared.core.data import build_word_tokenizer, builtin_split

    tok = build_word_tokenizer(builtin_split("causal-lm", "train")["text"], "causal-lm")
    config = GPT2Config(vocab_size=vocab_size or len(tok), n_embd=n_embd, n_layer=2, n_head=2, n_positions=128,
                        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """DDP (the reference, gradient_accumulation.py on multi_cpu.yaml) and ZeRO-1/2/3 (zero.py on zeroN.yaml)."""
    base = tmp_path_factory.mktemp("zero")
    common = (*COMMON, "--model_name_or_path", causal_lm_dir(base / "init"))
    out = {}
    out["ddp"] = (base / "ddp", launch("gradient_accumulation", base / "ddp", *common, config="multi_cpu.yaml"))
    for stage in (1, 2, 3):
        extra = ("--checkpointing_steps", STEPS // 2) if stage == 3 else ()  # the ZeRO-3 resume test starts there
        d = base / f"zero{stage}"
        out[f"zero{stage}"] = (d, launch("zero", d, *common, *extra, config=f"zero{stage}.yaml"))
    return out


def params(model_dir: Path) -> dict:
    """The saved parameters. The ZeRO-3 gather also writes the tied lm_head (same values as the embedding)."""
    p = load_params(model_dir)
    if "lm_head.weight" in p:
        assert p.pop("lm_head.weight").equal(p["transformer.wte.weight"])
    return p


def _psi(model_dir: Path) -> int:
    return sum(t.numel() for t in params(model_dir).values())


def test_each_stage_trains_in_two_processes(runs):
    for name in ("zero1", "zero2", "zero3"):
        _, r = runs[name]
        assert r["distributed_type"] == "DEEPSPEED" and r["num_processes"] == 2, r
        assert r["zero_stage"] == int(name[-1])
        # Accelerate's accumulation and DeepSpeed's agree (a mismatch is silent in Accelerate: it warns).
        assert r["deepspeed_gradient_accumulation_steps"] == GA and r["gradient_accumulation_steps"] == GA
        assert r["deepspeed_gradient_clipping"] == 1.0 and r["deepspeed_micro_batch_size"] == MICRO
        assert r["train_loss"] < r["initial_loss"], r
        assert r["eval_perplexity"] < 40, r


@pytest.mark.slow  # two more launches; the stages' fixture trains BERT
@pytest.mark.parametrize("task", ["text-classification", "image-classification"])
def test_zero3_trains_the_other_families(task, tmp_path):
    """BERT and ViT under ZeRO-3 in 2 processes: partitioned, and the loss falls."""
    r = launch("zero", tmp_path, "--task", task, "--max_train_steps", 40, "--learning_rate", "3e-3",
               "--per_device_train_batch_size", 8, "--logging_steps", 5, "--max_eval_samples", 64, "--no_save_model",
               config="zero3.yaml")
    assert (r["distributed_type"], r["num_processes"], r["zero_stage"]) == ("DEEPSPEED", 2, 3)
    assert r["param_bytes"][0] < 0.6 * 4 * _numel_of_tiny(task)  # each process holds about half the parameters
    assert r["train_loss"] < 0.9 * r["initial_loss"], (r["initial_loss"], r["train_loss"])
    assert 0 <= r["eval_accuracy"] <= 1


def _numel_of_tiny(task: str) -> int:
    from shared.core.models import build_model, preset_config
    from shared.tools.plan import builtin_vocab_size

    config = preset_config(task, "tiny", vocab_size=builtin_vocab_size(task, "tiny"),
                           num_labels=2 if task == "text-classification" else 4)
    args = argparse.Namespace(task=task, model_name_or_path=None, model_preset="tiny", disable_dropout=False,
                              trust_remote_code=False)  # the flags build_model reads (model_source names the preset)
    return sum(p.numel() for p in build_model(args, config).parameters())


def test_sharding_bytes_vs_ddp_and_the_zero_paper(runs):
    """Per-process bytes on live tensors, counted just before the first optimizer step, vs DDP (fp32 AdamW)."""
    d, ddp = runs["ddp"]
    psi = _psi(d)
    n = 2
    print(f"\nmodel: {psi} parameters; per process, 2 processes, fp32 AdamW (bytes / parameter)")
    print("ZeRO paper, mixed-precision Adam per process: baseline 2+2+12=16, ZeRO-1 2+2+12/N, ZeRO-2 2+(2+12)/N, "
          "ZeRO-3 (2+2+12)/N")
    paper = {"ddp": 16, "zero1": 4 + 12 / n, "zero2": 2 + 14 / n, "zero3": 16 / n}
    # The fp32 analogue measured here: DDP keeps 4 (params) + 4 (grads) + 8 (2 moments); ZeRO adds a 4-byte fp32
    # master copy to the optimizer state (K = 12), sharded like the moments.
    fp32 = {"ddp": (4, 4, 8), "zero1": (4, 4, 12 / n), "zero2": (4, 4 / n, 12 / n), "zero3": (4 / n, 4 / n, 12 / n)}
    rows = {}
    for name in ("ddp", "zero1", "zero2", "zero3"):
        r = runs[name][1]
        p, g, o = (max(r[k]) / psi for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes"))
        rows[name] = (p, g, o)
        total = p + g + o
        print(f"{name:6s} params {p:5.2f} grads {g:5.2f} optimizer {o:5.2f} total {total:5.2f} | vs DDP "
              f"{total / sum(rows['ddp']):.2f} | fp32 formula {sum(fp32[name]):5.2f} | paper ratio to baseline "
              f"{paper[name] / paper['ddp']:.2f}")
    (ddp_p, ddp_g, ddp_o) = rows["ddp"]
    assert ddp_p == pytest.approx(4, rel=0.02) and ddp_g == pytest.approx(4, rel=0.02)
    assert ddp_o == pytest.approx(8, rel=0.02)
    for name, (p, g, o) in rows.items():
        if name == "ddp":
            continue
        want_p, want_g, want_o = fp32[name]
        # Optimizer state (stage >= 1): moments halved, plus the sharded fp32 master copy: 6 vs DDP's 8.
        assert o == pytest.approx(want_o, rel=0.1), (name, o)
        assert o / ddp_o < 0.8
        if name in ("zero2", "zero3"):  # gradients: half of DDP's, plus reduce buckets (large for a tiny model)
            assert want_g * 0.98 <= g <= want_g * 1.3 and g / ddp_g < 0.65, (name, g)
        else:
            # DeepSpeed's stage 1 reduce-scatters the whole gradients at the accumulation boundary and frees them:
            # they exist during the accumulation window, only partitions remain at the step.
            assert g <= ddp_g, (name, g)
        if name == "zero3":  # parameters: half of DDP's (small tensors below the persistence threshold stay whole)
            assert want_p * 0.98 <= p <= want_p * 1.3 and p / ddp_p < 0.65, (name, p)
        else:
            assert p == pytest.approx(4, rel=0.02)


def test_parameters_match_ddp_with_accumulation(runs):
    ddp = params(runs["ddp"][0])
    for name in ("zero1", "zero2", "zero3"):
        diff = max_param_diff(ddp, params(runs[name][0]))
        print(f"{name} vs DDP, {STEPS} steps, accumulation {GA}: max |param diff| = {diff:.2e}")
        assert diff <= PARITY_TOL, (name, diff)


RELOAD = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
from accelerate import Accelerator
sys.path.insert(0, sys.argv[1])
from shared.core.args import parse_args
from shared.core.launch import resolve_launch
from shared.core.tasks import load_task
model_dir = sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir)
empty = [n for n, p in model.named_parameters() if p.numel() == 0]
args = parse_args(["--task", "causal-lm", "--model_name_or_path", model_dir, "--max_train_samples", "256",
                   "--max_eval_samples", "64", "--disable_dropout"])
accelerator = Accelerator(cpu=True)
task = load_task(resolve_launch(args, "baseline"), accelerator)
metrics = task.evaluate(model, task.eval_dataloader, accelerator)
batch = next(iter(task.eval_dataloader))
with torch.no_grad():
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
print(json.dumps({"empty": empty, "eval_loss": metrics["eval_loss"], "logits_sum": logits.double().abs().sum().item(),
                  "dtypes": sorted({str(p.dtype) for p in model.parameters()})}))
"""


def test_zero3_model_reloads_in_a_fresh_process(runs):
    d, r = runs["zero3"]
    proc = subprocess.run([sys.executable, "-c", RELOAD, str(ROOT), str(d)], capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["empty"] == [] and out["dtypes"] == ["torch.float32"]
    # The eval loss is computed from the logits on the same fixed batches: sharded (ZeRO-3, 2 processes, in the run)
    # and consolidated (one process, reloaded from model.safetensors).
    print(f"ZeRO-3 eval_loss sharded {r['eval_loss']:.8f}, reloaded {out['eval_loss']:.8f}")
    assert out["eval_loss"] == pytest.approx(r["eval_loss"], abs=1e-5)
    # ...and the reloaded weights are the ones DDP trained.
    assert max_param_diff(params(runs["ddp"][0]), params(d)) <= PARITY_TOL


def test_zero3_resume_from_json_config(runs, tmp_path):
    """Stop at step 3, resume under ZeRO-3, here set up by the DeepSpeed JSON example ("auto" values)."""
    d, _ = runs["zero3"]
    ckpt = d / "checkpoints" / f"step_{STEPS // 2:08d}"
    assert (ckpt / "trainer_state.json").exists()
    resumed = launch("zero", tmp_path / "resumed", *COMMON, "--model_name_or_path", d.parent / "init",
                     "--resume_from_checkpoint", ckpt, config=None,
                     launch_args=("--use_deepspeed", "--num_processes", "2",
                                  "--deepspeed_config_file", str(JSON_EXAMPLE)))
    assert resumed["zero_stage"] == 3 and resumed["num_processes"] == 2
    assert resumed["deepspeed_gradient_accumulation_steps"] == GA  # "auto" resolved from the flag
    diff = max_param_diff(params(d), params(tmp_path / "resumed"))
    print(f"ZeRO-3 resumed at step {STEPS // 2} vs uninterrupted: max |param diff| = {diff:.2e}")
    assert diff == 0.0


@pytest.mark.slow  # a kill/resume or extra launch beyond the stages' own; `pytest -m slow`
def test_zero2_offload_resume(tmp_path):
    """ZeRO-2 with the optimizer offloaded to CPU (DeepSpeedCPUAdam), ViT: stop at step 3, resume, same result.

    Without schedule_the_optimizer_that_steps the resumed run's learning rate froze and it ended 5e-4 away."""
    args = ("--task", "image-classification", "--max_train_steps", 6, "--max_train_samples", 256,
            "--max_eval_samples", 64, "--per_device_train_batch_size", 8, "--logging_steps", 3, "--disable_dropout")
    full = launch("zero", tmp_path / "full", *args, "--checkpointing_steps", 3, config="zero2_offload.yaml")
    assert full["zero_stage"] == 2 and full["num_processes"] == 2 and full["distributed_type"] == "DEEPSPEED"
    assert full["offload_optimizer_device"] == "cpu" and full["optimizer_class"] == "DeepSpeedCPUAdam"
    assert full["optimizer_state_devices"] == ["cpu"] and 0 < full["eval_accuracy"] <= 1
    resumed = launch("zero", tmp_path / "resumed", *args, "--resume_from_checkpoint",
                     tmp_path / "full" / "checkpoints" / "step_00000003", config="zero2_offload.yaml")
    assert resumed["optimizer_class"] == "DeepSpeedCPUAdam"
    diff = max_param_diff(params(tmp_path / "full"), params(tmp_path / "resumed"))
    print(f"ZeRO-2 + CPU offload resumed at step 3 vs uninterrupted: max |param diff| = {diff:.2e}")
    assert diff == 0.0


@pytest.mark.slow  # a kill/resume or extra launch beyond the stages' own; `pytest -m slow`
def test_combined_zero2_offload_resume(tmp_path):
    """recipes/combined.py under ZeRO-2 + CPU offload, tiny GPT-2: stopped at step 3 and resumed, it ends where the
    uninterrupted run does. The default linear LR decay is kept: a frozen learning rate shows only if it changes."""
    args = ("--task", "causal-lm", "--max_train_steps", 6, "--max_train_samples", 128, "--max_eval_samples", 32,
            "--per_device_train_batch_size", 4, "--logging_steps", 3, "--disable_dropout")
    full = launch("combined", tmp_path / "full", *args, "--checkpointing_steps", 3, config="zero2_offload.yaml")
    assert (full["sharding"], full["offload"], full["num_processes"]) == ("zero2", "cpu", 2)
    assert full["optimizer_class"] == "DeepSpeedCPUAdam"
    assert full["optimizer_state_devices"] == ["cpu"]  # counted around ZeRO's first step, as in zero.py
    resumed = launch("combined", tmp_path / "resumed", *args, "--resume_from_checkpoint",
                     tmp_path / "full" / "checkpoints" / "step_00000003", config="zero2_offload.yaml")
    assert resumed["resumed_from_step"] == 3
    diff = max_param_diff(params(tmp_path / "full"), params(tmp_path / "resumed"))
    print(f"combined.py, ZeRO-2 + CPU offload, resumed at step 3 vs uninterrupted: max |param diff| = {diff:.2e}")
    assert diff == 0.0


@pytest.mark.slow  # a kill/resume or extra launch beyond the stages' own; `pytest -m slow`
def test_zero3_offload_two_processes(tmp_path):
    r = launch("zero3_offload", tmp_path, *COMMON, config="zero3_offload.yaml")
    assert r["distributed_type"] == "DEEPSPEED" and r["num_processes"] == 2 and r["zero_stage"] == 3
    assert r["offload_optimizer_device"] == "cpu" and r["offload_param_device"] == "cpu"
    assert r["optimizer_class"] == "DeepSpeedCPUAdam"  # the step runs on the offloaded fp32 copies
    assert r["optimizer_state_devices"] == ["cpu"]  # on a GPU machine: CPU, while parameters compute on cuda
    assert r["train_loss"] < r["initial_loss"]
    # Sharded as ZeRO-3 without offload (bytes / parameter): params ~2, grads ~2, optimizer ~6.
    psi = _psi(tmp_path)
    print("ZeRO-3 + CPU offload bytes/param:", {k: round(max(r[k]) / psi, 2) for k in
                                                 ("param_bytes", "grad_bytes", "optimizer_state_bytes")})
    assert max(r["optimizer_state_bytes"]) / psi == pytest.approx(6, rel=0.1)
    assert not any(p.numel() == 0 for p in load_params(tmp_path).values())


def test_zero3_offload_runs_without_config(tmp_path):
    """`accelerate launch recipes/zero3_offload.py`: no config file, no DeepSpeed flag; one process on CPU."""
    r = launch("zero3_offload", tmp_path, "--max_train_steps", 60, "--learning_rate", 3e-3,
               "--max_train_samples", 512, "--max_eval_samples", 64, "--logging_steps", 20, config=None)
    assert r["distributed_type"] == "DEEPSPEED" and r["num_processes"] == 1 and r["zero_stage"] == 3
    assert r["offload_param_device"] == "cpu" and r["optimizer_class"] == "DeepSpeedCPUAdam"
    assert r["train_loss"] < 0.5 * r["initial_loss"] and r["eval_accuracy"] > 0.8


def test_zero3_nvme_offload_end_to_end(tmp_path):
    nvme = tmp_path / "nvme"
    (nvme / "zero_stage_3").mkdir(parents=True)
    (nvme / "mine.bin").write_bytes(b"x")  # a user's files in the NVMe folder stay; only the run's swap files go
    (nvme / "zero_stage_3" / "notes.txt").write_text("mine")
    # An 8192 x 128 embedding: partitions over 1 MiB, which DeepSpeed swaps (smaller ones it never does).
    model_dir = causal_lm_dir(tmp_path / "model", vocab_size=8192, n_embd=128)
    cmd, env = launch_command("zero3_offload", tmp_path / "out", "--task", "causal-lm", "--model_name_or_path",
                              model_dir, "--learning_rate", 1e-3, "--max_train_steps", 6, "--max_train_samples", 128,
                              "--max_eval_samples", 32, "--logging_steps", 3, "--offload", "nvme", "--nvme_path", nvme,
                              config="zero3_nvme.yaml")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads((tmp_path / "out" / "results.json").read_text())
    assert r["offload_param_device"] == "nvme" and r["offload_optimizer_device"] == "nvme"
    assert r["num_processes"] == 2 and r["train_loss"] < r["initial_loss"]
    # DeepSpeed swapped to NVMe (the main process says how much it removed), and the run took its files away.
    removed = re.findall(r"removed the (\d+) NVMe swap files \(([\d.]+) MiB\)", proc.stdout + proc.stderr)
    print(f"NVMe: {removed} (files, MiB) removed under {nvme}")
    assert removed and all(int(n) > 0 and float(mib) > 0 for n, mib in removed), proc.stderr[-3000:]
    left = sorted(p.relative_to(nvme).as_posix() for p in nvme.rglob("*"))
    assert left == ["mine.bin", "zero_stage_3", "zero_stage_3/notes.txt"], left
    assert not any(p.numel() == 0 for p in load_params(tmp_path / "out").values())
    assert not (ROOT / "none").exists()  # DeepSpeed's fallback when the path is lost


# ---------------------------------------------------------------- conflicts fail before training


def _fails(argv: list[str], monkeypatch=None, env: dict | None = None) -> str:
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as err:
        load_recipe("zero").main([*map(str, argv), "--report_to", "none"])
    return str(err.value)


def test_conflicting_accumulation_json_vs_flag(tmp_path):
    cfg = json.loads(JSON_EXAMPLE.read_text())
    cfg["gradient_accumulation_steps"] = 4
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(cfg))
    msg = _fails(["--deepspeed_config", bad, "--gradient_accumulation_steps", 2, "--output_dir", tmp_path])
    assert "gradient_accumulation_steps" in msg and "4 from the DeepSpeed JSON" in msg
    assert "2 from --gradient_accumulation_steps" in msg and "before training" in msg


def test_conflicts_from_the_accelerate_config(tmp_path, monkeypatch):
    # What `accelerate launch` sets from a YAML with gradient_clipping: 0.5 and zero_stage: 1.
    msg = _fails(["--max_grad_norm", 1.0, "--zero_stage", 3, "--output_dir", tmp_path], monkeypatch,
                 {"ACCELERATE_GRADIENT_CLIPPING": "0.5", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "1"})
    assert "gradient_clipping: 1.0 from --max_grad_norm vs 0.5 from the accelerate config" in msg
    assert "zero_optimization.stage: 3 from --zero_stage vs 1 from the accelerate config" in msg


def test_micro_batch_and_precision_conflicts(tmp_path):
    cfg = json.loads(JSON_EXAMPLE.read_text())
    cfg["train_micro_batch_size_per_gpu"] = 8
    cfg["bf16"] = {"enabled": True}
    bad = tmp_path / "ds.json"
    bad.write_text(json.dumps(cfg))
    msg = _fails(["--deepspeed_config", bad, "--per_device_train_batch_size", 4, "--mixed_precision", "no",
                  "--output_dir", tmp_path])
    assert "train_micro_batch_size_per_gpu: 4 from --per_device_train_batch_size vs 8 from the DeepSpeed JSON" in msg
    assert "mixed_precision: no from --mixed_precision vs bf16 from the DeepSpeed JSON" in msg


def test_fp16_on_cpu_is_refused_naming_bf16(tmp_path):
    msg = _fails(["--mixed_precision", "fp16", "--output_dir", tmp_path])
    assert "fp16" in msg and "--mixed_precision bf16" in msg


def test_nvme_needs_a_path(tmp_path):
    with pytest.raises(SystemExit, match="--nvme_path"):
        load_recipe("zero3_offload").main(["--offload", "nvme", "--output_dir", str(tmp_path), "--report_to", "none"])


def test_conflict_through_accelerate_launch(tmp_path):
    """The same check end to end: YAML (zero1.yaml, stage 1) vs a DeepSpeed JSON (stage 3), 2 processes."""
    proc = launch("zero", tmp_path, "--deepspeed_config", JSON_EXAMPLE, config="zero1.yaml", expect_fail=True)
    assert "zero_optimization.stage: 1 from the accelerate config" in proc.stderr
    assert "vs 3 from the DeepSpeed JSON" in proc.stderr
    assert not (tmp_path / "results.json").exists()
