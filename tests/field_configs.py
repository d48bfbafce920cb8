"""The field's launch configs (tests/field_configs/), made runnable on a 2-process CPU box by the changes its README
lists, and the verdict of each with the recipe it is meant for: "trained" (results.json holds the file's settings) or
the refusal, given before anything loads. Used by tests/test_field_configs.py and benchmarks/field_configs.py."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

FIELD = Path(__file__).resolve().parent / "field_configs"

# Each file, the recipe it is meant for, and (for a DeepSpeed JSON) the accelerate config that points at it.
CASES: dict[str, str] = {
    "accelerate_deepspeed.yaml": "zero", "accelerate_fp8.yaml": "fp8", "accelerate_fsdp.yaml": "fsdp",
    "accelerate_multi_gpu.yaml": "data_parallel", "accelerate_multi_node.yaml": "data_parallel",
    "accelerate_single_accelerator.yaml": "baseline",
    "accelerate_zero_stage1_config.json": "zero", "accelerate_zero_stage2_config.json": "zero",
    "accelerate_zero_stage2_offload_config.json": "zero3_offload", "accelerate_zero_stage3_config.json": "zero",
    "accelerate_zero_stage3_offload_config.json": "zero3_offload",
    "trl_deepspeed_zero1.yaml": "zero", "trl_deepspeed_zero2.yaml": "zero", "trl_deepspeed_zero3.yaml": "zero",
    "trl_fsdp1.yaml": "fsdp", "trl_fsdp2.yaml": "fsdp", "trl_multi_gpu.yaml": "data_parallel",
    "trl_single_gpu.yaml": "baseline", "trl_context_parallel_2gpu.yaml": "fsdp",
    "trl_alst_ulysses_4gpu.yaml": "sequence_parallel",
}


def cpu_copy(name: str, out: Path, edit_fp16: bool = False, **changes: object) -> Path:
    """The accelerate config to launch `name` with, as a CPU user changes it (README), plus `changes` (yaml keys;
    for a JSON: its keys). A DeepSpeed JSON is launched through a DEEPSPEED config that points at its copy."""
    out.mkdir(parents=True, exist_ok=True)
    if name.endswith(".json"):
        ds = json.loads((FIELD / name).read_text())
        if edit_fp16 and ds.get("fp16", {}).get("enabled") is True:
            ds["fp16"]["enabled"] = "auto"
        ds.update(changes)
        (out / name).write_text(json.dumps(ds, indent=1))
        config = {"distributed_type": "DEEPSPEED", "num_processes": 2,
                  "deepspeed_config": {"deepspeed_config_file": str(out / name),
                                       "zero3_init_flag": ds.get("zero_optimization", {}).get("stage") == 3}}
    else:
        config = yaml.safe_load((FIELD / name).read_text())
        single = config.get("distributed_type") in ("NO", None) or config.get("num_processes", 1) == 1
        config.update(num_processes=1 if single else 2, num_machines=1, machine_rank=0)
        config.pop("main_process_ip", None)
        config.pop("main_process_port", None)
        ds = config.get("deepspeed_config") or {}
        if "deepspeed_config_file" in ds:  # Accelerate's template points at its sibling folder
            source = FIELD / ("accelerate_" + Path(ds["deepspeed_config_file"]).name)
            copy = json.loads(source.read_text())
            if edit_fp16 and copy.get("fp16", {}).get("enabled") is True:
                copy["fp16"]["enabled"] = "auto"
            (out / source.name).write_text(json.dumps(copy, indent=1))
            ds["deepspeed_config_file"] = str(out / source.name)
        config.update(changes)
    path = out / (Path(name).stem + ".yaml")
    path.write_text(yaml.safe_dump(config))
    return path
