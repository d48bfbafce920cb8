"""docs/adapting_a_copy.md's first changes, applied to a copied baseline: each edits the copied recipe file only, and
the copy's recipe_core/ stays as the copy command wrote it."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shared.tools.cp import VENDORED, copy_recipe
from tests.test_copy_out import SMALL, _env, _outside

CALL = "    task = load_task(launch, accelerator)\n"
F1 = '''

def f1(predictions, labels):
    """Binary F1 of class 1, over the whole validation set."""
    tp = ((predictions == 1) & (labels == 1)).sum().item()
    fp = ((predictions == 1) & (labels != 1)).sum().item()
    fn = ((predictions != 1) & (labels == 1)).sum().item()
    return {"f1": 2 * tp / max(1, 2 * tp + fp + fn)}


def class_weighted_loss(logits, labels, kept):
    weight = torch.tensor([1.0, 3.0], device=logits.device)  # class 1 counts three times
    return F.cross_entropy(logits.float(), labels, weight=weight, reduction="sum")


def class_weight_count(labels, kept):
    return torch.tensor([1.0, 3.0], device=labels.device)[labels].sum()
'''
IMPORTS = "import torch  # noqa: E402\nimport torch.nn.functional as F  # noqa: E402\n"
SCHEDULE_CALL = "    optimizer, scheduler = optimizer_and_scheduler(launch, task.model, max_steps)\n"
SCHEDULE = "    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=2 * max_steps)  # my own\n"


def _core(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in sorted((dest / VENDORED).rglob("*.py"))}


def _edit(dest: Path, hook_lines: str, after: str = CALL) -> None:
    recipe = dest / "baseline.py"
    text = recipe.read_text()
    assert after in text
    if F1 not in text:
        text = text.replace("\n\n@entrypoint", IMPORTS + F1 + "\n\n@entrypoint", 1)
    recipe.write_text(text.replace(after, after + hook_lines, 1))


def _run(dest: Path, *extra: str) -> dict:
    cmd = [sys.executable, "baseline.py", *SMALL, *extra, "--output_dir", "out"]
    proc = subprocess.run(cmd, cwd=dest, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((dest / "out" / "results.json").read_text())


def test_a_metric_a_loss_and_a_schedule_are_edits_of_the_copied_recipe_alone(tmp_path):
    """And results.json names the schedule the loop stepped (the user's cosine), not --lr_scheduler_type's linear
    (issue 37); the unedited copy's run below records the flag's linear schedule."""
    dest = _outside(tmp_path)
    copy_recipe("baseline", dest)
    fresh = _core(dest)
    _edit(dest, "    task.compute_metrics = f1\n"
                "    task.loss_fn, task.count_fn = class_weighted_loss, class_weight_count\n")
    _edit(dest, SCHEDULE, after=SCHEDULE_CALL)
    results = _run(dest)
    assert 0.0 <= results["eval_f1"] <= 1.0 and "eval_accuracy" not in results
    assert math.isfinite(results["eval_loss"])  # the user's loss, evaluated
    assert results["lr_scheduler"]["stepped"] == "CosineAnnealingLR", results["lr_scheduler"]
    assert results["lr_scheduler"]["from"] == "the recipe's own scheduler"
    assert results["lr_scheduler"]["flag_not_applied"] == "--lr_scheduler_type linear"
    assert "linear" not in results["lr_scheduler"]["stepped"] + results["lr_scheduler"]["from"]
    # 2 steps of a 4-step half wave: half the peak rate (the flag's linear schedule would end at 0)
    assert results["lr_scheduler"]["final_lr"] == pytest.approx(results["learning_rate"] / 2)
    assert _core(dest) == fresh  # zero lines edited outside the copied recipe file


def test_data_in_another_format_needs_only_flags(tmp_path):
    dest = _outside(tmp_path)
    copy_recipe("baseline", dest)
    fresh = _core(dest)
    rows = [{"review": f"{'great fine good' if i % 2 else 'dull bad long'} film {i}", "stars": i % 2}
            for i in range(80)]
    (dest / "reviews.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = _run(dest, "--train_file", "reviews.jsonl", "--text_column", "review", "--label_column", "stars")
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    # no edit of the schedule: the one --lr_scheduler_type built (its default, linear), stepped to its end
    assert results["lr_scheduler"] == {"stepped": "LambdaLR(_get_linear_schedule_with_warmup_lr_lambda)",
                                       "from": "--lr_scheduler_type linear", "final_lr": 0.0}
    assert _core(dest) == fresh


def _task(name: str = "text-classification"):
    from shared.core.tasks import Task

    return Task(name, None, "tiny", None, None, "built-in")


def test_the_pipeline_trains_with_the_users_loss_and_the_others_refuse_it_with_the_reason():
    import torch

    from shared.core.errors import InputError
    from shared.core.losses import classification_loss
    from shared.techniques import ulysses
    from shared.techniques.chunked_loss import ChunkedLoss
    from shared.techniques.pipeline_stages import stage_loss

    logits, labels = torch.randn(4, 2), torch.tensor([0, 1, 1, 0])
    task = _task()
    assert stage_loss(task) is classification_loss
    task.loss_fn = lambda lg, y, kept: 3 * classification_loss(lg, y)
    assert torch.allclose(stage_loss(task)(logits, labels), 3 * classification_loss(logits, labels))
    task.compute_metrics = lambda p, y: {}
    with pytest.raises(InputError, match="compute_metrics: the pipeline's last stage"):
        stage_loss(task)
    with pytest.raises(InputError, match="loss_fn: a chunked loss needs the head"):
        ChunkedLoss.__call__(type("C", (), {"task": task})(), None, {}, 1.0)
    with pytest.raises(InputError, match="loss_fn: sequence parallel computes the loss"):
        ulysses.loss(None, {}, 1.0, task)


def test_a_local_qwen_style_model_needs_only_its_directory(tmp_path):
    """A local model directory (a tiny Qwen2 classifier with tied embeddings, bf16 in its config, its tokenizer
    beside it) is --model_name_or_path: no edit at all."""
    import torch
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from shared.core import data

    dest = _outside(tmp_path)
    copy_recipe("baseline", dest)
    fresh = _core(dest)
    texts = data.builtin_split("text-classification", "train")["text"]
    tokenizer = data.build_word_tokenizer(list(texts), "text-classification")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=True, num_labels=2, pad_token_id=tokenizer.pad_token_id,
                         torch_dtype=torch.bfloat16)
    model_dir = dest / "my-qwen"
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    results = _run(dest, "--model_name_or_path", "my-qwen")
    assert 0.0 <= results["eval_accuracy"] <= 1.0
    assert _core(dest) == fresh
