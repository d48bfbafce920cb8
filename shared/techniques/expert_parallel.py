"""Expert parallel for mixture-of-experts models, with Transformers' own plans: each process holds 1/N of every MoE
layer's experts (whole experts), and the tokens go to the process that holds their expert by all-to-all.

The model's `base_model_ep_plan` (Mixtral: `layers.*.mlp.experts` "ep_dispatch_experts", its gate_up_proj and
down_proj "grouped_gemm") is applied by `maybe_distribute_model` with DistributedConfig(ep_size=N, fsdp_size=N):
the expert tensors become DTensors Shard(0) on an "ep" mesh (process r keeps experts [r E/N, (r+1) E/N)), and each
experts module's forward becomes AllToAllEP: sort this process's (token, expert) pairs by expert, all_to_all_single
the counts, then the tokens, run the local experts, all_to_all_single the outputs back, weight and sum them. Every
other weight (attention, router, norms, embeddings, head) is FSDP2-sharded over the same N processes, which read
different batches: data parallel over the dense weights. The experts' gradients, summed over every process's
tokens by the all-to-all's backward, are divided by N (set_gradient_divide_factor), as FSDP2 averages the rest.

The router's load-balancing loss is made the global batch's (`global_router_loss`): the model computes it on this
process's tokens alone, which is not one process's loss on the whole batch (it is a product of two means).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from ..core import rules
from ..core.rules import Rule, unsplit

if TYPE_CHECKING:
    from transformers import PretrainedConfig
    from transformers.distributed import DistributedConfig

EP_IMPLEMENTATION = "all_to_all"  # transformers' AllToAllEP: tokens exchanged, every process its own batch


def dispatches_tokens(plan: dict[str, str] | None) -> bool:
    """Whether an expert-parallel plan sends tokens to the experts' processes ("ep_dispatch_experts")."""
    return "ep_dispatch_experts" in (plan or {}).values()


def num_experts(config: PretrainedConfig) -> int:
    """Experts per MoE layer (Mixtral's num_local_experts, Qwen-MoE's num_experts; 0: none)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def check_config(config: PretrainedConfig, world: int) -> None:
    """Refuse (shared/core/rules.py), from the config alone, before any weight loads: a model without an
    expert-parallel plan that dispatches tokens, or whose experts do not split over `world` processes."""
    rules.check_built(model_type=config.model_type, ep_dispatch=dispatches_tokens(config.base_model_ep_plan))
    rules.check_built(experts=num_experts(config), ep_degree=world)


def distribute(model: nn.Module, world: int) -> DistributedConfig:
    """Experts split over all `world` processes, dense weights FSDP2-sharded over them, in place (transformers'
    prepare_distribute_model + maybe_distribute_model). Every process must hold the same whole model first (the
    same seed): each keeps its own chunk of its own full tensors. Returns the DistributedConfig."""
    from transformers.distributed import DistributedConfig

    config = DistributedConfig(ep_size=world, fsdp_size=world, ep_implementation=EP_IMPLEMENTATION)
    config, _device_map, meshes = type(model).prepare_distribute_model(config)
    type(model).maybe_distribute_model(model, config, meshes)
    return config


def save_consolidated(accelerator, model: nn.Module, task, output_dir: str) -> None:
    """One model.safetensors that from_pretrained loads in one process, by Transformers' own distributed save (a
    collective: every process calls it): each FSDP2 and expert shard gathered whole (get_model_state_dict with
    full_state_dict), the main process writing. config.json keeps the model's own num_local_experts."""
    model.save_pretrained(output_dir, is_main_process=accelerator.is_main_process)
    if accelerator.is_main_process:
        task.save_preprocessing(output_dir)
    accelerator.wait_for_everyone()


def expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """name -> each module whose forward dispatches tokens to the experts (the plan's "ep_dispatch_experts")."""
    patterns = [k for k, v in (model.config.base_model_ep_plan or {}).items() if v == "ep_dispatch_experts"]
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    prefix = model.base_model_prefix
    return {name: m for name, m in model.named_modules()
            if replace_layer_number_by_wildcard(name.removeprefix(f"{prefix}.")) in patterns}


def global_router_loss(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Replace the model's router aux loss in training by the global batch's, on every process.

    Switch Transformer's loss (transformers' load_balancing_loss_func) is E x sum_e f_e P_e: f_e the share of
    (token, slot) routes to expert e, P_e the mean router probability of e, both over all layers and all tokens.
    Computed on one process's tokens it is another number than on the whole batch. Here each process sums its
    route counts, router probabilities and rows (masked as the model masks them), and the sums are all-reduced in
    one differentiable all_reduce (torch's functional collective): its backward sums every process's gradient of
    the probabilities into each; FSDP2's mean over the N processes then leaves one process's gradient."""
    from torch.distributed._functional_collectives import all_reduce

    experts, top_k = num_experts(model.config), model.config.num_experts_per_tok

    def hook(module: nn.Module, _args: tuple, kwargs: dict, out: object) -> object:
        logits = getattr(out, "router_logits", None)
        if not module.training or not logits or getattr(out, "aux_loss", None) is None:
            return out  # evaluation, or a model that computes no aux loss (a sequence classifier)
        mask = kwargs.get("attention_mask")
        mask = mask if mask is not None and mask.dim() == 2 else None  # a padding mask; not packing's 4-D one
        counts = torch.zeros(experts, device=logits[0].device)
        probs = torch.zeros(experts, device=logits[0].device)
        rows = torch.zeros((), device=logits[0].device)
        for layer in logits:
            p = torch.softmax(layer.float(), dim=-1)
            m = torch.ones(p.shape[0], device=p.device) if mask is None else mask.reshape(-1).to(p)
            chosen = torch.topk(p, top_k, dim=-1).indices.reshape(-1)
            counts = counts.index_add(0, chosen, m.repeat_interleave(top_k))
            probs = probs + (p * m[:, None]).sum(0)
            rows = rows + m.sum()
        # The counts have no gradient (top-k picks); the probabilities carry the router's.
        total = all_reduce(torch.cat([probs, counts, rows[None]]), "sum", group or dist.group.WORLD)
        probs, counts, rows = total[:experts], total[experts:-1], total[-1]
        out.aux_loss = experts * (counts / rows * probs / rows).sum()
        return out

    model.register_forward_hook(hook, with_kwargs=True)


class ExpertLoad:
    """Tokens routed to each expert of each MoE layer over the training steps (load balance): a forward pre-hook on
    each experts module counts the router's top_k_index it receives (global expert ids, one per token and slot),
    on the device, with no host sync per step; `report()` sums the counts over the processes (a collective)."""

    def __init__(self, model: nn.Module) -> None:
        self.experts = num_experts(model.config)
        self.counts: dict[str, torch.Tensor] = {}
        for name, module in expert_modules(model).items():
            self.counts[name] = torch.zeros(self.experts, dtype=torch.long, device=_device_of(module))
            module.register_forward_pre_hook(self._counter(name))

    def _counter(self, name: str) -> Callable[[nn.Module, tuple], None]:
        def count(module: nn.Module, args: tuple) -> None:
            if module.training:  # training tokens only, not the evaluation's
                index = args[1].reshape(-1)
                self.counts[name].index_add_(0, index, torch.ones_like(index))
        return count

    def report(self, world: int) -> dict[str, object]:
        """tokens_per_expert (layer -> per expert, all processes), tokens_per_process (layer -> what each process's
        experts computed: contiguous blocks of E/N), expert_load_imbalance (layer -> max / mean over the experts,
        1.0 is perfect balance) and its maximum over the layers."""
        names = list(self.counts)
        total = torch.stack([self.counts[n] for n in names]) if names else torch.zeros(0, self.experts)
        dist.all_reduce(total)
        per_expert = {n: row.tolist() for n, row in zip(names, total.cpu(), strict=True)}
        imbalance = {n: max(c) / (sum(c) / len(c)) if sum(c) else None for n, c in per_expert.items()}
        share = self.experts // world
        return {"tokens_per_expert": per_expert,
                "tokens_per_process": {n: [sum(c[r * share:(r + 1) * share]) for r in range(world)]
                                       for n, c in per_expert.items()},
                "expert_load_imbalance": imbalance,
                "max_expert_load_imbalance": max((v for v in imbalance.values() if v is not None), default=None)}


def _device_of(module: nn.Module) -> torch.device:
    p = next(module.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def local_param_counts(model: nn.Module) -> dict[str, int]:
    """Parameters this process holds (live local tensors): "expert", its shard of the experts (a DTensor on the
    "ep" mesh); "dense", its FSDP2 shard of every other weight. Count them at rest: during a forward FSDP2 swaps
    in the gathered weights, and it keeps the final norm and head gathered after one (reshard_after_forward=False)."""
    from torch.distributed.tensor import DTensor

    counts = {"expert": 0, "dense": 0}
    for p in model.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        counts["expert" if "ep" in names else "dense"] += (p.to_local() if isinstance(p, DTensor) else p).numel()
    return counts


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.ep_dispatch is False,
         lambda r: f"The {r.model_type or 'model'} config has no expert-parallel plan that dispatches tokens to "
                   "experts (config.base_model_ep_plan with an 'ep_dispatch_experts' rule): it is not a mixture of "
                   "experts that Transformers can split",
         lambda r: "use --model_preset tiny-moe or a mixture-of-experts model whose config has one (Mixtral, "
                   "Qwen-MoE, DeepSeek-V3, ...), or recipes/fsdp.py to shard a dense model", built=True),
    Rule(lambda r: r.ep_degree > 0 and bool(unsplit(r, r.ep_degree, experts=r.experts)),
         lambda r: f"The model's {r.experts} experts per layer do not split over {r.ep_degree} processes (each "
                   "holds an equal share of them, whole)",
         lambda r: "launch a divisor of it (--num_processes), or pick a model whose expert count it divides",
         built=True),
)
rules.register(*RULES, fields=dict(model_type="", ep_dispatch=None, ep_degree=0, experts=0))
