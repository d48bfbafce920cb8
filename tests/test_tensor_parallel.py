"""Tensor parallel (recipes/tensor_parallel.py): 2 processes over gloo train the same model as 1 process on the same
batches, each holding half of every split weight, and the consolidated save loads with from_pretrained."""

import re

import pytest

from shared.core.errors import RecipeError
from shared.techniques.tensor_parallel import PLANS, _fused_qkv_order
from tests.conftest import launch, load_params, max_param_diff, run_recipe
from tests.parallel_runs import COMMON

# fp32 AdamW at lr 3e-3, 6 steps, vs 1 process: the row-wise all-reduce sums partial products in another order,
# which Adam's m/sqrt(v) magnifies where v is tiny. Measured 9.8e-6 (GPT-2), 3.6e-6 (BERT, 4 steps).
PARAM_TOL = 2e-5
BATCH = ("--per_device_train_batch_size", "16")  # every process reads the whole batch: the global batch is 16


def test_fused_qkv_rows_are_grouped_per_process():
    """GPT-2's c_attn output is [q | k | v]: after reordering, process r's even share is its own q, k and v heads."""
    hidden, world = 8, 2
    order = _fused_qkv_order(hidden, world)
    assert sorted(order.tolist()) == list(range(3 * hidden))
    first = order.chunk(world)[0].tolist()
    assert first == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]  # q heads 0-1, their k and v


def _split_numel(params: dict, family: str, world: int) -> tuple[int, int]:
    """(what each process holds of the split weights, the replicated rest), from a whole model's parameters."""
    split = 0
    for name, style in PLANS[family].items():
        for key, t in params.items():
            in_block = re.search(rf"\.\d+\.{re.escape(name)}\.", key)  # layer.<i>.<name>., not a longer name
            if in_block and not (style == "rowwise" and key.endswith(".bias")):  # a row-wise bias stays whole
                split += t.numel()
    return split // world, sum(t.numel() for t in params.values()) - split


@pytest.mark.slow
def test_gpt2_trains_like_one_process_each_holding_half(tmp_path_factory):
    ref_dir, tp_dir = tmp_path_factory.mktemp("baseline"), tmp_path_factory.mktemp("tp")
    ref = run_recipe("baseline", ref_dir, *COMMON, *BATCH)
    r = launch("tensor_parallel", tp_dir, *COMMON, *BATCH)
    assert (r["num_processes"], r["tensor_parallel_size"]) == (2, 2)
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-6)
    assert r["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
    diff = max_param_diff(load_params(ref_dir), load_params(tp_dir))
    print(f"max |param(2-process tensor parallel) - param(1 process)| after 6 steps = {diff:.2e}")
    assert diff <= PARAM_TOL

    # each process holds half of every split weight (live local tensors), and the rest whole
    shard, rest = _split_numel(load_params(ref_dir), "gpt2", 2)
    assert r["local_param_counts"] == [{"sharded": shard, "replicated": rest}] * 2
    assert r["param_bytes"] == [4 * (shard + rest)] * 2 == r["grad_bytes"]
    assert ref["param_bytes"] == [4 * (2 * shard + rest)]
    from shared.tools import plan

    config, task, _ = plan.load_config(None, "tiny", "causal-lm", None, None)
    predicted = plan.tensor_parallel_bytes(plan.model_spec(config, task, "tiny"), tp=2)
    assert predicted["param_bytes"] == r["param_bytes"][0]  # TP alone: exact
    assert all(abs(m - predicted["optimizer_state_bytes"]) <= 0.05 * m for m in r["optimizer_state_bytes"])
    print(f"param bytes per process {r['param_bytes']} vs {ref['param_bytes']} in 1 process; optimizer state "
          f"{r['optimizer_state_bytes']} vs {ref['optimizer_state_bytes']}")

    # the consolidated save: from_pretrained in one process, and the run's eval loss (lr 0 leaves it untrained)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tp_dir)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()  # the tie survives
    again = run_recipe("baseline", tmp_path_factory.mktemp("reload"), *COMMON, *BATCH, "--model_name_or_path",
                       str(tp_dir), "--max_train_steps", "1", "--learning_rate", "1e-30", "--no_save_model")
    assert again["eval_loss"] == pytest.approx(r["eval_loss"], rel=1e-5)


@pytest.mark.slow
def test_bert_trains_like_one_process(tmp_path_factory):
    args = ("--task", "text-classification", "--disable_dropout", "--max_train_steps", "4", "--max_train_samples",
            "128", "--max_eval_samples", "32", "--max_seq_length", "32", "--learning_rate", "3e-3",
            "--lr_scheduler_type", "constant", *BATCH)
    ref_dir, tp_dir = tmp_path_factory.mktemp("bert-baseline"), tmp_path_factory.mktemp("bert-tp")
    ref = run_recipe("baseline", ref_dir, *args)
    r = launch("tensor_parallel", tp_dir, *args)
    diff = max_param_diff(load_params(ref_dir), load_params(tp_dir))
    print(f"BERT: max param diff {diff:.2e}; eval accuracy {r['eval_accuracy']} vs {ref['eval_accuracy']}")
    assert diff <= PARAM_TOL and r["eval_accuracy"] == ref["eval_accuracy"]
    shard, rest = _split_numel(load_params(ref_dir), "bert", 2)
    assert r["local_param_counts"] == [{"sharded": shard, "replicated": rest}] * 2


def test_refuses_one_process(tmp_path):
    with pytest.raises(SystemExit, match="at least 2 processes.*multi_cpu.yaml"):
        run_recipe("tensor_parallel", tmp_path, "--max_train_steps", "1")


@pytest.mark.parametrize("asks, match", [
    ({"precision": "fp16"}, "fp16 with recipes/tensor_parallel.py.*bf16 or no"),
    ({"shard_vocab": True, "task": "image-classification"}, "--shard_vocab with --task image-classification.*"
                                                             "--task causal-lm"),
])
def test_refuses_what_it_does_not_do_yet(asks, match):
    from shared.core.rules import Run, check
    from shared.tools.catalogue import recipe_run

    run = recipe_run(recipe="tensor_parallel", sharding="ddp", launched="ddp", num_processes=2, task="causal-lm")
    check(run)  # the plain run trains
    with pytest.raises(RecipeError, match=match):
        check(Run(**{**run.__dict__, **asks}))


def test_llama_splits_by_its_own_plan_like_one_process(tmp_path_factory):
    """tiny-llama (4 query heads over 2 KV heads) by the plan its config ships: each of 2 processes takes 1 KV head
    and its 2 queries, half of every block matrix and of the vocabulary; only the RMSNorm weights stay whole."""
    args = (*COMMON, *BATCH, "--model_preset", "tiny-llama")
    ref_dir, tp_dir = tmp_path_factory.mktemp("llama-baseline"), tmp_path_factory.mktemp("llama-tp")
    ref = run_recipe("baseline", ref_dir, *args)
    r = launch("tensor_parallel", tp_dir, *args)
    from transformers import LlamaConfig

    assert r["num_processes"] == 2 and r["tp_plan"]["model.layers.*.self_attn.k_proj"] == "colwise"
    assert set(LlamaConfig.base_model_tp_plan) <= {k.removeprefix("model.") for k in r["tp_plan"]}
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-6)
    assert r["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
    # the schedule the loop stepped, kept apart from Accelerate (checkpoint_dtensors): the flag's, as in one process
    assert r["lr_scheduler"] == ref["lr_scheduler"] and r["lr_scheduler"]["from"].startswith("--lr_scheduler_type")
    params = load_params(ref_dir)
    diff = max_param_diff(params, load_params(tp_dir))
    print(f"tiny-llama: max |param(2-process TP, own plan) - param(1 process)| after 6 steps = {diff:.2e}")
    assert diff <= 1e-5
    norms = sum(t.numel() for k, t in params.items() if "norm" in k)
    counts = r["local_param_counts"]
    assert [c["replicated"] for c in counts] == [norms] * 2
    assert sum(c["sharded"] for c in counts) + norms == sum(t.numel() for t in params.values())
    # an odd vocabulary: the embedding and the head each give one process a row more
    assert abs(counts[0]["sharded"] - counts[1]["sharded"]) in (0, 2 * params["lm_head.weight"].shape[1])


def test_refuses_a_model_without_a_plan_or_heads_that_do_not_split():
    from transformers import LlamaConfig, OPTConfig

    from shared.core.models import preset_config
    from shared.techniques.tensor_parallel import OWN, family_of

    llama = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=32)
    assert family_of(llama, 2) == OWN  # its config ships base_model_tp_plan
    with pytest.raises(RecipeError, match=r"key/value heads \(2\) does not split over 4 processes"):
        family_of(llama, 4)  # the 4 query heads would split, the 2 KV heads not
    with pytest.raises(RecipeError, match="--shard_vocab with the llama model's own.*Drop --shard_vocab"):
        family_of(llama, 2, shard_vocab=True)
    with pytest.raises(RecipeError, match="'opt' model has no tensor-parallel plan.*base_model_tp_plan"):
        family_of(OPTConfig(), 2)  # refused from the config: no weights were built
    gpt2 = preset_config("causal-lm", "tiny", vocab_size=50)
    assert family_of(gpt2, 2) == "gpt2" and family_of(gpt2, 2, shard_vocab=True) == "gpt2"
    with pytest.raises(RecipeError, match="does not split over 3 processes"):
        family_of(gpt2, 3)
