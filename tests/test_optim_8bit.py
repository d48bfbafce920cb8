"""8-bit AdamW: a quarter of the optimizer state, counted on the live tensors, for the same loss as torch AdamW."""

import pytest

from tests.conftest import run_recipe
from tests.quant_models import make_model_dir

TASKS = ("text-classification", "causal-lm", "image-classification")
# Same data, same init, no dropout: the only difference is the optimizer. After 10 steps the losses agreed to 3e-5
# relative on every task (2 layers); 8-bit moments add quantization noise, so allow 1% of the loss.
LOSS_RTOL = 0.01
COMMON = ("--max_train_steps", "4", "--disable_dropout", "--max_train_samples", "160", "--max_eval_samples", "64",
          "--no_save_model")


@pytest.mark.parametrize("task", TASKS)
def test_8bit_state_is_a_quarter_and_loss_matches(task, tmp_path_factory):
    # Width 256: nearly all parameters are in tensors of >= 4096 elements, the only ones bitsandbytes keeps in 8 bits.
    # One block is enough to measure that and halves the test's CPU time.
    model_dir = make_model_dir(tmp_path_factory.getbasetemp() / "models", task, layers=1)
    tmp = tmp_path_factory.mktemp(task)
    args = ("--task", task, "--model_name_or_path", model_dir, *COMMON)
    torch_adamw = run_recipe("baseline", tmp / "baseline", *args)
    adamw8bit = run_recipe("optim_8bit", tmp / "optim_8bit", *args)

    # The class that really stepped, inside Accelerate's optimizer wrapper.
    assert (torch_adamw["optimizer_class"], adamw8bit["optimizer_class"]) == ("AdamW", "AdamW8bit")
    assert adamw8bit["tensors_with_8bit_state"] > 0
    ratio = adamw8bit["optimizer_state_bytes"][0] / torch_adamw["optimizer_state_bytes"][0]
    assert ratio <= 0.27, f"8-bit state is {ratio:.3f}x torch AdamW's"
    assert adamw8bit["param_bytes"] == torch_adamw["param_bytes"]  # the model itself is unchanged
    assert adamw8bit["train_loss"] == pytest.approx(torch_adamw["train_loss"], rel=LOSS_RTOL)
    assert adamw8bit["train_loss"] != torch_adamw["train_loss"]  # really a different optimizer


def test_paged_is_refused_without_cuda(tmp_path):
    with pytest.raises(SystemExit, match="--paged needs a CUDA device"):
        run_recipe("optim_8bit", tmp_path, "--paged", "--max_train_steps", "1")
