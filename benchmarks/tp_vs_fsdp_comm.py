"""Bytes each process passes to collectives in one training step, tensor parallel vs FSDP2, against the formulas.

    accelerate launch --config_file accelerate_configs/multi_cpu.yaml benchmarks/tp_vs_fsdp_comm.py OUT.json

A GPT-2 of --layers blocks at --hidden width, fp32, batch b x sequence s, 2 processes over gloo. Every collective
the step issues (DTensor's, FSDP2's, ours) is seen by a TorchDispatchMode as a c10d op: its input tensor's bytes
are added up (for an all-gather, this process's shard; the formulas below count the same). Expected per block:
  TP: 2 all-reduces of the activations (b*s*h) in forward (after attention, after the MLP) and 2 in backward (at
      the inputs of q/k/v and of the MLP's up projection): 4 * b*s*h * 4 bytes, independent of the weights.
  FSDP2: all-gather the block's weights in forward and again in backward (resharded after forward), reduce-scatter
      its gradients: (2 + 1) * 12h^2 (+ biases) * 4 bytes / processes of input per process, independent of b*s.
Writes OUT.json (main process); docs/tensor_parallel.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class CollectiveBytes(TorchDispatchMode):
    """Sums the bytes of the tensors handed to every c10d collective (functional or in-place) while active."""

    def __init__(self):
        super().__init__()
        self.bytes: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        name = func.__name__.split(".")[0].rstrip("_").removeprefix("_")
        if ns in ("c10d", "_c10d_functional") and not name.startswith(("wait", "wrap_tensor")):  # not collectives
            first = args[0]
            tensors = first if isinstance(first, (list, tuple)) else [first]
            if ns == "c10d" and name.startswith("allgather"):  # (outputs, input, ...): the input is this shard
                tensors = [args[1]]
            if ns == "c10d" and name.startswith("reduce_scatter"):  # (output, input, ...)
                tensors = [args[1]]
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    self.bytes[name] += t.numel() * t.element_size()
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


def build(hidden: int, layers: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_embd=hidden, n_layer=layers, n_head=hidden // 64, vocab_size=vocab, n_positions=1024,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def step_bytes(model, batch: torch.Tensor) -> tuple[dict, dict]:
    mode = CollectiveBytes()
    with mode:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
    return dict(mode.bytes), dict(mode.calls)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqs", default="32,128,512", help="sequence lengths: TP's bytes grow with b*s, FSDP's do not")
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from shared.core.models import transformer_layers
    from shared.techniques.tensor_parallel import PLANS, prepare_blocks

    b, h, n = args.batch, args.hidden, args.layers
    seqs = [int(x) for x in args.seqs.split(",")]
    batches = {s: torch.randint(0, args.vocab, (b, s), generator=torch.Generator().manual_seed(0)) for s in seqs}
    mesh = init_device_mesh("cpu", (world,))
    results = {"machine": "2-core CPU, torch " + torch.__version__ + ", gloo", "processes": world,
               "batch": b, "hidden": h, "layers": n, "vocab": args.vocab, "runs": []}

    tp_model = build(h, n, args.vocab)
    prepare_blocks(tp_model, world)
    plan = {k: ColwiseParallel() if v == "colwise" else RowwiseParallel() for k, v in PLANS["gpt2"].items()}
    for block in transformer_layers(tp_model):
        parallelize_module(block, mesh, plan)
    tp = {s: step_bytes(tp_model, batches[s]) for s in seqs}

    fsdp_model = build(h, n, args.vocab)
    block_params = sum(p.numel() for p in transformer_layers(fsdp_model)[0].parameters())
    rest_params = sum(p.numel() for p in fsdp_model.parameters()) - n * block_params
    for block in transformer_layers(fsdp_model):
        fully_shard(block, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    fsdp = {s: step_bytes(fsdp_model, batches[s]) for s in seqs}
    for s in seqs:
        results["runs"].append({
            "seq": s, "tp_bytes": tp[s][0], "tp_calls": tp[s][1], "fsdp_bytes": fsdp[s][0], "fsdp_calls": fsdp[s][1],
            "expected_tp_all_reduce": n * 4 * b * s * h * 4,
            # the blocks gathered in forward and again in backward, the root (embeddings, ln_f) once; in: a shard
            "expected_fsdp_all_gather": (n * 2 * block_params + rest_params) * 4 // world,
            "expected_fsdp_reduce_scatter": (n * block_params + rest_params) * 4,  # in: the whole gradient
        })
    results["block_params"], results["rest_params"] = block_params, rest_params
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
