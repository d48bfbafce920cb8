"""The memory planner: published figures, its activation formula against autograd's saved tensors, and its
per-process predictions against the quick matrix's measured runs (tiny and base presets, three tasks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from shared import plan
from shared.meter import saved_activation_bytes
from shared.models import AUTO_CLASSES, preset_config

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- published figures


def test_zero_paper_figures():
    """ZeRO paper, Figure 1: 7.5B parameters, 64 devices, mixed-precision Adam (K=12)."""
    psi, n = 7.5e9, 64
    per_stage = [plan.zero_model_state_bytes(psi, n, stage) / 1e9 for stage in range(4)]
    print("ZeRO stage 0-3, GB per device:", [round(v, 2) for v in per_stage])
    assert plan.zero_model_state_bytes(1, 1, 0) == 16  # 16 bytes per parameter
    assert [round(v, 1) for v in per_stage] == [120.0, 31.4, 16.6, 1.9]
    # Each stage divides the right pieces by N: with N=1 every stage is the baseline's 16 bytes.
    assert all(plan.zero_model_state_bytes(psi, 1, s) == 16 * psi for s in range(4))


def test_planner_deepspeed_rows_follow_the_paper():
    """The planner's ZeRO rows: 2+2+12 bytes/param divided as in the paper, plus DeepSpeed's fp32 gradient
    partition (4/N bytes/param, as deepspeed's own estimator counts it)."""
    spec = _spec("causal-lm", "base")
    psi, n = spec.num_params, 8
    for tech in plan.TECHNIQUES:
        if tech.strategy.startswith("zero") and tech.offload == "none":
            p = plan.predict(spec, tech, "bf16", n, 1, 8)
            stage = int(tech.strategy[-1])
            assert p.model_states == pytest.approx(plan.zero_model_state_bytes(psi, n, stage) + 4 * psi / n)


def test_nf4_about_half_a_byte_per_parameter():
    """QLoRA: NF4 is 4 bits plus 32/64 bits of absmax per value, 8/64 + 32/(64*256) with double quantization."""
    n = 4096 * 4096
    assert plan.nf4_bytes(n, double_quant=False) / n == pytest.approx(0.5 + 4 / 64)
    dq = plan.nf4_bytes(n) / n
    assert dq == pytest.approx(0.5 + 1 / 64 + 4 / (64 * 256), rel=1e-6)  # 4.127 bits
    assert 0.51 < dq < 0.52
    assert plan.int8_bytes(n, 4096) / n == pytest.approx(1 + 4 / 4096)


def test_eight_bit_adam_keeps_small_tensors_in_32_bit():
    """bitsandbytes: tensors under 4096 elements keep fp32 state (8 B/param); the rest 2 B + absmax per 256."""
    assert plan.adam_state_bytes([4095], eight_bit=True) == plan.adam_state_bytes([4095])
    assert plan.adam_state_bytes([4096 * 256], eight_bit=True) == 2 * 4096 * 256 + 8 * 4096 + 4
    assert plan.adam_state_bytes([100, 200], eight_bit=False) == 8 * 300 + 8  # + torch's 4-byte step per tensor


# ---------------------------------------------------------------- the command line


def test_cli_gpt2_xl_on_8_gpus(capsys):
    """The README example runs offline (the built-in copy of gpt2-xl's config) and prints launch commands."""
    rows = plan.main(["--model_name_or_path", "gpt2-xl", "--num_gpus", "8", "--gpu_memory", "80GB",
                      "--seq_len", "1024", "--per_device_batch_size", "8"])
    out = capsys.readouterr().out
    print(out)
    spec_params = next(p for p, _ in rows).trainable
    assert 1.55e9 < spec_params < 1.56e9  # GPT-2 XL: 1.558B parameters
    fits = {(p.technique.name, p.precision) for p, why in rows if not why}
    # fp32 DDP with batch 8 x 1024: 16 B/param = 25 GB states plus ~100 GB of activations: does not fit 80 GB
    assert ("baseline", "fp32") not in fits
    assert ("activation_checkpointing", "fp32") in fits
    assert "accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 8 recipes/zero.py" in out
    assert "Does not fit" in out and "largest: activations" in out


def test_cli_local_dir_and_bad_input(tmp_path, capsys):
    from transformers import BertConfig

    BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256).save_pretrained(
        tmp_path)
    plan.main(["--model_name_or_path", str(tmp_path), "--gpu_memory", "16GB", "--seq_len", "128"])
    assert "task: text-classification" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="does not exist"):
        plan.main(["--model_name_or_path", str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="not a size"):
        plan.build_parser().parse_args(["--gpu_memory", "eighty"])
    with pytest.raises(SystemExit, match="per_device_batch_size must be at least 1"):
        plan.main(["--per_device_batch_size", "0"])


def test_offload_moves_states_to_host():
    spec = _spec("causal-lm", "base")
    by = {t.name: t for t in plan.TECHNIQUES}
    z3 = plan.predict(spec, by["zero3"], "bf16", 4, 1, 8)
    off = plan.predict(spec, by["zero3_offload"], "bf16", 4, 1, 8)
    nvme = plan.predict(spec, by["zero3_nvme"], "bf16", 4, 1, 8)
    assert off.weights == off.optimizer == 0
    assert off.host == pytest.approx(z3.weights + z3.optimizer + 4 * spec.num_params / 4)
    assert nvme.nvme > 0 and nvme.host < off.host
    lora = plan.predict(spec, by["qlora_4bit"], "bf16", 1, 1, 8)
    assert lora.trainable < 0.01 * spec.num_params and lora.weights < 0.5 * z3.weights * 4


# ---------------------------------------------------------------- activations vs autograd's saved tensors

ACTIVATION_CASES = [  # (task, hidden, layers, heads, intermediate, batch, seq, dropout, precision, checkpointing)
    ("text-classification", 128, 3, 4, 512, 2, 64, True, "fp32", False),
    ("text-classification", 128, 3, 4, 512, 2, 64, True, "bf16", False),
    ("text-classification", 128, 3, 4, 512, 2, 64, False, "fp32", True),
    ("causal-lm", 128, 3, 4, 512, 2, 64, True, "fp32", False),
    ("causal-lm", 128, 3, 4, 512, 2, 64, False, "bf16", False),
    ("causal-lm", 64, 2, 2, 256, 4, 32, True, "bf16", True),
    ("image-classification", 128, 3, 4, 512, 2, None, False, "fp32", False),
    ("image-classification", 128, 3, 4, 512, 2, None, False, "bf16", False),
    ("image-classification", 128, 3, 4, 512, 2, None, False, "fp32", True),
]


def _config(task, h, n_layers, a, i, dropout):
    cfg = preset_config(task, "tiny", vocab_size=1000)
    if task == "causal-lm":
        cfg.update(dict(n_embd=h, n_layer=n_layers, n_head=a, n_inner=i))
    else:
        cfg.update(dict(hidden_size=h, num_hidden_layers=n_layers, num_attention_heads=a, intermediate_size=i))
    if not dropout:
        for k, v in cfg.to_dict().items():
            if ("dropout" in k or "pdrop" in k) and isinstance(v, float):
                setattr(cfg, k, 0.0)
    return cfg


@pytest.mark.parametrize("case", ACTIVATION_CASES, ids=lambda c: f"{c[0]}-{c[8]}-ckpt{int(c[9])}-drop{int(c[7])}")
def test_activation_formula_matches_saved_tensors(case):
    """Bytes autograd saves in one forward + loss (shared.meter.saved_activation_bytes), on CPU, vs the formula."""
    task, h, n_layers, a, i, b, s, dropout, precision, ckpt = case
    cfg = _config(task, h, n_layers, a, i, dropout)
    torch.manual_seed(0)
    model = AUTO_CLASSES[task].from_config(cfg).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if task == "image-classification":
        inputs, labels = {"pixel_values": torch.randn(b, 3, cfg.image_size, cfg.image_size)}, torch.zeros(b).long()
    else:
        ids = torch.randint(0, cfg.vocab_size, (b, s))
        inputs, labels = {"input_ids": ids}, ids if task == "causal-lm" else torch.zeros(b).long()
    with saved_activation_bytes(model) as saved:
        with torch.autocast("cpu", torch.bfloat16, enabled=precision == "bf16"):
            logits = model(**inputs).logits
        logits = logits.float()
        if task == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)).backward()
    predicted = plan.activation_bytes(plan.model_spec(cfg, task, "x"), b, s, precision, ckpt, kernels="cpu").saved
    ratio = predicted / saved["bytes"]
    print(f"{case}: measured {saved['bytes']:,} B, predicted {predicted:,.0f} B, ratio {ratio:.3f}")
    assert predicted == pytest.approx(saved["bytes"], rel=0.03)


# ---------------------------------------------------------------- planner vs the quick matrix's measurements


def _spec(task, preset):
    config, task, _ = plan.load_config(None, preset, task, None, None)
    return plan.model_spec(config, task, preset)


@pytest.fixture(scope="module")
def quick_matrix(tmp_path_factory):
    """The quick matrix (3 tasks x tiny/base x baseline, bf16, checkpointing, but ViT-base bf16; 2 steps), run once
    in a fresh process
    or read from MATRIX_JSON (a matrix.json written by `python benchmarks/matrix.py --quick`)."""
    if os.environ.get("MATRIX_JSON"):
        return json.loads(Path(os.environ["MATRIX_JSON"]).read_text())
    out = tmp_path_factory.mktemp("matrix")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "matrix.py"), "--quick", "--output_dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((out / "matrix.json").read_text())
    report["dir"] = str(out)
    return report


def test_quick_matrix_outputs(quick_matrix):
    rows = quick_matrix["rows"]
    assert len(rows) == 17 and all(r["status"] == "ok" for r in rows), [r["error"] for r in rows if r["error"]]
    if "dir" in quick_matrix:
        out = Path(quick_matrix["dir"])
        table = (out / "matrix.md").read_text()
        assert table.count("| ok |") == 17 and "Machine:" in table
        png = (out / "matrix.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    for r in rows:  # the runs did what they say
        m = r["measured"]
        assert m["num_processes"] == 1 and m["mixed_precision"] == ("bf16" if "bf16" in r["args"] else "no")
        assert m["compute_dtype"] == ("bfloat16" if "bf16" in r["args"] else "float32")
        assert r["throughput_vs_baseline"] > 0


def test_planner_vs_measured(quick_matrix):
    """Model-state bytes per process within 5%; peak RSS within 20% (runtime + training peak, docs/planner.md);
    activations saved for backward (the checkpointing recipe's probe) within 5%."""
    print(f"\n{'run':<44}{'quantity':<34}{'measured MiB':>14}{'predicted MiB':>15}{'ratio':>8}")
    failures = []
    for r in quick_matrix["rows"]:
        m, p = r["measured"], r["predicted"]
        checks = [(k, m[k][0], p[k], 0.05) for k in ("param_bytes", "grad_bytes", "optimizer_state_bytes")]
        checks.append(("peak_memory_bytes", m["peak_memory_bytes"][0], p["peak_memory_bytes"], 0.20))
        for k in ("activation_bytes_without_checkpointing", "activation_bytes_with_checkpointing"):
            if m.get(k) is not None:
                checks.append((k, m[k], p[k], 0.05))
        for key, mv, pv, tol in checks:
            ratio = pv / mv
            print(f"{r['run'] + ' ' + r['task'][:6] + ' ' + r['preset']:<44}{key:<34}{mv / 2**20:>14.2f}"
                  f"{pv / 2**20:>15.2f}{ratio:>8.3f}")
            if abs(ratio - 1) > tol:
                failures.append(f"{r['run']} {r['task']} {r['preset']} {key}: ratio {ratio:.3f} (tolerance {tol})")
    assert not failures, failures
