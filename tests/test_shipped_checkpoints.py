"""Checkpoints as they ship (issue 33, part A): stored in bf16, a mixture of experts with its router loss switched
off, an output directory that is the user's own model. Each is trained as the user chose, or refused with the
reason; results.json says what the weights, the optimizer state and autocast really were (read on live tensors)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import run_recipe

TINY = ["--max_train_samples", 16, "--max_eval_samples", 4, "--per_device_train_batch_size", 4,
        "--per_device_eval_batch_size", 4, "--max_seq_length", 32, "--max_train_steps", 1]
DTYPES = ("param_dtype", "master_weights_dtype", "optimizer_state_dtype", "autocast_dtype", "compute_dtype")


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    """A Llama-style model directory stored in bf16 (its config.json says so), with its tokenizer: as Llama ships."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("bf16")
    run_recipe("baseline", root / "fp32", "--task", "causal-lm", "--model_preset", "tiny-llama", *TINY)
    AutoModelForCausalLM.from_pretrained(root / "fp32").to(torch.bfloat16).save_pretrained(root / "model")
    for f in (root / "fp32").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, root / "model")
    assert json.loads((root / "model" / "config.json").read_text())["dtype"] == "bfloat16"
    return root / "model"


@pytest.mark.parametrize("weights,precision,expected", [
    # the default: fp32 master weights (the checkpoint upcast), AdamW's moments fp32, no autocast
    ("fp32", "no", ("float32", "float32", "float32", None, "float32")),
    # mixed precision keeps fp32 masters: autocast computes in 16 bits over them
    ("fp32", "bf16", ("float32", "float32", "float32", "bfloat16", "bfloat16")),
    ("fp32", "fp16", ("float32", "float32", "float32", "float16", "float16")),
    # pure bf16, chosen: weights, moments and compute all bf16, no fp32 copy anywhere
    ("bf16", "no", ("bfloat16", "bfloat16", "bfloat16", None, "bfloat16")),
    # as stored (bf16), said on the console
    ("auto", "no", ("bfloat16", "bfloat16", "bfloat16", None, "bfloat16")),
])
def test_each_weights_dtype_trains_as_chosen_and_results_say_so(bf16_dir, tmp_path, weights, precision, expected,
                                                                  caplog):
    r = run_recipe("baseline", tmp_path / "run", "--task", "causal-lm", "--model_name_or_path", bf16_dir,
                   "--weights_dtype", weights, "--mixed_precision", precision, "--no_save_model", *TINY)
    assert tuple(r[k] for k in DTYPES) == expected
    assert r["mixed_precision"] == precision and r["flags"]["weights_dtype"] == weights
    # 2 bytes a parameter in bf16, 4 in fp32: measured on the live tensors, not read from the flag
    per_param = {"float32": 4, "bfloat16": 2}[expected[0]]
    assert r["param_bytes"][0] == per_param * sum(t.numel() for t in _weights(bf16_dir).values())
    if weights == "auto":
        assert "--weights_dtype auto: the weights load in their stored dtype, bfloat16" in caplog.text


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


@pytest.mark.parametrize("weights", ["bf16", "auto"])
def test_fp16_over_bf16_master_weights_is_refused_with_the_fix(bf16_dir, tmp_path, weights):
    with pytest.raises(SystemExit, match=r"--mixed_precision fp16 over bfloat16 master weights.*Pass --weights_dtype "
                                         r"fp32 .*or --mixed_precision bf16") as err:
        run_recipe("baseline", tmp_path / "run", "--task", "causal-lm", "--model_name_or_path", bf16_dir,
                   "--weights_dtype", weights, "--mixed_precision", "fp16", "--no_save_model", *TINY)
    why = "--weights_dtype bf16" if weights == "bf16" else "--weights_dtype auto, stored in bfloat16"
    assert why in str(err.value)
    assert not (tmp_path / "run" / "results.json").exists()


@pytest.fixture(scope="module")
def moe_dir(bf16_dir, tmp_path_factory) -> Path:
    """A Qwen3-MoE-style directory as it ships: output_router_logits false, bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    root = tmp_path_factory.mktemp("moe") / "model"
    tok = AutoTokenizer.from_pretrained(bf16_dir)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=128,
                            output_router_logits=False, router_aux_loss_coef=0.001, dtype="bfloat16",
                            pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tok.save_pretrained(root)
    assert json.loads((root / "config.json").read_text())["output_router_logits"] is False
    return root


def test_a_shipped_moe_trains_its_router_loss_or_is_refused_with_the_reason(moe_dir, tmp_path):
    """The router's load-balancing loss is on for every source of the model (here a local directory whose config
    switched it off, as Qwen3-MoE and Mixtral ship); a task whose model class returns none is refused."""
    r = run_recipe("baseline", tmp_path / "lm", "--task", "causal-lm", "--model_name_or_path", moe_dir,
                   "--no_save_model", *TINY)
    assert r["model_type"] == "qwen3_moe" and r["router_aux_loss"] > 1.0  # top-2 of 4 experts: about 2 when balanced
    with pytest.raises(SystemExit, match=r"Refused before training: the model is a mixture of experts, and "
                                         r"Transformers' Qwen3MoeForSequenceClassification \(--task text-classifi"
                                         r"cation\) returns no router aux_loss.*Fix: Use --task causal-lm"):
        run_recipe("baseline", tmp_path / "cls", "--task", "text-classification", "--model_name_or_path", moe_dir,
                   "--no_save_model", *TINY)


def reloaded_eval_loss(model_dir: Path, *run_args: object) -> tuple[float, object]:
    """The eval loss of the model `from_pretrained` loads from `model_dir`, on the validation batches the run with
    `run_args` evaluated on (one process, no sharding), and the model."""
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from shared.core.args import parse_args
    from shared.core.launch import resolve_launch
    from shared.core.tasks import load_task
    from tests.conftest import _reset_accelerate

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    args = parse_args(["--task", "causal-lm", "--model_name_or_path", str(model_dir), *map(str, run_args),
                       "--output_dir", str(model_dir.parent / f"{model_dir.name}-reload")])  # never inside an input
    _reset_accelerate()
    try:
        accelerator = Accelerator(cpu=True)
        task = load_task(resolve_launch(args, "baseline"), accelerator)
        return task.evaluate(model, task.eval_dataloader, accelerator)["eval_loss"], model
    finally:
        _reset_accelerate()


@pytest.mark.parametrize("recipe,config", [("zero", "zero3.yaml"),
                                           pytest.param("fsdp", "fsdp.yaml", marks=pytest.mark.slow)])
def test_a_sharded_mixture_of_experts_saves_a_model_from_pretrained_loads(tmp_path, recipe, config):
    """ZeRO-3 and FSDP2 over 2 processes gather tiny-moe's fused experts into one model.safetensors (ZeRO-3 crashed
    in transformers' reverse weight conversion on the other process's empty partitions); from_pretrained loads it
    whole, and it evaluates to the loss the sharded run reported."""
    from tests.conftest import launch

    data = ["--max_train_samples", 32, "--max_eval_samples", 8, "--max_seq_length", 32]
    r = launch(recipe, tmp_path, "--task", "causal-lm", "--model_preset", "tiny-moe", "--max_train_steps", 2,
               "--per_device_train_batch_size", 4, "--per_device_eval_batch_size", 4, *data, config=config)
    assert r["distributed_type"] == {"zero": "DEEPSPEED", "fsdp": "FSDP"}[recipe] and r["router_aux_loss"] > 0
    loss, model = reloaded_eval_loss(tmp_path, *data, "--per_device_eval_batch_size", 4)
    assert all(p.numel() > 0 for p in model.parameters()) and model.config.model_type == "mixtral"
    assert loss == pytest.approx(r["eval_loss"], abs=1e-5), (loss, r["eval_loss"])


def test_no_input_of_the_run_is_its_output(tmp_path):
    """The output directory may not be, hold, or lie inside anything the run reads: the model being fine-tuned (the
    same path, its parent, a folder inside it, a link to it), its tokenizer, the data files and folders, another
    run's checkpoint. Refused before anything loads, --overwrite_output_dir or not, and nothing there is touched."""
    model, data = tmp_path / "models" / "llama", tmp_path / "data"
    (model / "sub").mkdir(parents=True)
    data.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (data / "train.txt").write_text("hello\n")
    (tmp_path / "link").symlink_to(model)
    ckpt = tmp_path / "other_run" / "checkpoints" / "step_2"
    ckpt.mkdir(parents=True)
    base = ["--task", "causal-lm", "--overwrite_output_dir"]
    cases = [  # (flags, output_dir, the words)
        (["--model_name_or_path", model], model, "is --model_name_or_path"),
        (["--model_name_or_path", model], model.parent, "holds --model_name_or_path"),
        (["--model_name_or_path", model], model / "sub", "lies inside --model_name_or_path"),
        (["--model_name_or_path", model], tmp_path / "link", "is --model_name_or_path"),
        (["--model_name_or_path", tmp_path / "link"], model / "finetuned", "lies inside --model_name_or_path"),
        (["--tokenizer_name", model], model, "is --tokenizer_name"),
        (["--train_file", data / "train.txt"], data, "holds --train_file"),
        (["--task", "image-classification", "--train_dir", data], data / "out", "lies inside --train_dir"),
        (["--resume_from_checkpoint", ckpt], ckpt.parent, "holds --resume_from_checkpoint"),
    ]
    for flags, out, words in cases:
        with pytest.raises(SystemExit) as err:
            run_recipe("baseline", out, *base, *flags)
        message = str(err.value)
        assert words in message and "which this run reads" in message, (flags, out, message)
        assert "--overwrite_output_dir" not in message and "-finetuned" in message
    assert (model / "model.safetensors").read_bytes() == b"weights" and (data / "train.txt").exists()
    assert sorted(p.name for p in model.iterdir()) == ["model.safetensors", "sub"]  # no lock, no run files left


def test_a_run_resumes_from_its_own_checkpoints_and_writes_beside_its_inputs(tmp_path):
    """Not refused: a sibling of the model, and this run's own checkpoint under output_dir/checkpoints."""
    from shared.core import rundir
    from shared.core.args import parse_args

    (tmp_path / "model").mkdir()
    own = tmp_path / "run" / "checkpoints" / "step_2"
    own.mkdir(parents=True)
    args = parse_args(["--model_name_or_path", str(tmp_path / "model"), "--resume_from_checkpoint", str(own)])
    rundir.refuse_inputs(args, str(tmp_path / "run"), str(own))
    rundir.refuse_inputs(args, str(tmp_path / "model-finetuned"), None)


def _reloads_tied(model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not any(info.values()), info
    head, embedding = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings and head is embedding  # one tensor: the same storage
    saved = _weights(model_dir)
    assert "lm_head.weight" not in saved and torch.equal(saved["model.embed_tokens.weight"], embedding.detach())


def test_the_shipped_shape_presets_train_as_their_checkpoints_do(tmp_path):
    """tiny-qwen2 (stored bf16, head tied to the embedding) trains in fp32 master weights by default, and its saved
    model reloads tied; tiny-mistral keeps its 16-token sliding window; tiny-qwen3-moe (router logits off, as Qwen3-MoE
    ships) trains its router's loss."""
    r = run_recipe("baseline", tmp_path / "qwen2", "--task", "causal-lm", "--model_preset", "tiny-qwen2", *TINY)
    assert (r["model_type"], r["param_dtype"], r["master_weights_dtype"]) == ("qwen2", "float32", "float32")
    _reloads_tied(tmp_path / "qwen2")
    r = run_recipe("baseline", tmp_path / "bf16", "--task", "causal-lm", "--model_preset", "tiny-qwen2",
                   "--weights_dtype", "auto", "--no_save_model", *TINY)
    assert (r["param_dtype"], r["optimizer_state_dtype"]) == ("bfloat16", "bfloat16")  # as stored: bf16
    from transformers import AutoConfig

    r = run_recipe("baseline", tmp_path / "mistral", "--task", "causal-lm", "--model_preset", "tiny-mistral", *TINY)
    assert r["model_type"] == "mistral" and AutoConfig.from_pretrained(tmp_path / "mistral").sliding_window == 16
    from transformers import AutoModelForCausalLM

    model, ids = AutoModelForCausalLM.from_pretrained(tmp_path / "mistral"), torch.arange(1, 33)[None]
    windowed = model(ids).logits
    model.config.sliding_window = None  # full causal attention: the same logits up to the window, others past it
    differs = (windowed - model(ids).logits).abs().amax(-1)[0] > 1e-4
    assert not differs[:16].any() and differs[17:].all()
    r = run_recipe("baseline", tmp_path / "moe", "--task", "causal-lm", "--model_preset", "tiny-qwen3-moe",
                   "--no_save_model", *TINY)
    assert r["model_type"] == "qwen3_moe" and r["router_aux_loss"] > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("recipe,launch_config", [("fsdp", "fsdp.yaml"), ("zero", "zero3.yaml")])
def test_a_tied_llama_saved_from_shards_reloads_tied(tmp_path, recipe, launch_config):
    """A Llama-3.2-style directory (head tied to the embedding, bf16), trained sharded over 2 processes: the gathered
    model reloads tied, one tensor for both."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.conftest import launch

    base = tmp_path / "init"
    run_recipe("baseline", tmp_path / "tok", "--task", "causal-lm", "--model_preset", "tiny-llama", *TINY)
    config = LlamaConfig(**{**AutoModelForCausalLM.from_pretrained(tmp_path / "tok").config.to_dict(),
                            "tie_word_embeddings": True, "dtype": "bfloat16"})
    AutoModelForCausalLM.from_config(config).save_pretrained(base)
    for f in (tmp_path / "tok").iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, base)
    r = launch(recipe, tmp_path / "out", "--task", "causal-lm", "--model_name_or_path", base, *TINY,
               config=launch_config)
    assert r["param_dtype"] == "float32"  # fp32 masters by default, the bf16 checkpoint upcast
    _reloads_tied(tmp_path / "out")


def test_pure_bf16_is_refused_where_the_sharding_keeps_fp32_masters_of_its_own():
    """DeepSpeed's ZeRO keeps fp32 partitions of bf16 weights (measured: zero2.yaml, tiny-qwen2, --mixed_precision
    bf16: param bfloat16, master and moments float32), and Accelerate's FSDP2 mixed precision upcasts: --weights_dtype
    bf16 there would not be what trained. Plain DDP and FSDP2 without mixed precision train pure bf16."""
    from shared.core import rules
    from shared.tools.catalogue import recipe_run

    def refused(sharding: str, precision: str, weights: str = "bf16") -> str:
        run = recipe_run(recipe="combined", sharding=sharding, launched=sharding, num_processes=2,
                         precision=precision, weights=weights)
        return " ".join(rules.refusals(run))

    for stage in ("zero1", "zero2", "zero3"):
        assert "--weights_dtype bf16 (pure bf16) under DeepSpeed ZeRO" in refused(stage, "bf16")
        assert "Fix: Pass --weights_dtype fp32" in refused(stage, "no")
        assert "--weights_dtype" not in refused(stage, "bf16", "fp32") + refused(stage, "bf16", "auto")
    assert "--mixed_precision no for pure bf16 under FSDP2" in refused("fsdp", "bf16")
    assert "--weights_dtype" not in refused("fsdp", "no") + refused("ddp", "bf16") + refused("none", "no")


def test_image_models_beyond_vit_train_at_their_own_size(tmp_path):
    """CLIP keeps image_size in its vision_config, and a CNN (ResNet) names none in its config: its processor does.
    Both crashed with an AttributeError on config.image_size; now each trains at its size, and a CNN without a
    processor is refused by name."""
    from PIL import Image
    from transformers import (
        CLIPConfig,
        CLIPForImageClassification,
        ConvNextImageProcessor,
        ResNetConfig,
        ResNetForImageClassification,
    )

    for label, color in (("a", (200, 30, 30)), ("b", (30, 30, 200))):
        (tmp_path / "imgs" / label).mkdir(parents=True)
        for i in range(8):
            Image.new("RGB", (40, 40), tuple(max(0, c - 9 * i) for c in color)).save(
                tmp_path / "imgs" / label / f"{i}.png")
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    CLIPForImageClassification(CLIPConfig(text_config=tower, vision_config={**tower, "image_size": 24,
                                                                           "patch_size": 8})).save_pretrained(
        tmp_path / "clip")
    resnet = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic")
    ResNetForImageClassification(resnet).save_pretrained(tmp_path / "resnet")
    ConvNextImageProcessor(size={"shortest_edge": 20}, crop_pct=1.0).save_pretrained(tmp_path / "resnet")
    ResNetForImageClassification(resnet).save_pretrained(tmp_path / "bare")
    run = ["--task", "image-classification", "--train_dir", tmp_path / "imgs", "--per_device_train_batch_size", "4",
           "--max_train_steps", "2", "--no_save_model"]
    clip = run_recipe("baseline", tmp_path / "out_clip", "--model_name_or_path", tmp_path / "clip", *run)
    cnn = run_recipe("baseline", tmp_path / "out_cnn", "--model_name_or_path", tmp_path / "resnet", *run)
    for out, side in (("out_clip", 24), ("out_cnn", 20)):  # the tensor the model received, as the report says
        example = json.loads((tmp_path / out / "data_report.json").read_text())["example"]["train"]
        assert example["pixel_values"] == [3, side, side], (out, example)
    assert 0 <= clip["eval_accuracy"] <= 1 and 0 <= cnn["eval_accuracy"] <= 1
    assert cnn["model_flops_per_token"] is None and cnn["train_tokens_per_second"] > 0  # a CNN's throughput: images
    with pytest.raises(SystemExit, match="names no image size"):
        run_recipe("baseline", tmp_path / "out_bare", "--model_name_or_path", tmp_path / "bare", *run)
