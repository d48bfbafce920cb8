"""The optimizer step in backward (recipes/optimizer_in_backward.py): the same parameters as one AdamW step after
backward, the peak gradient bytes about one parameter's, an exact resume, and refusals for what it cannot do."""

from __future__ import annotations

import os

import pytest
import torch

from shared.core.launch import free_port
from shared.techniques.optim_in_backward import OptimizerInBackward
from tests.conftest import load_params, max_param_diff, run_recipe

# fp32, dropout off, no clipping: the same update computed at another moment. Measured: 0.0 on both tasks.
TOL = 1e-6
COMMON = ("--disable_dropout", "--max_grad_norm", "0", "--max_eval_samples", "64")


def test_same_parameters_as_adamw_after_backward_and_one_parameters_gradient_at_a_time(tmp_path):
    args = (*COMMON, "--max_train_steps", 40, "--learning_rate", "3e-3")
    base = run_recipe("baseline", tmp_path / "baseline", *args)
    fused = run_recipe("optimizer_in_backward", tmp_path / "in_backward", *args)

    diff = max_param_diff(load_params(tmp_path / "baseline"), load_params(tmp_path / "in_backward"))
    print(f"40 AdamW steps after backward vs in backward: max abs param diff {diff:.2e}")
    assert diff <= TOL
    assert fused["train_loss"] < 0.9 * fused["initial_loss"], (fused["initial_loss"], fused["train_loss"])
    # The same optimizer state (two moments per parameter), and no gradient left alive after the step.
    assert fused["optimizer_state_bytes"] == base["optimizer_state_bytes"]
    assert fused["grad_bytes"] == [0] and base["grad_bytes"] == base["param_bytes"]
    # At most one parameter's gradient alive at any hook: the largest one's, against the whole model's.
    whole = base["grad_bytes"][0]
    assert fused["full_model_grad_bytes"] == whole
    assert fused["peak_grad_bytes"] == fused["largest_param_bytes"]
    ratio = fused["peak_grad_bytes"] / whole
    print(f"peak gradient bytes {fused['peak_grad_bytes']} of the model's {whole} ({ratio:.3f})")
    assert ratio < 0.15


def test_tied_weights_step_once_and_match(tmp_path):
    """GPT-2's lm_head is its token embedding: one parameter, one hook, fired once with both uses' gradient."""
    args = ("--task", "causal-lm", *COMMON, "--max_train_steps", 4, "--max_train_samples", 64)
    run_recipe("baseline", tmp_path / "baseline", *args)
    fused = run_recipe("optimizer_in_backward", tmp_path / "in_backward", *args)
    diff = max_param_diff(load_params(tmp_path / "baseline"), load_params(tmp_path / "in_backward"))
    print(f"causal LM, tied head, 4 steps: max abs param diff {diff:.2e}")
    assert diff <= TOL
    assert fused["peak_grad_bytes"] == fused["largest_param_bytes"] < 0.5 * fused["full_model_grad_bytes"]


@pytest.mark.parametrize("flags, says", [
    (("--gradient_accumulation_steps", "2"), "no gradient left to accumulate"),
    (("--max_grad_norm", "1.0"), "clipping by the global norm needs every gradient"),
    (("--mixed_precision", "fp16"), "the loss scaler must unscale every gradient"),
])
def test_what_it_cannot_do_is_refused_before_training(flags, says, tmp_path):
    with pytest.raises(SystemExit, match="Refused before training") as refused:
        run_recipe("optimizer_in_backward", tmp_path, *flags)
    assert says in str(refused.value.code) and "Fix: " in str(refused.value.code)
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # nothing loaded, nothing written


def test_resume_is_exact(tmp_path):
    """Stopped at step 6 and resumed == uninterrupted (dropout on): every per-parameter AdamW state, and the
    schedule, come back through Accelerate's save_state / load_state."""
    common = ("--max_train_steps", 10, "--max_train_samples", 48, "--max_eval_samples", 32)
    run_recipe("optimizer_in_backward", tmp_path / "full", *common, "--checkpointing_steps", 3)
    checkpoint = tmp_path / "full" / "checkpoints" / "step_00000006"
    saved = torch.load(checkpoint / "optimizer.bin", weights_only=True)
    assert len(saved["per_parameter"]) == len(load_params(tmp_path / "full"))  # no tied weights in BERT
    run_recipe("optimizer_in_backward", tmp_path / "resumed", *common, "--resume_from_checkpoint", checkpoint)
    diff = max_param_diff(load_params(tmp_path / "full"), load_params(tmp_path / "resumed"))
    print(f"resumed at step 6 of 10 vs uninterrupted: max abs param diff {diff:.2e}")
    assert diff == 0.0


def test_data_parallel_is_refused_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # what `accelerate launch` with accelerate_configs/multi_cpu.yaml sets
    with pytest.raises(SystemExit, match="does not implement 2 processes of plain data parallel") as refused:
        run_recipe("optimizer_in_backward", tmp_path)
    assert "before DDP's all-reduce has averaged it" in str(refused.value.code)


def _ddp_replica(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)  # the same initial replica
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = OptimizerInBackward(model.parameters(), lr=1e-2)
    seen = []
    for param in optimizer.params:
        param.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))  # what the step gets
        param.register_post_accumulate_grad_hook(optimizer.step_param)
    ddp = DistributedDataParallel(model)
    torch.manual_seed(1 + rank)  # each replica its own batch
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    ((ddp(x) - y) ** 2).mean().backward()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out[rank] = {"replicas_differ_by": (gathered[0] - gathered[1]).abs().max().item(),
                 "grads_after_backward": [None if p.grad is None else p.grad.abs().max().item()
                                          for p in model.parameters()]}
    dist.destroy_process_group()


def test_under_ddp_the_hooks_step_on_unaveraged_gradients():
    """Why data parallel is refused, measured on this stack (gloo, 2 processes): the hooks fire on each process's
    own gradient, before DDP's all-reduce, so the replicas differ after one step; DDP then writes its bucket back
    into .grad (zeros for the freed ones), so the whole model's gradients exist again."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_ddp_replica, args=(2, free_port(), out), nprocs=2)
        out = dict(out)
    print(out)
    assert all(r["replicas_differ_by"] > 1e-3 for r in out.values())
    assert all(g is not None for r in out.values() for g in r["grads_after_backward"])
