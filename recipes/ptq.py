"""Post-training quantization for serving: a trained model's Linear layers become int8 with activations quantized
on the fly (dynamic int8, torchao), no training and no calibration data. Reports the eval metric and the size on
disk before and after, and saves <output_dir>/quantized_model.pt (after
`import torchao`, torch.load(..., weights_only=True) reads it).
    accelerate launch recipes/baseline.py --output_dir outputs/base
    python recipes/ptq.py --model_name_or_path outputs/base
Only the Linear layers of the transformer blocks are quantized; embeddings, norms and the task head stay fp32.
"""

import json
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `shared/` beside recipes/, from any directory

from shared.core.args import parse_args
from shared.core.launch import claim_output_dir, configure_process, entrypoint, resolve_launch, start_run
from shared.core.models import transformer_layers
from shared.core.preflight import stop_if_preflight
from shared.core.rules import Support
from shared.core.tasks import load_task
from shared.techniques.quant import check_linear_only, conv1d_to_linear, dir_bytes

RECIPE = "ptq"
# What it runs under; any other launch is refused before anything loads (shared/core/rules.py).
SUPPORT = Support(shardings=("none",), max_processes=1, instead="`python recipes/ptq.py` (one process)",
                  needs_trained_model=True)


def add_args(p):
    """This recipe's own flags (none: it quantizes the model it is given)."""


@entrypoint  # under `accelerate launch`, a refusal is shown once, as the launcher's reason
def main(argv=None) -> dict:
    args = parse_args(argv, add_args, description=__doc__)
    # Refused here, before anything loads: a launch or flags this recipe cannot train (shared/core/rules.py).
    launch = resolve_launch(args, RECIPE, SUPPORT, model_given=bool(args.model_name_or_path))
    claim_output_dir(launch)  # after every check: --overwrite_output_dir deletes the old run
    configure_process(launch)  # CPU threads; a lone DeepSpeed process's rendezvous variables
    # No training: one process, which the Accelerator only places on its device and evaluates through (none of the
    # training arguments, precision, sampler, scheduler stepping, would act here).
    accelerator = Accelerator()
    start_run(accelerator, launch)  # checks what Accelerate resolved; fp16 on CPU; logs, seed, trackers
    # The technique's library, imported once the launch is known to be valid: --help and a refused launch
    # need not wait for its import (seconds).
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    task = load_task(launch, accelerator)
    model = task.model.to(accelerator.device).eval()
    check_linear_only(model, RECIPE, "quantizes")  # refuses experts that are not nn.Linear
    stop_if_preflight(accelerator, launch, task, model, None)  # --preflight: print the resolved run, stop
    before = task.evaluate(model, task.eval_dataloader, accelerator)
    fp32_bytes = dir_bytes(args.model_name_or_path) if Path(args.model_name_or_path).is_dir() else None

    # The technique: dynamic int8 (per-row int8 weights, per-token int8 activations) on the blocks' Linear layers.
    conv1d_to_linear(model)  # GPT-2's Conv1D layers become nn.Linear, which torchao quantizes
    blocks = next(name for name, m in model.named_modules() if m is transformer_layers(model))
    quantize_(model, Int8DynamicActivationInt8WeightConfig(),
              filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and fqn.startswith(blocks + "."))
    after = task.evaluate(model, task.eval_dataloader, accelerator)

    out = Path(launch.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), out / "quantized_model.pt")
    task.save_preprocessing(str(out))
    results = {
        "recipe": RECIPE, "task": task.name, "model": task.model_id, "scheme": "int8 dynamic activations, int8 weights",
        "model_type": model.config.model_type,
        "quantized_layers": sum("Tensor" in type(m.weight).__name__ and type(m.weight) is not nn.Parameter
                                for m in model.modules() if isinstance(m, nn.Linear)),
        **{f"fp32_{k.removeprefix('eval_')}": v for k, v in before.items()},
        **{f"int8_{k.removeprefix('eval_')}": v for k, v in after.items()},
        "fp32_bytes_on_disk": fp32_bytes,
        "int8_bytes_on_disk": (out / "quantized_model.pt").stat().st_size,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    accelerator.print(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
