"""Tensor parallel: each block's attention and MLP matrices split over the processes.

Megatron's layout: in each pair of matrices the first is split by its output features (column-wise: every process
computes its share of the heads, or of the MLP's hidden units) and the second by its input features (row-wise: each
process's partial product is summed by one all-reduce).

Two sources of the plan. A model whose config ships one (transformers' `base_model_tp_plan`: Llama, Qwen2/3, Mistral,
Mixtral, Gemma ...) is split by transformers' own styles (transformers.distributed.tensor_parallel), which also split
the embedding and head over the vocabulary (the logits gathered) and, for Mixtral, every expert's MLP. GPT-2, BERT and
ViT ship none: PLANS below, applied with torch's parallelize_module, keep their embeddings, norms and head replicated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from ..core import rules
from ..core.attention import attention_features
from ..core.errors import LaunchError
from ..core.models import transformer_layers
from ..core.optim import kept_apart
from ..core.rules import Rule, unsplit

# model_type -> {module inside each block: "colwise" | "rowwise"}; the pairs are (qkv -> out) and (up -> down).
PLANS: dict[str, dict[str, str]] = {
    "gpt2": {"attn.c_attn": "colwise", "attn.c_proj": "rowwise", "mlp.c_fc": "colwise", "mlp.c_proj": "rowwise"},
    "bert": {"attention.self.query": "colwise", "attention.self.key": "colwise", "attention.self.value": "colwise",
             "attention.output.dense": "rowwise", "intermediate.dense": "colwise", "output.dense": "rowwise"},
    "vit": {"attention.q_proj": "colwise", "attention.k_proj": "colwise", "attention.v_proj": "colwise",
            "attention.o_proj": "rowwise", "mlp.fc1": "colwise", "mlp.fc2": "rowwise"},
}


OWN = "own"  # family_of: the model's own base_model_tp_plan, applied by transformers


def family_of(config, world: int, shard_vocab: bool = False) -> str:
    """The model's PLANS entry, or OWN for a config that ships a plan; refuses (shared/core/rules.py), from the config
    alone (before the weights load), a model with neither, or whose heads do not split over `world` processes."""
    own = bool(getattr(config, "base_model_tp_plan", None))
    rules.check_built(model_type=config.model_type, tp_plans=tuple(PLANS) + ((config.model_type,) if own else ()))
    mlp = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    kv = getattr(config, "num_key_value_heads", None) or 0  # GQA: each process takes KV heads/N and their queries
    family = OWN if own and config.model_type not in PLANS else config.model_type
    rules.check_built(heads=config.num_attention_heads, kv_heads=kv, mlp_width=mlp, tp_degree=world,
                      model_type=config.model_type, shard_vocab=shard_vocab,
                      tp_plan_source="own" if family == OWN else "ours", flags={"shard_vocab": "--shard_vocab"})
    return family


def apply_plan(model: nn.Module, family: str, mesh) -> dict[str, str]:
    """Split the model over `mesh` (the "tp" sub-mesh); returns the plan applied, one entry per module or parameter
    pattern. OWN: transformers' styles on the model's own plan (its class adds the head's entry, e.g. lm_head
    colwise_gather_output). Else PLANS[family] with torch's ColwiseParallel / RowwiseParallel in every block."""
    if family == OWN:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        # _expand_parallel_plan: transformers' own expansion of the plan's `layers.*` patterns to module names, as
        # from_pretrained(tp_plan="auto") applies it; pinned transformers==5.24 (requirements.txt).
        plan = model._expand_parallel_plan(model.tp_plan)
        # Sliding windows and soft caps act per head and per score: split heads keep them. Sinks are one parameter
        # per head: split with the heads, or refused (shared/core/rules.py).
        sinks = "attention sinks" in attention_features(model.config, model)
        rules.check_built(tp_unsplit_sinks=sinks and any(k.endswith("q_proj.weight") for k in plan)
                          and not any(k.endswith("sinks") for k in plan), model_type=model.config.model_type)
        tied = _tied_parameters(model)
        # A tied head's weight IS the embedding's: sharded once, by the embedding's style (apply_tensor_parallelism
        # lists model.named_parameters(), which names a shared parameter once: a KeyError on 'lm_head.weight').
        apply_tensor_parallelism(model, mesh, {k: v for k, v in plan.items() if k not in tied})
        for target, source in tied.items():
            _retie(model, target, source, plan, mesh)
        return dict(model.tp_plan)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    for block in transformer_layers(model):  # the weights become DTensors: this process keeps its shard
        parallelize_module(block, mesh, {name: styles[style]() for name, style in PLANS[family].items()})
    return PLANS[family]


def _tied_parameters(model: nn.Module) -> dict[str, str]:
    """{tied parameter: the parameter it shares}, e.g. {"lm_head.weight": "model.embed_tokens.weight"} for a model
    with tie_word_embeddings (Qwen2.5, Llama 3.2 1B/3B, Gemma): the names that are one tensor in this model."""
    named = dict(model.named_parameters(remove_duplicate=False))
    first: dict[int, str] = {}
    for name, p in named.items():
        first.setdefault(id(p), name)
    return {name: first[id(p)] for name, p in named.items() if first[id(p)] != name}


def _placements(style_name: str | None, shape: torch.Size, mesh) -> tuple:
    """The placements transformers' style `style_name` gives a weight of `shape` (built on the meta device, no data):
    Shard(0) for both the vocab-parallel embedding and a column-wise head; () for no style (kept whole)."""
    if style_name is None:
        return ()
    from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES

    probe = nn.Module()
    probe.weight = nn.Parameter(torch.empty(shape, device="meta"))
    ALL_PARALLEL_STYLES[style_name].shard_param(probe, "weight", mesh)
    return tuple(getattr(probe.weight, "placements", ()))


def _retie(model: nn.Module, target: str, source: str, plan: dict[str, str], mesh) -> None:
    """Point the tied `target` (the head's weight) at `source`'s parameter as apply_tensor_parallelism left it, when
    the two styles lay the one [vocab, hidden] matrix out alike (the embedding split over the vocabulary and the head
    column-wise: both Shard(0), as transformers' plans pair them). Else refused: the tie cannot hold both layouts."""
    shared = model.get_parameter(source)
    want, have = (_placements(plan.get(name), shared.shape, mesh) for name in (target, source))
    rules.check_built(tp_tie_mismatch="" if want == have else (
        f"{target} is tied to {source} (tie_word_embeddings), and the model's tensor-parallel plan lays them out "
        f"differently ({plan.get(target) or 'whole'}: {want or 'replicated'}; {plan.get(source) or 'whole'}: "
        f"{have or 'replicated'})"))
    module_name, _, param_name = target.rpartition(".")
    setattr(model.get_submodule(module_name), param_name, shared)


def _fused_qkv_order(hidden: int, world: int) -> torch.Tensor:
    """Output rows of GPT-2's fused c_attn ([q | k | v]) reordered as [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: an even
    column-wise split then gives process r its own heads' q, k and v."""
    return torch.cat([torch.arange(i * hidden, (i + 1) * hidden).chunk(world)[r]
                      for r in range(world) for i in range(3)])


def prepare_blocks(model: nn.Module, world: int) -> None:
    """What the plans need before parallelize_module, in place: GPT-2's Conv1D as nn.Linear (torch's styles take
    nn.Linear; Conv1D stores the weight transposed), its fused qkv rows grouped per process, and each attention
    module told its share of the heads (GPT-2 splits c_attn's output by split_size; BERT and ViT infer the head
    count from the shape)."""
    if model.config.model_type != "gpt2":
        return
    from .quant import conv1d_to_linear

    for block in transformer_layers(model):
        conv1d_to_linear(block)
        attn = block.attn
        order = _fused_qkv_order(attn.embed_dim, world)
        with torch.no_grad():
            attn.c_attn.weight.copy_(attn.c_attn.weight[order])
            attn.c_attn.bias.copy_(attn.c_attn.bias[order])
        attn.num_heads //= world
        attn.split_size //= world


def _full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_vocab(model: nn.Module, mesh) -> None:
    """A causal LM's vocabulary split over `mesh` (the "tp" sub-mesh), as torchtitan does: the embedding row-wise
    (each process looks up the tokens of its vocabulary rows, the partial embeddings summed by one all-reduce), the
    head column-wise with its logits left sharded over the vocabulary, for a loss under loss_parallel() that never
    gathers them (vocab_loss). GPT-2 ties the head to the embedding: both are Shard(0) of the same [vocab, hidden]
    matrix, so the head is re-tied to the embedding's DTensor. In eval mode the logits are gathered (full_tensor),
    so the task's metrics see whole logits."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    parallelize_module(model, mesh, {
        _module_name(model, model.get_input_embeddings()): RowwiseParallel(input_layouts=Replicate()),
        _module_name(model, model.get_output_embeddings()): ColwiseParallel(output_layouts=Shard(-1),
                                                                            use_local_output=False)})
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight

    def gather_in_eval(module: nn.Module, _args, out):
        if not module.training:
            out.logits = out.logits.full_tensor()
        return out

    model.register_forward_hook(gather_in_eval)


def _module_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is module)


def vocab_loss(sharded: bool):
    """loss_parallel() when the logits are sharded over the vocabulary (cross-entropy on each process's columns:
    a max, a sum of exponentials and the target's logit, each all-reduced over "tp"); else nothing. The backward
    must run inside it too."""
    from contextlib import nullcontext

    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if sharded else nullcontext()


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (the loss under loss_parallel) as a plain tensor, for the meter; a plain tensor as it is."""
    return _full(t)


def full_state_dict(model: nn.Module, world: int) -> dict[str, torch.Tensor]:
    """The whole model's state dict under its own names and layouts (a collective: every process calls it): each
    sharded parameter gathered with full_tensor(), GPT-2's qkv order and Conv1D layout restored."""
    state = {k: _full(v).detach().cpu() for k, v in model.state_dict().items()}
    if model.config.model_type == "gpt2":
        inverse = torch.argsort(_fused_qkv_order(model.config.hidden_size, world))
        for name in [k for k in state if ".attn.c_attn." in k]:
            state[name] = state[name][inverse]
        for name in [k for k in state if k.endswith(".weight") and any(f".{m}." in k for m in PLANS["gpt2"])]:
            state[name] = state[name].t().contiguous()  # nn.Linear [out, in] -> Conv1D [in, out]
    return state


def save_consolidated(accelerator, model: nn.Module, task, output_dir: str, tp: int) -> None:
    """One model.safetensors that from_pretrained loads in one process, written by the main process. `tp`: the
    tensor-parallel degree the qkv rows were ordered for."""
    state = full_state_dict(model, tp)
    if accelerator.is_main_process:
        fresh = type(model)(model.config)  # the architecture as published (Conv1D for GPT-2), then the weights
        fresh.load_state_dict(state, strict=True)
        fresh.save_pretrained(output_dir, safe_serialization=True)
        task.save_preprocessing(output_dir)
    accelerator.wait_for_everyone()


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """The global gradient norm, clipped to max_norm (0: only measured); returns the norm before clipping, a tensor
    (read it only when needed: .item() waits for the device).

    Each gradient's sum of squares is a DTensor whose placements say where it lives: sharded over "tp" and/or "dp",
    it is Partial there, and full_tensor() sums it over exactly those processes; replicated (a row-wise layer's
    bias, a norm under TP alone), it counts once. So one rule serves a 1-D tp mesh and a 2-D (dp, tp) mesh. The
    squares are first added up locally per (mesh, placements): one all-reduce per such group, not per tensor."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.zeros((), dtype=torch.float64, device=grads[0].device)
    groups: dict[tuple, DTensor] = {}
    for g in grads:
        square = g.detach().double().pow(2).sum()
        if isinstance(square, DTensor):
            key = (square.device_mesh, square.placements)
            groups[key] = square if key not in groups else groups[key] + square
        else:
            total += square
    for square in groups.values():
        total += square.full_tensor()
    norm = total.sqrt()
    if max_norm:
        # A tensor factor, not a Python float: float() would wait for the device at every step. DTensor gradients
        # take the plain 0-dim factor as replicated inside implicit_replication (they refuse it outside).
        from torch.distributed.tensor.experimental import implicit_replication

        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        with implicit_replication():
            for g in grads:
                g.mul_(coef.to(g.dtype))
    return norm


def mesh_shape(world: int, tp_size: int | None) -> tuple[int, int]:
    """(data-parallel groups, processes per tensor-parallel group): --tp_size unset is one group of all processes."""
    tp = tp_size or world
    return world // tp, tp


def local_param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters this process holds (each counted once): "sharded", those split over "tp" (this process's shard of
    a block matrix); "replicated", the rest, whole on every process of a TP group (under FSDP2, 1/dp of them)."""
    from torch.distributed.tensor import DTensor

    counts, seen = {"sharded": 0, "replicated": 0}, set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        # not is_replicate(): Mixtral's packed gate/up experts are a _StridedShard, whose is_shard() is False
        split = "tp" in names and not p.placements[names.index("tp")].is_replicate()
        counts["sharded" if split else "replicated"] += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return counts


SCHEDULER_FILE = "scheduler.pt"  # the schedule's state beside dcp/ (the same on every process)


def checkpoint_dtensors(accelerator, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                       layout: dict[str, int]) -> None:
    """Make save_state/load_state save and restore a model whose parameters are DTensors (tensor parallel, FSDP2 on
    a device mesh that Accelerate did not build) with torch.distributed.checkpoint: every process writes its own
    shards of the model and of the optimizer state into <checkpoint>/dcp/ and reads them back in place.

    `layout` (e.g. {"dp": 2, "tp": 2}) is saved beside them. A resume on another mesh reshards (dcp.load reads each
    process's new shards from the saved ones; the core keeps the global batch, checkpoint.reshard), except GPT-2 on
    another tensor-parallel degree: its fused qkv rows are ordered for the degree that saved them (prepare_blocks).
    Accelerate still saves and restores each process's RNG states; save_checkpoint's manifest covers dcp/."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    kept_apart(accelerator, scheduler)  # the schedule results.json names (not prepared)

    def save_hook(_models: list, _weights: list, output_dir: str) -> None:
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(Path(output_dir) / "dcp"))
        if accelerator.is_main_process:  # the same on every process
            torch.save(scheduler.state_dict(), Path(output_dir) / SCHEDULER_FILE)
            (Path(output_dir) / "mesh.json").write_text(json.dumps(layout))

    def load_hook(_models: list, input_dir: str) -> None:
        if not (Path(input_dir) / "mesh.json").exists():
            raise LaunchError(f"{input_dir} has no mesh.json: it was not saved by a DTensor run (tensor parallel). "
                              "Resume from a checkpoint this recipe wrote, or drop --resume_from_checkpoint.")
        saved = json.loads((Path(input_dir) / "mesh.json").read_text())
        gpt2 = getattr(getattr(model, "config", None), "model_type", "") == "gpt2"
        if saved.get("tp") != layout.get("tp") and gpt2:  # expert parallel's layout has no "tp"
            raise LaunchError(f"{input_dir} was saved on the mesh {saved}, and this run's is {layout}: GPT-2's "
                              f"fused qkv rows are ordered for {saved['tp']} tensor-parallel processes. Resume with "
                              f"--tp_size {saved['tp']} (any data-parallel degree), or a model with separate q, k, v "
                              "projections.")
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(input_dir) / "dcp"))  # into this process's shards, in place
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        scheduler.load_state_dict(torch.load(Path(input_dir) / SCHEDULER_FILE, weights_only=True))

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.tensor_parallel_size > 0 and (r.tensor_parallel_size < 2
                                                    or r.num_processes % r.tensor_parallel_size),
         lambda r: f"{r.flag('tensor_parallel_size')} {r.tensor_parallel_size} with {r.num_processes} processes: a "
                   "tensor-parallel group needs 2 or more processes, and the groups must divide the processes",
         lambda r: f"pass a divisor of {r.num_processes} that is at least 2 (e.g. {r.flag('tensor_parallel_size')} "
                   "2 with accelerate_configs/tp2_dp2.yaml), leave it unset for one group of all processes, or use "
                   "recipes/fsdp.py for data parallel alone"),
    Rule(lambda r: r.shard_vocab and r.task not in ("", "causal-lm", "sft"),
         lambda r: f"{r.flag('shard_vocab')} with --task {r.task}: only the causal LM has a vocabulary-sized head; "
                   "BERT's and ViT's heads are classifiers of num_labels outputs, too small to split",
         lambda r: f"drop {r.flag('shard_vocab')}, or use --task causal-lm"),
    Rule(lambda r: bool(r.model_type and r.tp_plans) and r.model_type not in r.tp_plans,
         lambda r: f"The {r.model_type!r} model has no tensor-parallel plan: its config ships no base_model_tp_plan "
                   f"(Llama, Qwen, Mistral and Mixtral do), and shared/techniques/tensor_parallel.py PLANS has one "
                   f"for {sorted(r.tp_plans)} only",
         lambda r: "add its block's column/row-wise modules to shared/techniques/tensor_parallel.py PLANS, or use "
                   "recipes/fsdp.py (it shards any model)", built=True),
    Rule(lambda r: bool(r.tp_tie_mismatch),
         lambda r: f"{r.tp_tie_mismatch}, so one shared weight cannot serve both",
         lambda r: "pass a model whose config has tie_word_embeddings false, or use recipes/fsdp.py (it shards tied "
                   "models)", built=True),
    Rule(lambda r: r.tp_unsplit_sinks,
         lambda r: f"The {r.model_type} model has attention sinks (one learned logit per head), and its "
                   "tensor-parallel plan splits the attention heads but not the sinks: each process would hold every "
                   "head's sink for its share of the heads",
         lambda r: "add its `layers.*.self_attn.sinks` to the plan (transformers' GraniteSWA plan shards them "
                   "colwise), or use recipes/fsdp.py", built=True),
    Rule(lambda r: r.shard_vocab and r.tp_plan_source == "own",
         lambda r: f"{r.flag('shard_vocab')} with the {r.model_type} model's own tensor-parallel plan: that plan "
                   "already splits the embedding and the head over the vocabulary, and gathers the logits for the loss",
         lambda r: f"drop {r.flag('shard_vocab')} (the vocabulary is split without it)", built=True),
    Rule(lambda r: r.tp_degree > 0 and bool(unsplit(r, r.tp_degree, heads=r.heads, kv_heads=r.kv_heads,
                                                      mlp_width=r.mlp_width)),
         lambda r: f"The model's {unsplit(r, r.tp_degree, heads=r.heads, kv_heads=r.kv_heads, mlp_width=r.mlp_width)}"
                   f" does not split over {r.tp_degree} processes (each takes an equal share of the heads, of the "
                   "key/value heads and of the MLP's units)",
         lambda r: "launch a divisor of it (--num_processes, or --tp_size), or pick a model whose heads and MLP width "
                   "it divides", built=True),
)
rules.register(*RULES[1:], late=True)  # --shard_vocab's task reads after the presets' rules
rules.register(RULES[0], fields=dict(
    tensor_parallel_size=0, shard_vocab=False, tp_unsplit_sinks=False, tp_tie_mismatch="", model_type="", tp_plans=(),
    tp_plan_source="", tp_degree=0, heads=0, kv_heads=0, mlp_width=0))
