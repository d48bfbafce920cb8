"""Chunked cross-entropy for causal LMs: the head's matmul and the loss run a chunk of tokens at a time, each chunk
recomputed in backward, so the batch x sequence x vocabulary logits never exist at once.

The plain loss keeps fp32 log-probabilities of every token for backward (B*T*V*4 bytes: the largest activation of a
step at a 50K vocabulary). Here each chunk runs under torch.utils.checkpoint (non-reentrant): autograd keeps the
chunk's input, a view of the hidden states, and rebuilds that chunk's logits in backward, one chunk at a time. The
loss and gradients are torch's own (F.cross_entropy, autograd): nothing is differentiated by hand.

The head is called as a MODULE in every chunk, never through its `.weight`: the hooks that ZeRO-3 and FSDP2 put on it
then gather its sharded (or tied) weight exactly as they do for the model's own forward.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from ..core import rules
from ..core.losses import causal_lm_loss, shift_labels, summed_cross_entropy
from ..core.rules import Rule
from .deepspeed_setup import gathered_parameters
from .probes import saved_activation_bytes

# Configs whose forward changes the logits after the head (Gemma's soft-capping, Cohere's and Granite's scales): a loss
# computed from the head's own output would silently train another objective.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def extract(model: nn.Module) -> nn.Module:
    """The model inside DDP / DeepSpeed's engine (FSDP2 shards the model in place: itself)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)


def output_head(model: nn.Module) -> nn.Module:
    """The model's lm_head module (wrappers removed: DDP, DeepSpeed's engine); refuses (shared/core/rules.py) heads
    it cannot chunk."""
    inner = extract(model)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    transforms = [f"{name}={getattr(inner.config, name)}" for name in _LOGIT_TRANSFORMS
                  if getattr(inner.config, name, None) not in (None, 1, 1.0)]
    rules.check_built(model_type=getattr(inner.config, "model_type", ""), head_kind=type(head).__name__,
                      logit_transform=", ".join(transforms))
    return head


def _chunk_loss(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    # fp32 logits as in Task.loss; under autocast the matmul itself still runs in bf16 / fp16.
    return summed_cross_entropy(head(hidden), targets)


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module,
                          num_chunks: int) -> torch.Tensor:
    """Summed next-token cross-entropy of hidden states (B, T, H) against labels (B, T), -100 = no target.

    The flattened B*T tokens are split into `num_chunks` nearly equal chunks (empty ones allowed).
    """
    # Shift the labels, not the hidden states: hidden[:, :-1] would copy every hidden state, and the copy would stay
    # alive for the recompute. The last position of each row gets no target, as in the plain loss.
    targets = shift_labels(labels).reshape(-1)
    flat = hidden.reshape(-1, hidden.size(-1))  # a view of the (contiguous) hidden states
    total = flat.new_zeros((), dtype=torch.float32)
    for h, y in zip(flat.tensor_split(num_chunks), targets.tensor_split(num_chunks), strict=True):
        total = total + checkpoint(_chunk_loss, head, h, y, use_reentrant=False)
    return total


def plain_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """The plain loss from the same hidden states: the head's full logits, then Task.loss's summed cross-entropy."""
    return causal_lm_loss(head(hidden), labels)


@contextlib.contextmanager
def _head_as_identity(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Inside: the head hands back its input, the final hidden states, as its output, and computes no logits.

    The model's forward runs through its wrapper (DDP, DeepSpeed, FSDP2) as in any step, and returns the hidden states
    where its logits would be. The backward hooks that ZeRO-3 and FSDP2 attach to the head's output are then on the
    tensor the loss really uses, and fire once every chunk is through backward: FSDP2 re-gathers there the final
    norm's weight, which Accelerate shards in one group with the head (and the tied embedding), for the norm's
    backward. Attached to unused logits they never fire, and the norm's backward met a freed weight (measured).
    Handed a zero-length slice, the head's own matmul is empty.
    """
    seen: list[torch.Tensor] = []

    def take_input(_module: nn.Module, args: tuple) -> tuple:
        seen.append(args[0])
        return (args[0][..., :0, :], *args[1:])

    def give_input_back(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
        # In the dtype the head computes in (bf16 under autocast, as its matmul would cast them), and a copy, not the
        # input itself (often a view of the norm's output, which FSDP2 warns about hooking): B x T x H, V/H times
        # smaller than the logits it replaces.
        return seen[-1].to(output.dtype, copy=True)

    # The input is taken after the wrappers' pre-hooks (gathered weight, cast input); the output is replaced before
    # their post-hooks see it (prepend), so they hook the hidden states.
    handles = [head.register_forward_pre_hook(take_input), head.register_forward_hook(give_input_back, prepend=True)]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def final_hidden_states(model: nn.Module, head: nn.Module, batch: dict) -> tuple[torch.Tensor, object]:
    """The hidden states the model's head turns into logits (after the final norm), from the model's own forward;
    and that forward's output (a mixture of experts' aux_loss is on it)."""
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "use_cache")}
    with _head_as_identity(head) as seen:
        out = model(**inputs, use_cache=False)  # no KV cache in training (as Task.loss)
    hidden = out.logits
    if len(seen) != 1 or hidden.shape != seen[0].shape:  # the facts cost nothing to gather when they are as expected
        rules.check_built(head_calls=len(seen), head_reshaped=bool(seen) and hidden.shape != seen[0].shape)
    return hidden, out


def _whole_copy(head: nn.Module) -> nn.Linear:
    """A local nn.Linear with the head's whole weight: ZeRO-3 gathers its partitions, FSDP2 its shards (collectives:
    call on every process)."""
    kind = "Linear" if isinstance(head, nn.Linear) else type(head).__name__  # subclasses copy as nn.Linear too
    rules.check_built(linear_head_needed=True, head_kind=kind)
    with gathered_parameters(head), torch.no_grad():
        whole = [t.full_tensor() if isinstance(t, DTensor) else t for t in (head.weight, head.bias) if t is not None]
        # skip_init: a random init would draw from the RNG that the training steps' dropout uses
        copy = nn.utils.skip_init(nn.Linear, whole[0].size(1), whole[0].size(0), bias=len(whole) == 2,
                                  device=whole[0].device, dtype=whole[0].dtype)
        for dst, src in zip(copy.parameters(), whole, strict=True):
            dst.copy_(src)
    return copy


@dataclass(frozen=True)
class ChunkedLoss:
    """Task.loss for a causal LM, chunked: summed cross-entropy over chunks of at most `chunk_size` tokens, divided by
    `num_items` (the global batch's target tokens, as in every recipe)."""

    chunk_size: int
    max_tokens: int  # per-device batch x max_seq_length: the most tokens one batch can hold
    task: object | None = None  # the Task: a mixture of experts' router loss is added (Task.router_loss) and reported

    @property
    def num_chunks(self) -> int:
        # Fixed by the flags, not by each batch's padded length: under ZeRO-3 every head call gathers the head's
        # weight (a collective), so every process must make the same number of calls, every step.
        return math.ceil(self.max_tokens / self.chunk_size)

    def __call__(self, model: nn.Module, batch: dict, num_items: torch.Tensor | float) -> torch.Tensor:
        if self.task is not None:
            self.task.refuse_hooks(("keep_columns", "loss_fn", "count_fn"), "a chunked loss needs the head: it is "
                                   "its own cross-entropy, chunk by chunk. Write your loss over chunks, or use "
                                   "recipes/baseline.py")
        head = output_head(model)
        # The task's own inputs: per-document packing's block-diagonal mask (shared/tasks/packing.py)
        hidden, out = final_hidden_states(model, head, self.task._inputs(batch) if self.task is not None else batch)
        loss = chunked_cross_entropy(hidden, batch["labels"], head, self.num_chunks) / num_items
        if getattr(out, "aux_loss", None) is None:
            return loss
        if self.task is None:  # the router's load-balancing loss would silently not train
            raise ValueError("The model returns a router aux_loss (a mixture of experts): pass ChunkedLoss(..., "
                             "task=task) so that it is added to the loss as Task.loss adds it")
        return loss + self.task.router_loss(out, self.task.count_items(batch), num_items)

    def measure_first_batch(self, accelerator, model: nn.Module, batches: Iterator[dict]
                            ) -> tuple[dict[str, object], Iterator[dict]]:
        """saved_bytes on the first batch, before the meter's peak starts (the plain loss's full logits are built
        once here, and are not the run's peak); returns the figures and the batches, that one first again."""
        first = next(batches)
        with accelerator.autocast():
            measured = self.saved_bytes(model, first)
        return measured, itertools.chain([first], batches)

    def saved_bytes(self, model: nn.Module, batch: dict) -> dict[str, object]:
        """Saved-for-backward bytes of this loss and of the plain one, from the same hidden states of one batch on.

        Counted with probes.saved_activation_bytes on a whole local copy of the head: its parameters are not
        counted (a gathered ZeRO-3 weight, a new storage, would be). Both figures include the hidden states: the
        chunks keep them (with the shifted labels) as their checkpoint inputs, the plain matmul as its input.
        """
        head = output_head(model)
        was_training = model.training
        model.eval()  # no dropout: the measurement draws nothing from the RNG the training steps' dropout uses
        with torch.no_grad():
            hidden, _ = final_hidden_states(model, head, self.task._inputs(batch) if self.task is not None else batch)
        model.train(was_training)
        local = _whole_copy(head)
        hidden, labels = hidden.detach().requires_grad_(), batch["labels"]
        with saved_activation_bytes(local) as chunked:
            loss = chunked_cross_entropy(hidden, labels, local, self.num_chunks)
        measured = {"loss_saved_bytes": chunked["bytes"], "loss_saved_bytes_tokens": labels.numel()}
        try:
            with saved_activation_bytes(local) as plain:
                reference = plain_cross_entropy(hidden, labels, local)
        except torch.OutOfMemoryError:  # the full logits do not fit, which is why one chunks: say so, and train
            return {**measured, "loss_saved_bytes_plain": None, "loss_chunked_minus_plain": None}
        # The difference of the two mean losses (summed / target tokens) on this batch: rounding only.
        targets = max(1, int((labels[:, 1:] != -100).sum()))
        return {**measured, "loss_saved_bytes_plain": plain["bytes"],
                "loss_chunked_minus_plain": (loss - reference).item() / targets}


# The refusals of this technique, in the rule table (shared/core/rules.py) once this module is imported.
RULES = (
    Rule(lambda r: r.chunked_loss and r.task not in ("", "causal-lm", "sft"),
         lambda r: f"{r.flag('chunked_loss')} chunks a causal LM's vocabulary logits, and --task {r.task} has no "
                   "vocabulary head",
         lambda r: f"pass --task causal-lm or sft, or use recipes/baseline.py for {r.task}"),
    Rule(lambda r: r.head_kind == "None",
         lambda r: f"the {r.model_type} model has no output embeddings (get_output_embeddings() is None): "
                   "there are no vocabulary logits to chunk",
         lambda r: "use recipes/baseline.py", built=True),
    Rule(lambda r: bool(r.logit_transform),
         lambda r: f"the model transforms its logits after the head (config.{r.logit_transform}), which the chunked "
                   "loss would skip",
         lambda r: "use recipes/baseline.py for this model", built=True),
    Rule(lambda r: r.head_calls != 1 or r.head_reshaped,
         lambda r: f"the model calls its head {r.head_calls} times in a forward, or reshapes its output: the chunked "
                   "loss cannot tell which call makes the logits",
         lambda r: "use recipes/baseline.py", built=True),
    Rule(lambda r: r.linear_head_needed and r.head_kind != "Linear",
         lambda r: f"The model's head is a {r.head_kind}, not an nn.Linear",
         lambda r: "use recipes/baseline.py", built=True),
)
rules.register(*RULES, fields=dict(
    chunked_loss=False, model_type="", head_kind="", logit_transform="", head_calls=1, head_reshaped=False,
    linear_head_needed=False), late=True)
