"""Tensor x data parallel (recipes/tensor_parallel.py --tp_size 2 --shard_vocab --gradient_checkpointing, 4
processes): a (dp, tp) = (2, 2) mesh, TP inside each group of 2 (the tied embedding and head split over the
vocabulary, the loss on sharded logits), activation checkpointing, and FSDP2 across the groups, trains the same
parameters as 1 process on the global batch; the planner predicts each process's bytes; its
torch.distributed.checkpoint shards resume to the uninterrupted run's parameters exactly."""

import shutil

import pytest

from shared.core import rules
from shared.core.errors import RecipeError
from shared.tools import plan
from shared.tools.catalogue import recipe_run
from tests.conftest import launch, load_params, max_param_diff, run_recipe
from tests.parallel_runs import COMMON
from tests.probed_run import launch_probed

# 2 groups x 8: the global batch is 16. torchtitan's order: TP, activation checkpointing, FSDP2.
MESH = ("--tp_size", "2", "--shard_vocab", "--gradient_checkpointing", "--per_device_train_batch_size", "8")


@pytest.mark.slow
def test_tp_x_dp_trains_like_one_process_and_resumes_exactly(tmp_path):
    ref = run_recipe("baseline", tmp_path / "ref", *COMMON, "--per_device_train_batch_size", "16")
    r = launch_probed("tensor_parallel", tmp_path / "mesh", *COMMON, *MESH, "--checkpointing_steps", "3",
               config="tp2_dp2.yaml")
    assert (r["num_processes"], r["data_parallel_size"], r["tensor_parallel_size"]) == (4, 2, 2)
    assert r["mesh"] == [[0, 1], [2, 3]] and r["global_batch_size"] == 16
    # the processes of a TP group read one batch, the two groups different ones
    first = r["first_batch_label_sum"]
    assert first[0] == first[1] and first[2] == first[3] and first[0] != first[2], first
    assert r["initial_loss"] == pytest.approx(ref["initial_loss"], rel=1e-6)
    diff = max_param_diff(load_params(tmp_path / "ref"), load_params(tmp_path / "mesh"))
    print(f"max |param(2 x 2 TP x FSDP2) - param(1 process)| after 6 steps = {diff:.2e}")
    assert diff <= 1e-5  # fp32 AdamW; the all-reduces sum in another order (measured 3.4e-6)

    # each process holds 1/4 of every block matrix and of the vocabulary, 1/2 of the rest: the planner's bytes
    # within 5% of the live local tensors' (FSDP2 pads uneven shards; the vocabulary of 41 splits 21 / 20)
    config, task, _ = plan.load_config(None, "tiny", "causal-lm", None, None)
    predicted = plan.tensor_parallel_bytes(plan.model_spec(config, task, "tiny"), tp=2, dp=2, shard_vocab=True)
    for key, value in predicted.items():
        assert all(abs(m - value) <= 0.05 * m for m in r[key]), (key, value, r[key])
    assert r["param_bytes"][0] < 0.3 * ref["param_bytes"][0]
    sharded = [c["sharded"] for c in r["local_param_counts"]]
    assert sharded[0] == sharded[2] != sharded[1] == sharded[3], sharded  # tp rank 0 holds 21 vocabulary rows

    # resume the mesh from its step-3 checkpoint, as after a kill -9 there: the uninterrupted run's parameters
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "mesh" / "checkpoints" / "step_00000003", cut / "checkpoints" / "step_00000003")
    again = launch("tensor_parallel", cut, *COMMON, *MESH, "--resume_from_checkpoint", "latest",
                   config="tp2_dp2.yaml")
    assert again["resumed_from_step"] == 3
    assert max_param_diff(load_params(tmp_path / "mesh"), load_params(cut)) == 0.0


@pytest.mark.parametrize("tp, world, ok", [(2, 4, True), (4, 4, True), (0, 2, True), (3, 4, False), (1, 4, False)])
def test_tp_size_must_divide_the_processes(tp, world, ok):
    run = recipe_run(recipe="tensor_parallel", sharding="ddp", launched="ddp", num_processes=world,
                     tensor_parallel_size=tp, flags={"tensor_parallel_size": "--tp_size"})
    if ok:
        rules.check(run)
    else:
        with pytest.raises(RecipeError, match=f"--tp_size {tp} with {world} processes.*divisor of {world}"):
            rules.check(run)


def test_accelerate_parallelism_config_on_cpu_is_refused_with_the_alternative():
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_TP_SIZE": "2",
           "PARALLELISM_CONFIG_CP_SIZE": "2", "WORLD_SIZE": "4"}
    assert rules.launched_parallelism(env) == "tp=2 cp=2" and rules.launched_parallelism({}) == ""
    run = recipe_run(recipe="tensor_parallel", sharding="ddp", launched="ddp", num_processes=4, on_accelerator=False,
                     parallelism_config=rules.launched_parallelism(env))
    with pytest.raises(RecipeError, match="ParallelismConfig.*CPU.*context parallel.*sdpa.*--tp_size N.*tp2_dp2"):
        rules.check(run)
    rules.check(recipe_run(recipe="tensor_parallel", sharding="ddp", launched="ddp", num_processes=4,
                            parallelism_config="tp=2"))  # on GPUs the table leaves it to Accelerate


class _Hooks:
    """What checkpoint_dtensors needs of an Accelerator: somewhere to register its save/load hooks."""

    is_main_process = True

    def __init__(self):
        self.save = self.load = None

    def register_save_state_pre_hook(self, hook):
        self.save = hook

    def register_load_state_pre_hook(self, hook):
        self.load = hook


def _trained(seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_dcp_hooks_round_trip_and_refuse_another_mesh(tmp_path):
    """The hooks' torch.distributed.checkpoint round trip (one process): weights, AdamW moments and the scheduler come
    back, on the mesh that saved them and on another data-parallel degree (DCP reshards; the core keeps the global
    batch); GPT-2 on another tensor-parallel degree is refused, naming the flag to resume with."""
    from types import SimpleNamespace

    import torch

    from shared.techniques.tensor_parallel import checkpoint_dtensors

    saved, into = _Hooks(), _Hooks()
    model, optimizer, scheduler = _trained(0)
    checkpoint_dtensors(saved, model, optimizer, scheduler, {"dp": 1, "tp": 2})
    saved.save([], [], str(tmp_path))
    other, other_opt, other_sched = _trained(1)
    checkpoint_dtensors(into, other, other_opt, other_sched, {"dp": 1, "tp": 2})
    into.load([], str(tmp_path))
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg_sq"], other_opt.state[b]["exp_avg_sq"])
    assert other_sched.state_dict() == scheduler.state_dict()

    wider = _Hooks()
    more_dp = _trained(2)
    checkpoint_dtensors(wider, *more_dp, {"dp": 2, "tp": 2})
    wider.load([], str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), more_dp[0].parameters(), strict=True))

    elsewhere = _Hooks()
    gpt2, *rest = _trained(3)
    gpt2.config = SimpleNamespace(model_type="gpt2")
    checkpoint_dtensors(elsewhere, gpt2, *rest, {"dp": 1, "tp": 4})
    with pytest.raises(RecipeError, match=r"saved on the mesh \{'dp': 1, 'tp': 2\}.*fused qkv.*--tp_size 2"):
        elsewhere.load([], str(tmp_path))
    with pytest.raises(RecipeError, match="no mesh.json.*not saved by a DTensor run"):
        elsewhere.load([], str(tmp_path / "dcp"))
