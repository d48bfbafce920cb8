"""QLoRA: a 4-bit (or 8-bit) base that takes a fraction of its bf16 bytes, adapters that alone train, get gradients
and lower the loss, an adapter that reloads onto a freshly quantized base, a merge, DDP, and refused combinations."""


import pytest
import torch

from shared.techniques.quant import no_cpu_4bit_repacking
from tests.conftest import launch, run_recipe
from tests.quant_models import make_model_dir

TASKS = ("text-classification", "causal-lm", "image-classification")
COMMON = ("--max_train_samples", "160", "--max_eval_samples", "64", "--per_device_train_batch_size", "8",
          "--learning_rate", "3e-3", "--lora_dropout", "0")


def _model_dir(tmp_path_factory, task):
    # Width 256: each 4-bit layer's fixed constants (~1.3 KB of code books) are then < 1% of its weights.
    return make_model_dir(tmp_path_factory.getbasetemp() / "models", task)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 4-bit run per task, shared by the tests below. The causal LM runs on a width-256 model (the byte ratio is
    measured there) and also merges; the classifiers use the tiny preset, to keep CPU time down."""
    out = {}
    for task in TASKS:
        model = (("--model_name_or_path", _model_dir(tmp_path_factory, task), "--merge") if task == "causal-lm"
                 else ("--no_save_model",))
        out[task] = run_recipe("qlora", tmp_path_factory.mktemp(f"qlora-{task}"), "--task", task,
                               "--max_train_steps", "8", *COMMON, *model)
    return out


@pytest.mark.parametrize("task", TASKS)
def test_4bit_base_adapters_only_gradients_and_loss(runs, task):
    r = runs[task]
    assert (r["load_in"], r["bnb_4bit_quant_type"], r["double_quant"]) == ("4bit", "nf4", True)
    assert r["bnb_compute_dtype"] == "float32" and r["gradient_checkpointing"]
    assert r["quantized_layers"] >= 8
    if task == "causal-lm":  # width 256; at width 64 the per-layer code books push it to ~0.30-0.31
        assert r["quantized_to_bf16_weight_ratio"] <= 0.30, r["quantized_to_bf16_weight_ratio"]
    # Only LoRA matrices train, plus the new classification head (PEFT modules_to_save) where there is one.
    names = r["trainable_param_names"]
    assert names and all("lora_" in n or ".modules_to_save." in n for n in names), names
    # First backward: every LoRA matrix has a gradient; B (initialised to 0) a nonzero one, while A's is exactly 0
    # because it is multiplied by B = 0. From the second backward on, every A and B gradient is nonzero.
    first, second = r["lora_grads_first_backward"], r["lora_grads_second_backward"]
    assert first["lora_params"] == 2 * r["quantized_layers"]
    assert first["lora_no_grad"] == 0 and first["lora_B_zero_grad"] == 0
    assert first["lora_A_zero_grad"] == first["lora_params"] // 2
    assert second["lora_no_grad"] == second["lora_A_zero_grad"] == second["lora_B_zero_grad"] == 0
    if task != "text-classification":  # a frozen random BERT sits at ln 2 for many more than 8 steps
        assert r["train_loss"] < r["initial_loss"]


def _batch(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok(["the red fox ran to the river .", "one two three four"], return_tensors="pt", padding=True)


def test_adapter_reloads_onto_fresh_4bit_base_and_merge(runs, tmp_path_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    r = runs["causal-lm"]
    model_dir = _model_dir(tmp_path_factory, "causal-lm")
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    batch = _batch(model_dir)
    logits = []
    for _ in range(2):  # two fresh quantized bases, each with the saved adapter
        base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb, device_map={"": "cpu"})
        no_cpu_4bit_repacking(base)  # evaluated as the run evaluated: on the dequantizing path (techniques/quant.py)
        model = PeftModel.from_pretrained(base, r["adapter_dir"]).eval()
        with torch.no_grad():
            logits.append(model(**batch).logits)
    assert torch.equal(logits[0], logits[1])
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=bnb, device_map={"": "cpu"})
        assert (plain(**batch).logits - logits[0]).abs().max() > 1e-4  # the adapter changed the model

    # Same logits as the trained model: the reloaded adapter's eval loss is the one the run reported.
    from accelerate import Accelerator

    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.core.tasks import load_task

    args = parse_args(["--task", "causal-lm", "--model_name_or_path", str(model_dir), *COMMON[:4]])
    task = load_task(resolve_launch(args, "baseline"), Accelerator(cpu=True))
    assert task.evaluate(model, task.eval_dataloader, Accelerator(cpu=True))["eval_loss"] == pytest.approx(
        r["eval_loss"], abs=1e-5)

    # --merge: a plain model with no LoRA weights, equal to the adapter on the full-precision base.
    merged = AutoModelForCausalLM.from_pretrained(r["merged_dir"]).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), r["adapter_dir"]).eval()
    with torch.no_grad():
        assert (merged(**batch).logits - full(**batch).logits).abs().max() < 1e-4


def test_8bit_base(tmp_path_factory):
    task = "text-classification"
    r = run_recipe("qlora", tmp_path_factory.mktemp("qlora8"), "--task", task, "--load_in", "8bit",
                   "--model_name_or_path", _model_dir(tmp_path_factory, task), "--max_train_steps", "3", *COMMON,
                   "--no_save_model")
    assert r["load_in"] == "8bit" and r["quantized_layers"] >= 12
    assert r["quantized_to_bf16_weight_ratio"] <= 0.55, r["quantized_to_bf16_weight_ratio"]
    assert r["lora_grads_first_backward"]["lora_no_grad"] == 0


def test_qlora_ddp_two_processes(tmp_path):
    r = launch("qlora", tmp_path, "--task", "causal-lm", "--max_train_steps", "6", *COMMON)
    assert r["num_processes"] == 2 and r["distributed_type"] == "MULTI_CPU"
    assert r["load_in"] == "4bit" and r["quantized_layers"] > 0
    assert len(r["param_bytes"]) == 2 and r["param_bytes"][0] == r["param_bytes"][1]  # a whole copy per process
    assert r["lora_grads_second_backward"]["lora_no_grad"] == 0
    assert r["train_loss"] < r["initial_loss"]
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()


ZERO3 = {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": "3",
         "ACCELERATE_CONFIG_DS_FIELDS": ""}  # as `accelerate launch` sets them (without it: a leftover, refused)


@pytest.mark.parametrize("flags, env, message", [
    (["--device_map", "auto"], {"WORLD_SIZE": "2"}, "--device_map auto spreads one model over several devices"),
    (["--load_in", "4bit"], ZERO3, "Pass --bnb_4bit_quant_storage bfloat16"),  # ZeRO-3 without quant storage
    (["--load_in", "8bit"], {"ACCELERATE_USE_FSDP": "true", "WORLD_SIZE": "2"},
     "--load_in 8bit under fsdp: int8 bitsandbytes"),
    (["--load_in", "4bit", "--bnb_4bit_quant_storage", "bfloat16", "--device_map", "auto"], ZERO3,
     "--device_map auto under zero3"),
    (["--merge", "--no_save_model"], {}, "Drop one of them"),
])
def test_bad_combinations_fail_fast(flags, env, message, tmp_path, monkeypatch):
    # The rule table runs before the Accelerator is built: the launch is described by the variables `accelerate
    # launch` would set, and no process group (nor ZeRO-3, which cannot start on this CPU box) is needed to refuse.
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit, match=message):
        run_recipe("qlora", tmp_path, *flags)
    assert not (tmp_path / "base_model").exists()


def test_merge_without_saving_stops_before_training(tmp_path):
    with pytest.raises(SystemExit, match="Drop one of them"):
        run_recipe("qlora", tmp_path, "--merge", "--no_save_model")
    assert not (tmp_path / "base_model").exists()


def test_4bit_layers_train_after_an_eval_forward_and_evaluate_at_odd_sizes():
    """bitsandbytes' packed CPU kernel for 4-bit evaluation (AVX512-BF16 machines) repacks weights in place: a
    training step after an eval forward fails, and a layer of 40 outputs crashes at evaluation. no_cpu_4bit_repacking
    keeps the layers on the dequantizing path; evaluation then equals the training-mode output (the same math)."""
    import copy

    import bitsandbytes as bnb

    from shared.techniques.quant import no_cpu_4bit_repacking

    torch.manual_seed(0)
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 40, compute_dtype=torch.float32, quant_type="nf4"),
                                bnb.nn.Linear4bit(40, 32, compute_dtype=torch.float32, quant_type="nf4"))
    for layer in model:
        layer.weight = bnb.nn.Params4bit(torch.randn(layer.out_features, layer.in_features), requires_grad=False,
                                         quant_type="nf4")
    model = model.to("cpu")  # quantizes
    x = torch.randn(3, 64)
    if model[0].support_avx512bf16_for_cpu:  # this machine takes the packed path: without the fix, both traps
        control = copy.deepcopy(model).eval()
        with torch.no_grad(), pytest.raises((AssertionError, RuntimeError)):
            control(x)  # 40 outputs: not a multiple of 32
        square = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4")
        square.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4")
        square = square.to("cpu").eval()
        with torch.no_grad():
            square(x)
        with pytest.raises(RuntimeError, match="in-place"):
            square.train()(x.clone().requires_grad_())
    assert no_cpu_4bit_repacking(model) == ["0", "1"]
    with torch.no_grad():
        trained_path = model(x)
        assert torch.equal(model.eval()(x), trained_path)
    model.train()(x.clone().requires_grad_()).sum().backward()  # training after evaluation still works


def test_qlora_on_a_hidden_40_model_evaluates(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    from shared.core.data import build_word_tokenizer, builtin_split

    tok = build_word_tokenizer(builtin_split("causal-lm", "train")["text"], "causal-lm")
    GPT2LMHeadModel(GPT2Config(n_embd=40, n_head=2, n_layer=1, n_positions=128, vocab_size=len(tok),
                               pad_token_id=tok.pad_token_id)).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    r = run_recipe("qlora", tmp_path / "out", "--task", "causal-lm", "--model_name_or_path", tmp_path / "m",
                   "--max_train_steps", 2, "--max_eval_samples", 8, "--no_save_model")
    assert r["load_in"] == "4bit" and r["quantized_layers"] >= 4
    assert r["eval_loss"] is not None and r["eval_loss"] > 0


def test_dora_adds_one_magnitude_per_output_and_reloads(tmp_path):
    """--use_dora: beside each LoRA pair, PEFT trains a magnitude vector of one value per output; the saved adapter
    reloads onto a fresh 4-bit base with identical logits, and gives the eval loss the run reported."""
    from accelerate import Accelerator
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.core.tasks import load_task

    args = ("--task", "causal-lm", "--max_train_steps", "6", *COMMON)
    lora = run_recipe("qlora", tmp_path / "lora", *args, "--no_save_model")
    dora = run_recipe("qlora", tmp_path / "dora", *args, "--use_dora")
    assert dora["use_dora"] and not lora["use_dora"]
    magnitudes = [n for n in dora["trainable_param_names"] if "lora_magnitude_vector" in n]
    assert len(magnitudes) == len([n for n in dora["trainable_param_names"] if "lora_A" in n]) >= 8
    # The tiny GPT-2's adapted layers have 192 + 64 + 256 + 64 outputs per block, 2 blocks: one magnitude each.
    assert dora["trainable_params"] - lora["trainable_params"] == 2 * (192 + 64 + 256 + 64)
    assert dora["train_loss"] < 6.0  # it trains (tiny vocabulary: a uniform guess is ~6.5)

    base_dir = tmp_path / "dora" / "base_model"
    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    batch = _batch(base_dir)
    logits, model = [], None
    for _ in range(2):
        base = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=bnb, device_map={"": "cpu"})
        no_cpu_4bit_repacking(base)  # evaluated as the run evaluated: on the dequantizing path (techniques/quant.py)
        model = PeftModel.from_pretrained(base, dora["adapter_dir"]).eval()
        assert model.peft_config["default"].use_dora
        with torch.no_grad():
            logits.append(model(**batch).logits)
    assert torch.equal(logits[0], logits[1])
    parsed = parse_args(["--task", "causal-lm", "--model_name_or_path", str(base_dir), *COMMON[:4]])
    task = load_task(resolve_launch(parsed, "baseline"), Accelerator(cpu=True))
    assert task.evaluate(model, task.eval_dataloader, Accelerator(cpu=True))["eval_loss"] == pytest.approx(
        dora["eval_loss"], abs=1e-5)


def test_dora_trains_sharded_in_two_processes(tmp_path):
    """combined.py --lora --use_dora under FSDP2: the magnitudes are sharded like any parameter and train."""
    r = launch("combined", tmp_path, "--lora", "--use_dora", "--task", "causal-lm", "--max_train_steps", 3,
               "--mixed_precision", "bf16", "--no_save_model", config="fsdp.yaml")
    assert (r["distributed_type"], r["num_processes"], r["use_dora"]) == ("FSDP", 2, True)
    assert r["trainable_params"] == 16384 + 2 * (192 + 64 + 256 + 64)  # LoRA's, plus one magnitude per output
    assert r["train_loss"] is not None and r["train_loss"] < 6.0
