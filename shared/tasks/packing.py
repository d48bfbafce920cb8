"""Causal-LM samples from documents, by --packing:

    concat        documents joined, EOS between them, cut into --max_seq_length blocks (Transformers' run_clm)
    per_document  the same blocks, but no token attends to or predicts across a document boundary
    none          one document per sample, padded per batch and cut at --max_seq_length
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.errors import InputError

PACKING = ("concat", "per_document", "none")
MAP_BATCH = 1000  # documents per datasets.map call; each call drops (train) or pads (eval) its own last block


def add_args(g) -> None:
    """--packing, causal-lm's and sft's (shared/core/args.py adds the chosen task's flags): added once."""
    if "--packing" in g._option_string_actions:  # (a group shares its parser's)
        return
    g.add_argument("--packing", default="concat", choices=PACKING,
                   help="causal-lm: how documents (rows, or lines of a .txt) become samples (sft: per_document by "
                        "default, whole conversations; or none). concat: tokenized, "
                        "joined with EOS between documents and cut into blocks of --max_seq_length, the last partial "
                        "block of each 1000 documents dropped (as Transformers' run_clm): no padding, nearly every "
                        "token trained. per_document: the same "
                        "blocks, but no token attends to or predicts across a document boundary (a block-diagonal "
                        "causal mask and position_ids restarting at each document). none: one document per sample, "
                        "padded, and cut at --max_seq_length (what does not fit is lost; the run warns). Packed, "
                        "--max_train_samples and --max_eval_samples count blocks.")


def tokenize_documents(tokenizer, texts: list[str]) -> list[list[int]]:
    """Every document whole, ending in EOS, so the joined stream marks where one ends and the next begins."""
    ids = tokenizer(texts, verbose=False)["input_ids"]  # verbose=False: long documents are not an error here
    eos = tokenizer.eos_token_id
    if eos is None:  # no separator to add (run_clm joins such documents as they are)
        return ids
    return [x if x and x[-1] == eos else [*x, eos] for x in ids]


def pack(docs: list[list[int]], block_size: int, per_document: bool, keep_last: bool, pad_id: int) -> dict:
    """Blocks of `block_size` tokens from the joined documents.

    keep_last: the final partial block is padded (labels -100) rather than dropped. Training drops it, as run_clm
    does; evaluation keeps it, so a small validation set is scored in full.
    per_document: position_ids restart at each document (and at each block), and a document's first token is no
    target (-100): it would be predicted from the previous document's last token.
    """
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    flat = np.concatenate([np.asarray(d, dtype=np.int64) for d in docs]) if docs else np.zeros(0, dtype=np.int64)
    n = len(flat)
    n_blocks = n // block_size + (1 if keep_last and n % block_size else 0)
    size = n_blocks * block_size
    real = min(n, size)
    ids = np.full(size, pad_id, dtype=np.int64)
    ids[:real] = flat[:real]
    idx = np.arange(size)
    # Where each token's segment starts: its document's first token, or its block's, whichever is later.
    doc_start = np.repeat(np.cumsum(lengths) - lengths, lengths)[:real]
    seg_start = np.maximum(np.concatenate([doc_start, np.full(size - real, doc_start[-1] if real else 0)]),
                           idx // block_size * block_size)
    positions = idx - seg_start  # padding continues the last document's positions: it follows it, unseen
    labels = ids.copy()
    labels[real:] = -100
    if per_document:
        labels[positions == 0] = -100  # a block's first token is never a target anyway; the others start documents
    attention = (idx < real).astype(np.int64)
    out = {"input_ids": ids, "attention_mask": attention, "labels": labels}
    if per_document:
        out["position_ids"] = positions
    blocks = {k: v.reshape(n_blocks, block_size).tolist() for k, v in out.items()}
    lab = labels.reshape(n_blocks, block_size)
    blocks["n_targets"] = (lab[:, 1:] != -100).sum(1).tolist()  # what the loss averages over (Task.count_items)
    blocks["n_real"] = attention.reshape(n_blocks, block_size).sum(1).tolist()
    return blocks


def samples(ds, tokenizer, text_col: str, mode: str, block_size: int, train: bool, keep: tuple[str, ...] = ()):
    """A datasets.Dataset of samples from the documents in `text_col`, and the documents' token count.

    Each row also holds n_real (tokens that are not padding) and n_targets (tokens the loss predicts), for the
    figures in results.json; the caller drops them before training.
    """
    if mode == "none":  # the per-line mode: one padded sample per document, cut at block_size
        def encode(batch):
            enc = tokenizer(batch[text_col], truncation=True, max_length=block_size)
            enc["n_text"] = [len(x) for x in tokenizer(batch[text_col], verbose=False)["input_ids"]]
            enc["n_real"] = [len(x) for x in enc["input_ids"]]
            enc["n_targets"] = [max(0, len(x) - 1) for x in enc["input_ids"]]
            enc.update({c: batch[c] for c in keep if c in batch})  # load_task(keep_columns=), for Task.loss_fn
            return enc

        ds = ds.map(encode, batched=True, remove_columns=ds.column_names)
        return ds.remove_columns("n_text"), sum(ds["n_text"])

    def tokenize(batch):
        ids = tokenize_documents(tokenizer, batch[text_col])
        return {"input_ids": ids, "n_text": [len(x) for x in ids]}

    docs = ds.map(tokenize, batched=True, remove_columns=ds.column_names)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    blocks = docs.map(lambda b: pack(b["input_ids"], block_size, mode == "per_document", not train, pad_id),
                      batched=True, batch_size=MAP_BATCH, remove_columns=docs.column_names)
    return blocks, sum(docs["n_text"])


class BlockCollator:
    """Stacks blocks, which all have the same length: no padding to add."""

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        return {k: torch.tensor([f[k] for f in features]) for k in features[0]}


def document_attention_mask(position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                            attn_implementation: str, window: int | None = None) -> torch.Tensor:
    """A (batch, 1, L, L) mask: causal, within each document (a run of positions from 0), never to padding; within
    `window` tokens when set (a sliding-window layer: key > query - window, as Transformers masks it).

    Transformers returns a 4-D mask as it is (masking_utils._preprocess_mask_arguments) and hands it to the
    attention function: sdpa takes a boolean (True: attend), eager adds it to the scores (0 or a large negative).
    """
    seg = (position_ids == 0).cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    if window:
        causal &= torch.ones(length, length, dtype=torch.bool, device=position_ids.device).triu(1 - window)
    allowed = (seg[:, :, None] == seg[:, None, :]) & causal
    if attention_mask is not None:
        allowed &= attention_mask[:, None, :].bool()
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    # float32: eager adds it to fp32, fp16 or bf16 scores; the sum is promoted and softmax is taken in float
    return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)


def flash_varlen_kwargs(position_ids: torch.Tensor) -> dict:
    """Cumulative segment lengths over the flattened batch, as flash-attn's varlen kernel takes them.

    Transformers infers them from position_ids only for a batch of one (modeling_flash_attention_utils.
    _is_packed_sequence); given explicitly (FlashAttentionKwargs), they serve any batch of blocks.
    """
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()  # every block starts at 0 too: a segment never spans two blocks
    cu = torch.cat([starts, torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


def per_document_inputs(inputs: dict, attn_implementation: str, config=None) -> dict:
    """The model inputs that keep documents apart, for the attention implementation the model runs.

    sdpa and eager: an explicit 4-D mask (a 2-D padding mask would switch off Transformers' own detection of packed
    position_ids). flash_attention_2/3: no mask, the segments as varlen cu_seqlens. Others (flex): position_ids
    alone, from which Transformers' masking_utils derives the document boundaries. Padding (evaluation only) sits
    after the last document and is never a target, so where its mask is dropped no real token changes.

    A model with sliding-window layers (`config`: Mistral, Gemma 2/3, gpt-oss, Qwen2 with use_sliding_window) gets
    the window in its mask too: a 4-D mask is used as given, so one causal mask would silently widen every window
    (measured on a Gemma-3-style model: logits 0.54 away from each document run alone). Layers of two kinds: one
    mask per kind, in the {layer type: mask} mapping the model's forward takes in place of building its own.
    """
    inputs = dict(inputs)
    mask = inputs.pop("attention_mask", None)
    if attn_implementation in ("sdpa", "eager"):
        from ..core.attention import SLIDING, layer_attention_types

        kinds = set(layer_attention_types(config)) if config is not None else {"full_attention"}
        if kinds - {SLIDING, "full_attention"}:  # chunked or linear attention: a document mask of its own kind
            raise InputError(f"--packing per_document: the model has {sorted(kinds)} layers, and the document mask "
                             "is written for full and sliding-window attention only. Fix: use --packing concat.")
        masks = {kind: document_attention_mask(inputs["position_ids"], mask, attn_implementation,
                                               config.sliding_window if kind == SLIDING else None) for kind in kinds}
        inputs["attention_mask"] = masks if len(masks) > 1 else next(iter(masks.values()))
    elif "flash" in attn_implementation:
        inputs.update(flash_varlen_kwargs(inputs["position_ids"]))
    return inputs
