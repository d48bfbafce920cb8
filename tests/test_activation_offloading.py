"""Activation offloading (shared/techniques/activation_offload.py, recipes/activation_offloading.py): gradients
equal those without it on BERT, GPT-2 and ViT in both modes; the bytes forward leaves on the device fall by what
the ledger says moved to the host, counted on live tensors; tensors under the threshold stay; the disk round trip
leaves no file; DDP and FSDP2; recipes/combined.py --activation_offloading; the planner's row against the run."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from shared.core import rules
from shared.techniques.activation_offload import ActivationOffloader, offload_activations
from shared.techniques.probes import forward_kept_bytes
from shared.tools.catalogue import recipe_run
from tests.conftest import launch, run_recipe
from tests.test_selective_checkpointing import BATCH as _B
from tests.test_selective_checkpointing import SEQ as _S
from tests.test_selective_checkpointing import _model_and_batch as selective_model_and_batch

BATCH, SEQ = _B, _S  # the batch of tests/test_selective_checkpointing.py's model
TASKS = ["text-classification", "causal-lm", "image-classification"]


def _model_and_batch(task: str):
    return selective_model_and_batch(task, layers=None)[1:]  # the preset's blocks, BATCH x SEQ


def _loss(model, task, inputs, labels):
    logits = model(**inputs).logits
    if task == "causal-lm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


def _step(model, task, inputs, labels, offloader=None):
    """Device bytes forward leaves for backward (live op outputs, minus the host copies the ledger holds), the
    ledger's live figures at the end of forward, and the gradients."""
    model.zero_grad(set_to_none=True)
    with forward_kept_bytes(model, inputs) as kept:
        with offloader if offloader is not None else torch.enable_grad():
            loss = _loss(model, task, inputs, labels)
    ledger = dict(offloader.ledger.summary()) if offloader is not None else {}
    loss.backward()
    host = ledger.get("offload_host_bytes", 0)
    return kept["bytes"] - host, ledger, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("task", TASKS)
def test_both_modes_keep_gradients_and_move_the_bytes_they_count(task):
    model, inputs, labels = _model_and_batch(task)
    plain_device, _, plain = _step(model, task, inputs, labels)
    # all: every saved tensor of at least 1 KiB leaves; what stays is what the ledger counts as kept.
    off = ActivationOffloader(model, "all", min_bytes=1024)
    device, ledger, grads = _step(model, task, inputs, labels, off)
    off.close()
    assert max((a - b).abs().max().item() for a, b in zip(plain, grads, strict=True)) <= 1e-6
    assert ledger["offload_offloaded"] > 0 and ledger["offload_host_bytes"] > 0
    moved = plain_device - device  # what left the device, on live tensors
    # Two different views of one storage (BERT's attention probabilities as (b, a, s, s) and (b s, h)) are two
    # host copies and one device storage: the host side may count up to a few % more than left the device.
    assert 0 < ledger["offload_host_bytes"] - moved <= 0.05 * moved or moved == ledger["offload_host_bytes"], ledger
    assert off.ledger.host_bytes == 0 and off.ledger.device_bytes == 0  # backward freed every copy it held
    # checkpointed: HF checkpointing, and only the blocks' inputs leave (one hidden-state tensor per block).
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt_device, _, ckpt = _step(model, task, inputs, labels)
    off = ActivationOffloader(model, "checkpointed", min_bytes=1024)
    device, ledger, grads = _step(model, task, inputs, labels, off)
    off.close()
    assert max((a - b).abs().max().item() for a, b in zip(plain, grads, strict=True)) <= 1e-6
    layers = model.config.num_hidden_layers
    hidden = model.config.hidden_size
    tokens = BATCH * (SEQ if task != "image-classification" else (32 // 8) ** 2 + 1)
    assert ledger["offload_offloaded"] == layers
    assert ledger["offload_host_bytes"] == layers * tokens * hidden * 4
    assert ckpt_device - device == ledger["offload_host_bytes"]


def test_small_tensors_stay_on_the_device():
    model, inputs, labels = _model_and_batch("causal-lm")
    sizes = []
    off = ActivationOffloader(model, "all", min_bytes=2 ** 14)
    pack = off._pack
    off._pack = lambda t: (sizes.append((t.numel() * t.element_size(), (s := pack(t)).kept is None)), s)[1]
    off.saving = torch.autograd.graph.saved_tensors_hooks(off._pack, off._unpack)
    with off:
        loss = _loss(model, "causal-lm", inputs, labels)
    loss.backward()
    off.close()
    assert any(not moved for _, moved in sizes) and any(moved for _, moved in sizes)
    assert all(n >= 2 ** 14 for n, moved in sizes if moved)
    assert off.ledger.peak_device_bytes > 0 and off.ledger.kept > 0


def test_disk_round_trip_leaves_no_file(tmp_path):
    model, inputs, labels = _model_and_batch("causal-lm")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    _, _, plain = _step(model, "causal-lm", inputs, labels)
    with offload_activations(model, "checkpointed", 1024, disk_dir=str(tmp_path)) as ledger:
        loss = _loss(model, "causal-lm", inputs, labels)
        files = [f for _, _, fs in os.walk(tmp_path) for f in fs]
        assert len(files) == model.config.num_hidden_layers and ledger.host_bytes > 0
        model.zero_grad(set_to_none=True)
        loss.backward()
        assert not [f for _, _, fs in os.walk(tmp_path) for f in fs]  # read back: removed
    grads = [p.grad for p in model.parameters()]
    assert max((a - b).abs().max().item() for a, b in zip(plain, grads, strict=True)) <= 1e-6
    assert not os.listdir(tmp_path)  # the run's directory too
    with pytest.raises(ValueError, match="offload_dir"):
        ActivationOffloader(model, "checkpointed", to="disk")


TINY = ["--task", "causal-lm", "--max_train_steps", 2, "--max_train_samples", 32, "--max_eval_samples", 8,
        "--per_device_train_batch_size", 4, "--max_seq_length", 64, "--disable_dropout", "--no_save_model",
        "--offload_min_bytes", 1024]
BLOCK_INPUTS = 2 * 4 * 64 * 64 * 4  # tiny GPT-2: 2 blocks, each input 4 x 64 tokens x 64 hidden, fp32


@pytest.mark.parametrize("config,mode", [("multi_cpu.yaml", "all"), ("fsdp.yaml", "checkpointed")])
def test_ddp_and_fsdp2_in_two_processes(config, mode, tmp_path):
    """One launch each: 2 processes train with the hooks; under FSDP2 each moves its own batch's block inputs."""
    r = launch("activation_offloading", tmp_path, *TINY, "--offload_mode", mode, config=config)
    assert r["num_processes"] == 2 and (r["distributed_type"] == "FSDP") == (config == "fsdp.yaml")
    assert r["offload_offloaded"] > 0 and r["offload_host_bytes"] == 0  # all read back by the last backward
    if mode == "checkpointed":
        assert r["offload_peak_host_bytes"] == BLOCK_INPUTS and r["offload_offloaded"] == 2
    else:
        assert r["offload_peak_host_bytes"] > BLOCK_INPUTS and r["offload_kept"] > 0


def test_combined_with_gradient_checkpointing(tmp_path):
    r = run_recipe("combined", tmp_path, *TINY[:-2], "--gradient_checkpointing", "--activation_offloading",
                   "checkpointed")
    assert r["activation_offloading"] == "checkpointed" and r["gradient_checkpointing"]
    assert r["offload_peak_host_bytes"] == BLOCK_INPUTS and r["offload_offloaded"] == 2
    with pytest.raises(SystemExit, match="--gradient_checkpointing"):
        run_recipe("combined", tmp_path / "refused", *TINY[:-2], "--activation_offloading", "checkpointed")


def test_refusals_name_the_fix(tmp_path):
    with pytest.raises(SystemExit, match="--offload_dir"):
        run_recipe("activation_offloading", tmp_path, *TINY, "--offload_to", "disk", "--offload_mode", "checkpointed")
    zero = rules.refusals(recipe_run(recipe="combined", sharding="zero2", launched="zero2", activation_offload="all",
                                    flags={"activation_offload": "--activation_offloading all"}))
    assert any("--activation_offloading all under DeepSpeed ZeRO-2" in z for z in zero)


def test_planner_row_matches_the_tiny_run(tmp_path):
    """shared/tools/plan.py's activation_offloading_checkpointed row: the bytes it moves to the host equal the run's
    ledger exactly, and the activation bytes it leaves on the device are the run's within 5% (fp32, first batch)."""
    from shared.tools import plan

    r = run_recipe("activation_offloading", tmp_path, *TINY[:-2], "--offload_mode", "checkpointed",
                   "--max_train_steps", 1)
    config, task, _ = plan.load_config(None, "tiny", "causal-lm", None, None)
    spec = plan.model_spec(config, task, "tiny", disable_dropout=True)
    row = {t.name: t for t in plan.TECHNIQUES}["activation_offloading_checkpointed"]
    predicted = plan.predict(spec, row, "fp32", 1, 4, 64, kernels="cpu")
    act = plan.activation_bytes(spec, 4, 64, kernels="cpu", checkpointing=True)
    assert predicted.host == r["offload_peak_host_bytes"] == BLOCK_INPUTS
    assert predicted.activations - act.layer == pytest.approx(r["offload_peak_device_bytes"], rel=0.05)
