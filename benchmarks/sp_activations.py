"""Ulysses sequence parallelism (shared/techniques/ulysses.py) against the whole sequence in one process, per length.

    accelerate launch --config_file accelerate_configs/multi_cpu.yaml benchmarks/sp_activations.py
    ... benchmarks/sp_activations.py --seq_lens 256 1024 --output out.json   # the test's cheaper points

Each of the 2 processes builds the same model (GPT-2, and Llama with rotary positions and 2 key/value heads: width
128, 4 heads, 2 blocks, vocabulary 1024, 2048 positions, no dropout) and the same batch, then, at each length:
- the reference: the whole sequence on this process alone, plain sdpa, the loss as shared/core/tasks.py computes it;
- sequence parallel: this process's chunk (shard()), DeepSpeed's all-to-all around attention, gradients summed over
  the processes with torch.distributed.all_reduce (what DDP does in the recipe);
- the two ways a chunked run goes wrong: labels shifted inside each chunk, and position ids restarting per chunk.
Saved-for-backward bytes of one forward (shared.techniques.probes.saved_activation_bytes: parameters excluded) for both.
Writes --output (JSON) from the main process; prints the table of docs/sequence_parallel.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.techniques import ulysses as sp  # noqa: E402
from shared.techniques.probes import saved_activation_bytes  # noqa: E402


def reference_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """shared/core/tasks.py's causal-LM loss on the whole sequence: summed over targets / target count."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum") / (
        ids[:, 1:].numel())


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def measure(model, sp_model, ids: torch.Tensor, rank: int, world: int) -> dict[str, float]:
    model.zero_grad(set_to_none=True)
    sp_model.zero_grad(set_to_none=True)
    with saved_activation_bytes(model) as ref_bytes:
        ref = reference_loss(model, ids)
    ref.backward()
    ref_grads = grads(model)

    batch = {"input_ids": ids, "labels": ids}
    chunk = sp.shard(batch, rank, world)
    count = ids[:, 1:].numel()  # every process has the whole batch: its global target count
    with saved_activation_bytes(sp_model) as sp_bytes:
        loss = sp.loss(sp_model, chunk, count / world)
    (loss / world).backward()  # all_reduce sums; DDP averages with the loss scaled by the process count instead
    got = grads(sp_model)
    for g in got.values():
        dist.all_reduce(g)
    total = loss.detach().clone()
    dist.all_reduce(total)
    sp_loss = total / world

    with torch.no_grad():  # the two mistakes, each alone
        local = dict(chunk)
        local_labels = batch["labels"][:, chunk["position_ids"][0]]  # labels of this chunk, shifted inside it
        local["shift_labels"] = F.pad(local_labels[:, 1:], (0, 1), value=-100)
        part = (local["shift_labels"] != -100).sum().float()
        parts = part.clone()
        dist.all_reduce(parts)
        inside = sp.loss(sp_model, local, parts / world)  # each token weighed over the targets left
        dist.all_reduce(inside)
        restarted = dict(chunk, position_ids=chunk["position_ids"] - chunk["position_ids"][:, :1])
        wrong_pos = sp.loss(sp_model, restarted, count / world)
        dist.all_reduce(wrong_pos)
        # the reference without the targets that chunk boundaries drop: what the in-chunk shift computes
        logits = model(input_ids=ids, use_cache=False).logits.float()[:, :-1]
        targets = ids[:, 1:].clone()
        chunk_len = ids.shape[1] // world
        targets[:, [r * chunk_len - 1 for r in range(1, world)]] = -100
        dropped = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                                  reduction="sum") / (targets != -100).sum()
    return {
        "seq_len": ids.shape[1],
        "loss_reference": ref.item(),
        "loss_sequence_parallel": sp_loss.item(),
        "loss_rel_diff": abs(sp_loss.item() - ref.item()) / ref.item(),
        "grad_max_rel_diff": max(rel(got[n], ref_grads[n]) for n in ref_grads),
        "loss_labels_shifted_in_chunk": inside.item() / world,
        "loss_reference_without_boundary_targets": dropped.item(),
        "loss_positions_restarted": wrong_pos.item() / world,
        "saved_bytes_reference": ref_bytes["bytes"],
        "saved_bytes_sequence_parallel": sp_bytes["bytes"],
    }


def adapter_steps(rank: int, world: int) -> list[dict]:
    """What DeepSpeed's UlyssesSPDataLoaderAdapter (the loader Accelerate's sp_backend="deepspeed" wraps) gives this
    process per step, when process r's own loader holds sample r (tokens 100 r, 100 r + 1, ...), as Accelerate's
    prepared loaders give each process its own samples."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter
    from torch.utils.data import DataLoader

    tokens = torch.arange(8) + 100 * rank
    loader = DataLoader([{"input_ids": tokens, "labels": tokens, "position_ids": torch.arange(8)}], batch_size=1)
    adapter = UlyssesSPDataLoaderAdapter(loader, sp_rank=rank, sp_group=dist.group.WORLD, sp_world_size=world,
                                         device=torch.device("cpu"))
    return [{k: next_batch[k][0].tolist() for k in ("input_ids", "shift_labels")}
            for next_batch in (next(adapter) for _ in range(world))]


def build_model(kind: str, max_len: int, vocab: int):
    """GPT-2 (learned absolute positions) or Llama (rotary positions, 2 key/value heads for 4 query heads: GQA)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if kind == "gpt2":
        config = GPT2Config(n_embd=128, n_layer=2, n_head=4, n_positions=max_len, vocab_size=vocab, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")
    config = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=max_len, vocab_size=vocab)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq_lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument("--models", nargs="+", default=["gpt2", "llama"], choices=("gpt2", "llama"))
    p.add_argument("--batch_size", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--output", default=str(ROOT / "docs" / "results" / "sequence_parallel.json"))
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for kind in args.models:
        torch.manual_seed(0)
        # positions for 2048 at any --seq_lens: the same weights (and figures) for the test's shorter list
        model = build_model(kind, max(2048, *args.seq_lens), args.vocab)
        model.train()
        sp_model = copy.deepcopy(model)
        sp.enable(sp_model, world)
        for length in args.seq_lens:
            ids = torch.randint(0, args.vocab, (args.batch_size, length),
                                generator=torch.Generator().manual_seed(length))
            row = {"model": kind, **measure(model, sp_model, ids, rank, world)}
            per_rank = [None] * world
            dist.all_gather_object(per_rank, row["saved_bytes_sequence_parallel"])
            row["saved_bytes_sequence_parallel_per_process"] = per_rank
            row["saved_bytes_ratio"] = max(per_rank) / row["saved_bytes_reference"]
            rows.append(row)
    adapter = [None] * world
    dist.all_gather_object(adapter, adapter_steps(rank, world))
    if rank == 0:
        report = {"ulysses_adapter_steps_per_process": adapter,
                  "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread(s) per process, torch "
                             f"{torch.__version__}, gloo", "processes": world, "batch_size": args.batch_size,
                  "models": "width 128, 4 heads (Llama: 2 key/value heads), 2 blocks, vocabulary 1024",
                  "rows": rows}
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
        print("| model | sequence | saved MiB, 1 process | saved MiB per process, SP | ratio | loss rel. diff | "
              "grad max rel. diff | labels shifted in chunk | positions restarted |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            ref = r["loss_reference"]
            print(f"| {r['model']} | {r['seq_len']} | {r['saved_bytes_reference'] / 2**20:.2f} | "
                  f"{max(r['saved_bytes_sequence_parallel_per_process']) / 2**20:.2f} | {r['saved_bytes_ratio']:.3f} | "
                  f"{r['loss_rel_diff']:.1e} | {r['grad_max_rel_diff']:.1e} | "
                  f"{(r['loss_labels_shifted_in_chunk'] - ref) / ref:+.2e} | "
                  f"{(r['loss_positions_restarted'] - ref) / ref:+.2e} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
