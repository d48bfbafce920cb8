"""Expert parallel (recipes/expert_parallel.py, shared/techniques/expert_parallel.py): 2 processes over gloo, each
holding half of every layer's experts (the tokens exchanged by all-to-all) and half of the other weights (FSDP2),
each reading half of the global batch, train the 1-process model on the whole batch: the same loss, router loss,
gradient norm and parameters; every routed token is counted per expert; the torch.distributed.checkpoint shards
resume to the uninterrupted run's parameters exactly."""

import shutil

import pytest

from shared.core import rules
from shared.core.errors import RecipeError
from shared.tools.catalogue import recipe_run
from tests.conftest import launch, load_params, max_param_diff, run_recipe
from tests.parallel_runs import COMMON, STEPS
from tests.probed_run import launch_probed, run_probed

MOE = ("--model_preset", "tiny-moe")
TOKENS = 16 * 64  # the global batch: 16 packed blocks of 64 tokens
# fp32 AdamW at lr 3e-3, 6 steps, vs 1 process: the all-to-all and FSDP2's reduce-scatter sum in another order. One
# step's loss agrees to the last bit and its gradient norm to 1.2e-7; after 6 steps the parameters to 8.2e-6 (the
# head's rows of rare tokens, where Adam's m/sqrt(v) magnifies a tiny v; the experts 2.6e-6): the bound of the
# tensor- and sequence-parallel tests.
PARAM_TOL = 2e-5


def test_two_processes_train_like_one_each_holding_half_the_experts(tmp_path):
    ref = run_probed("data_parallel", tmp_path / "ref", *COMMON, *MOE, "--per_device_train_batch_size", "16")
    r = launch_probed("expert_parallel", tmp_path / "ep", *COMMON, *MOE, "--per_device_train_batch_size", "8",
               "--checkpointing_steps", "3")
    assert (r["num_processes"], r["expert_parallel_size"], r["global_batch_size"]) == (2, 2, 16)
    # the same batches through the split model: the loss (the router's load-balancing loss in it is the global
    # batch's), the gradient norm over every sharded gradient, and the parameters after 6 AdamW steps
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-6)
    assert r["router_aux_loss"] == pytest.approx(ref["router_aux_loss"], rel=1e-6)
    assert r["first_step_grad_norm"] == pytest.approx(ref["first_step_grad_norm"], rel=1e-5)
    assert r["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
    ref_params = load_params(tmp_path / "ref")
    diff = max_param_diff(ref_params, load_params(tmp_path / "ep"))  # the consolidated save: every key, whole
    print(f"loss {r['initial_loss']:.7f} vs {ref['initial_loss']:.7f}, router loss {r['router_aux_loss']:.7f} vs "
          f"{ref['router_aux_loss']:.7f}, grad norm {r['first_step_grad_norm']:.7f} vs "
          f"{ref['first_step_grad_norm']:.7f}; max |param(2-process EP) - param(1 process)| after {STEPS} steps "
          f"{diff:.2e}")
    assert diff <= PARAM_TOL

    # each process holds half of the experts (live local tensors), half of the rest, and bytes to match
    experts = sum(t.numel() for k, t in ref_params.items() if ".experts." in k)  # saved as experts.<i>.w1
    dense = sum(t.numel() for t in ref_params.values()) - experts
    counts = r["local_param_counts"]
    assert [c["expert"] for c in counts] == [experts // 2] * 2 and r["experts_per_process"] == 2
    assert sum(c["dense"] for c in counts) == dense  # FSDP2's dim-0 shards; an odd row count splits unevenly
    # (the bytes of the storage: FSDP2 pads rank 1's shard of the 41 vocabulary rows to rank 0's 21)
    assert r["param_bytes"] == [4 * (counts[0]["expert"] + counts[0]["dense"])] * 2 == r["grad_bytes"]
    assert ref["param_bytes"] == [4 * (experts + dense)]
    print(f"param bytes per process {r['param_bytes']} vs {ref['param_bytes']} in 1 process; optimizer state "
          f"{r['optimizer_state_bytes']} vs {ref['optimizer_state_bytes']}")

    # load balance: every (token, slot) of every training step counted once, on the expert its router chose
    per_expert = r["tokens_per_expert"]
    assert sorted(per_expert) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    for layer, c in per_expert.items():
        assert len(c) == 4 and sum(c) == STEPS * TOKENS * 2, (layer, c)  # top-2
        assert r["tokens_per_process"][layer] == [c[0] + c[1], c[2] + c[3]]
        assert r["expert_load_imbalance"][layer] == pytest.approx(max(c) / (sum(c) / 4))
    print(f"tokens per expert {per_expert}; max/mean {r['max_expert_load_imbalance']:.3f}")

    # resumed from the step-3 shards alone (as after a kill -9 there): the uninterrupted run's parameters
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "ep" / "checkpoints" / "step_00000003", cut / "checkpoints" / "step_00000003")
    again = launch("expert_parallel", cut, *COMMON, *MOE, "--per_device_train_batch_size", "8",
                   "--resume_from_checkpoint", "latest")
    assert again["resumed_from_step"] == 3
    assert max_param_diff(load_params(tmp_path / "ep"), load_params(cut)) == 0.0


def test_refuses_one_process(tmp_path):
    with pytest.raises(SystemExit, match="at least 2 processes.*multi_cpu.yaml"):
        run_recipe("expert_parallel", tmp_path, "--max_train_steps", "1")


def test_refuses_fp16_and_compile():
    run = recipe_run(recipe="expert_parallel", sharding="ddp", launched="ddp", num_processes=2, task="causal-lm")
    rules.check(run)  # the plain run trains
    with pytest.raises(RecipeError, match="fp16 with recipes/expert_parallel.py.*bf16 or no"):
        rules.check(rules.Run(**{**run.__dict__, "precision": "fp16"}))
    with pytest.raises(RecipeError, match="expert_parallel.py does not compile"):
        rules.check(rules.Run(**{**run.__dict__, "compile": "regional"}))


def test_refuses_a_model_without_experts_or_experts_that_do_not_split():
    """From the config alone, before any weight is built or loaded."""
    from shared.core.models import preset_config
    from shared.techniques.expert_parallel import check_config

    moe = preset_config("causal-lm", "tiny-moe", vocab_size=50)  # 4 experts per layer
    check_config(moe, 2)
    check_config(moe, 4)
    with pytest.raises(RecipeError, match="4 experts per layer do not split over 3 processes"):
        check_config(moe, 3)
    for preset in ("tiny", "tiny-llama"):  # GPT-2, and a dense Llama: no expert-parallel plan
        with pytest.raises(RecipeError, match="no expert-parallel plan.*--model_preset tiny-moe"):
            check_config(preset_config("causal-lm", preset, vocab_size=50), 2)
