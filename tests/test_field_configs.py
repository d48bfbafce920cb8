"""The launch configs and DeepSpeed JSONs the field publishes (Accelerate's templates, TRL's accelerate_configs:
tests/field_configs/, sources and commits in its README), each with the recipe it is meant for: it trains as
written, or it is refused before anything loads, naming the setting and the fix. Never a raw traceback, never a
setting silently replaced. Then the classes those files are samples of, as generated variants; and four of them
launched for real, the optimizer steps counted from outside the recipe (tests/counted_run.py), for accumulation
given by the flag, by the accelerate config and by the DeepSpeed JSON.

docs/results/field_configs.md is generated from here: `python tests/test_field_configs.py`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import ROOT, free_port, load_params
from tests.field_configs import CASES, FIELD, cpu_copy
from tests.test_launch_grid import verdict

# What each published file gets, as published (after the README's CPU changes): None = passes every check and
# builds the Accelerator (the real launches below train four of them); else a phrase of its refusal.
EXPECTED = {
    "accelerate_deepspeed.yaml": '"fp16": {"enabled": "auto"}',  # its JSON says fp16: DeepSpeed refuses it on CPU
    "accelerate_fp8.yaml": "backend: TE",
    "accelerate_fsdp.yaml": "fsdp_version: 1",  # no fsdp_version: accelerate launch's default, FSDP1
    "accelerate_zero_stage1_config.json": '"fp16": {"enabled": "auto"}',
    "accelerate_zero_stage2_config.json": '"fp16": {"enabled": "auto"}',
    "accelerate_zero_stage2_offload_config.json": '"fp16": {"enabled": "auto"}',
    "accelerate_zero_stage3_config.json": '"fp16": {"enabled": "auto"}',
    "accelerate_zero_stage3_offload_config.json": '"fp16": {"enabled": "auto"}',
    "trl_fsdp1.yaml": "fsdp_version: 1",
    "trl_context_parallel_2gpu.yaml": "cp=2",
    "trl_alst_ulysses_4gpu.yaml": "sp=2",
}


def field_verdicts(tmp: Path, edit_fp16: bool = False) -> dict[str, str | None]:
    return {name: verdict(recipe, str(cpu_copy(name, tmp / name, edit_fp16=edit_fp16)), tmp / f"{name}-out")
            for name, recipe in CASES.items()}


_verdicts: dict[str, dict[str, str | None]] = {}


def verdicts(tmp_path_factory, edit_fp16: bool = False) -> dict[str, str | None]:
    if edit_fp16 not in _verdicts:
        _verdicts[edit_fp16] = field_verdicts(tmp_path_factory.mktemp("field"), edit_fp16)
    return _verdicts[edit_fp16]


def test_every_published_file_trains_or_is_refused_naming_the_setting(tmp_path_factory):
    found = verdicts(tmp_path_factory)
    assert set(found) == set(CASES) and len(CASES) == len(list(FIELD.glob("*.*"))) - 1  # every file but README
    for name, message in found.items():
        says = EXPECTED.get(name)
        if says is None:
            assert message is None, f"{name}: {message}"
        else:
            assert message is not None and says in message, f"{name}: {message}"
            assert "Traceback" not in message
    # As a CPU user edits it (fp16 -> "auto"): every DeepSpeed template runs, its optimizer and scheduler blocks too.
    edited = verdicts(tmp_path_factory, edit_fp16=True)
    for name in CASES:
        if EXPECTED.get(name, "").startswith('"fp16"'):
            assert edited[name] is None, f"{name}, fp16 edited to auto: {edited[name]}"


# The classes the published files are samples of: each variant trains as written (None) or is refused with these
# words. FSDP variants change trl_fsdp2.yaml's fsdp_config; DeepSpeed ones, Accelerate's ZeRO-2 JSON (fp16: auto).
FSDP_VARIANTS = [
    ({"fsdp_reshard_after_forward": False}, None),
    ({"fsdp_reshard_after_forward": "SHARD_GRAD_OP"}, None),  # FSDP1's name in FSDP2's key: what it says
    ({"fsdp_sharding_strategy": "SHARD_GRAD_OP"}, None),  # FSDP1's key: honoured as reshard_after_forward false
    ({"fsdp_sharding_strategy": "NO_SHARD"}, "recipes/data_parallel.py"),
    ({"fsdp_sharding_strategy": "HYBRID_SHARD"}, "--dp_replicate_size"),
    ({"fsdp_reshard_after_forward": "sometimes"}, "write true"),
    ({"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"}, "one unit per transformer block"),
    ({"fsdp_auto_wrap_policy": "NO_WRAP"}, "one unit per transformer block"),
    ({"fsdp_backward_prefetch": "BACKWARD_POST"}, "always prefetches"),
    ({"fsdp_forward_prefetch": True}, "does not implement it"),
    ({"fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_offload_params": True}, None),
    ({"fsdp_version": 1}, "fsdp_version: 1"),
]
DS_VARIANTS = [
    ({"zero_optimization": {"stage": 0}}, "recipes/data_parallel.py"),
    ({"tensor_parallel": {"autotp_size": 4}}, "AutoTP"),
    ({"sequence_parallel_size": 2}, "recipes/sequence_parallel.py"),
    ({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, "--mixed_precision"),
    ({"optimizer": {"type": "OneBitAdam", "params": {"lr": "auto"}}}, "1-bit"),
    ({"train_batch_size": 48, "gradient_accumulation_steps": 1}, None),  # micro-batch derived: 24 per process
    ({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2},
     "--per_device_train_batch_size 12"),
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 1},
     "--gradient_accumulation_steps 2"),
    ({"train_batch_size": 64}, None),  # the micro-batch nobody set is derived from the global batch
    ({"gradient_accumulation_steps": 4}, None),
    ({"fp16": {"enabled": True}}, '"fp16": {"enabled": "auto"}'),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": "auto"}}}, None),
]


def test_generated_variants_of_the_published_files(tmp_path):
    failures = []
    for i, (changes, says) in enumerate(FSDP_VARIANTS):
        config = cpu_copy("trl_fsdp2.yaml", tmp_path / f"f{i}")
        data = yaml.safe_load(config.read_text())
        data["fsdp_config"].update(changes)
        config.write_text(yaml.safe_dump(data))
        got = verdict("fsdp", str(config), tmp_path / f"f{i}-out")
        if (got is None) != (says is None) or (says and says not in got):
            failures.append(f"fsdp {changes}: expected {says!r}, got {got!r}")
    for i, (changes, says) in enumerate(DS_VARIANTS):
        config = cpu_copy("accelerate_zero_stage2_config.json", tmp_path / f"d{i}", edit_fp16=True, **changes)
        got = verdict("zero", str(config), tmp_path / f"d{i}-out")
        if (got is None) != (says is None) or (says and says not in got):
            failures.append(f"DeepSpeed JSON {changes}: expected {says!r}, got {got!r}")
    assert not failures, "\n".join(failures)


def test_a_setting_spelled_another_way_is_read_not_written_twice(tmp_path):
    """stage3_gather_16bit_weights_on_model_save has an alias and a deprecated name (DeepSpeed's own config model):
    the recipe reads them, adds no second spelling, and DeepSpeed's config check accepts the result."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from shared.core.args import parse_args
    from shared.techniques.deepspeed_setup import (
        add_deepspeed_args,
        resolve_deepspeed_config,
        zero_config,
        zero_spellings,
    )

    names = zero_spellings("stage3_gather_16bit_weights_on_model_save")
    assert {"gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save"} <= set(names)
    for name in names:
        for value in (True, "auto"):
            user = {"zero_optimization": {"stage": 3, name: value}, "train_micro_batch_size_per_gpu": "auto"}
            json_file = tmp_path / "spelling.json"
            json_file.write_text(json.dumps(user))
            args = parse_args(["--deepspeed_config", str(json_file)], add_deepspeed_args)
            config = resolve_deepspeed_config(args, zero_config(3))
            zero = config["zero_optimization"]
            assert [k for k in zero if k in names] == [name], (name, zero)
            assert zero[name] is True
            DeepSpeedZeroConfig(**zero)  # DeepSpeed's own check: no pair of spellings


def counted(config: Path, recipe: str, out: Path, *args: str) -> tuple[dict, dict]:
    """Launch `recipe` under `config` in 2 processes with its optimizer steps counted from outside."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--main_process_port",
           str(free_port()), str(ROOT / "tests" / "counted_run.py"), recipe, "--max_train_steps", "3",
           "--max_train_samples", "256", "--max_eval_samples", "32", "--report_to", "none", *args,
           "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "results.json").read_text()), json.loads((out / "steps_0.json").read_text())


def test_zero1_accumulation_from_the_accelerate_config(tmp_path):
    """TRL's deepspeed_zero1.yaml with gradient_accumulation_steps: 4, the value `accelerate config` asks for: the
    loop takes 4 micro-batches per step, DeepSpeed steps 3 times for --max_train_steps 3, and the linear schedule
    goes down at each of those steps (it decayed to the last rate at the first, before the fix)."""
    config = cpu_copy("trl_deepspeed_zero1.yaml", tmp_path / "cfg", mixed_precision="no")
    data = yaml.safe_load(config.read_text())
    data["deepspeed_config"]["gradient_accumulation_steps"] = 4
    config.write_text(yaml.safe_dump(data))
    r, steps = counted(config, "zero", tmp_path / "out")
    assert steps["engine_steps"] == 3 == r["max_train_steps"]
    assert r["gradient_accumulation_steps"] == 4 == r["deepspeed_gradient_accumulation_steps"]
    assert "ACCELERATE_GRADIENT_ACCUMULATION_STEPS" in r["deepspeed_settings_from"]["gradient_accumulation_steps"]
    assert steps["lr"] == sorted(steps["lr"], reverse=True) and len(set(steps["lr"])) == 3
    assert r["lr_scheduler"]["from"] == "--lr_scheduler_type linear", r["lr_scheduler"]  # the recipe's, under ZeRO


def test_zero2_json_runs_its_own_optimizer_and_scheduler(tmp_path):
    """Accelerate's zero_stage2_config.json (fp16 edited to auto), accumulation 2 in the JSON: its AdamW and its
    WarmupDecayLR run (Accelerate's DummyOptim / DummyScheduler), DeepSpeed steps 3 times."""
    config = cpu_copy("accelerate_zero_stage2_config.json", tmp_path / "cfg", edit_fp16=True,
                      gradient_accumulation_steps=2)
    r, steps = counted(config, "zero", tmp_path / "out")
    assert steps["engine_steps"] == 3 and r["deepspeed_gradient_accumulation_steps"] == 2
    assert r["deepspeed_optimizer"] == "AdamW" and r["deepspeed_scheduler"] == "WarmupDecayLR"
    assert r["lr_scheduler"]["stepped"] == "WarmupDecayLR", r["lr_scheduler"]  # what results.json says was stepped
    assert r["lr_scheduler"]["from"] == "the DeepSpeed JSON's scheduler block"
    assert "DeepSpeed JSON" in r["deepspeed_settings_from"]["gradient_accumulation_steps"]
    assert steps["lr"][0] == 0  # WarmupDecayLR starts at warmup_min_lr: the JSON's schedule, not the recipe's


def test_zero3_json_with_a_deprecated_spelling_saves_the_model(tmp_path):
    """Accelerate's zero_stage3_config.json with the gather setting under its deprecated name, accumulation by the
    flag: DeepSpeed steps 3 times and the consolidated model is written and loads."""
    changes = json.loads((FIELD / "accelerate_zero_stage3_config.json").read_text())["zero_optimization"]
    changes.pop("stage3_gather_16bit_weights_on_model_save")
    changes["stage3_gather_fp16_weights_on_model_save"] = True
    config = cpu_copy("accelerate_zero_stage3_config.json", tmp_path / "cfg", edit_fp16=True,
                      zero_optimization=changes, gradient_accumulation_steps="auto")
    r, steps = counted(config, "zero", tmp_path / "out", "--gradient_accumulation_steps", "2")
    assert steps["engine_steps"] == 3 and r["deepspeed_gradient_accumulation_steps"] == 2 and r["zero_stage"] == 3
    assert "--gradient_accumulation_steps" in r["deepspeed_settings_from"]["gradient_accumulation_steps"]
    assert all(t.numel() > 0 for t in load_params(tmp_path / "out").values())  # gathered, not ZeRO-3's empty shards


def test_fsdp2_as_trl_writes_it(tmp_path):
    """TRL's fsdp2.yaml: FULL_STATE_DICT and CPU-RAM-efficient loading honoured (not replaced by the recipe's
    SHARDED_STATE_DICT), 3 optimizer steps, and each setting's source in results.json."""
    r, steps = counted(cpu_copy("trl_fsdp2.yaml", tmp_path / "cfg", mixed_precision="no"), "fsdp", tmp_path / "out",
                       "--checkpointing_steps", "3")
    assert steps["optimizer_steps"] == 3 == r["max_train_steps"]
    assert r["state_dict_type"] == "FULL_STATE_DICT" and r["reshard_after_forward"] is True
    assert r["fsdp_settings_from"]["state_dict_type"] == "fsdp_state_dict_type in the launch config"
    assert (tmp_path / "out" / "checkpoints" / "step_00000003" / "pytorch_model_fsdp.bin").exists()  # full, not DCP


def table(found: dict[str, str | None], edited: dict[str, str | None]) -> str:
    lines = ["<!-- generated by python tests/test_field_configs.py; do not edit -->",
             "# The launch configs the field publishes, launched as written", "",
             "Accelerate's `config_yaml_templates` and `deepspeed_config_templates` and TRL's `accelerate_configs` "
             "(sources and commits: tests/field_configs/README.md), each with the recipe it is meant for, changed "
             "only as a CPU run must (2 processes). Checked by tests/test_field_configs.py through each recipe's "
             "start-up; four are launched for real there, with the optimizer steps counted from outside.", "",
             "| file | recipe | as published | fp16 edited to auto |", "|---|---|---|---|"]
    for name, recipe in CASES.items():
        def cell(message: str | None) -> str:
            if message is None:
                return "trains"
            message = re.sub(r"/\S*/([^/\s]+\.(json|yaml))", r"\1", " ".join(message.split()))  # no tmp paths
            return "refused: " + message.removeprefix("Refused before training: ")[:220].replace("|", "/")
        lines.append(f"| `{name}` | {recipe} | {cell(found[name])} | "
                     f"{cell(edited[name]) if edited[name] != found[name] else 'same'} |")
    return "\n".join(lines) + "\n"


def test_docs_table_is_current(tmp_path_factory):
    docs = ROOT / "docs" / "results" / "field_configs.md"
    assert docs.read_text() == table(verdicts(tmp_path_factory), verdicts(tmp_path_factory, True)), \
        "regenerate: python tests/test_field_configs.py"


if __name__ == "__main__":
    import tempfile

    tmp = Path(tempfile.mkdtemp())
    (ROOT / "docs" / "results" / "field_configs.md").write_text(
        table(field_verdicts(tmp / "a"), field_verdicts(tmp / "b", edit_fp16=True)))
