"""The "horse" entry of transformers' attention interface: its q, k, v through our flash attention kernels.

transformers calls ``attention(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)`` with
query (batch, heads, seqlen_q, head_dim) and key, value (batch, kv_heads, seqlen_k, head_dim), K and V not
repeated for grouped-query attention, and takes back (out (batch, seqlen_q, heads, head_dim), weights). The
kernels take (batch, seqlen, heads, head_dim) with any strides: q, k, v go in as transposed views, no copy.

Which kernel, in the order transformers' own flash path decides it:

- a padding mask (left or right): the tokens kept are gathered into flash-attn's packed layout,
  ``flash_attention_varlen`` runs, and the outputs go back to their places (zeros at the padding);
- ``cu_seq_lens_q/k`` and ``max_length_q/k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
  ``flash_attention_varlen`` over those documents;
- ``position_ids`` that restart (padding-free packing, as transformers' masks read them: a token whose
  position is not the previous one's + 1 starts a document): ``flash_attention_varlen`` over the documents;
- fewer queries than keys (a KV cache's decode step) and no gradient wanted: ``flash_attention_with_kvcache``
  over the whole cache;
- otherwise ``flash_attention``.

Causal masks align to the bottom-right corner, as transformers' do with a cache. The sliding window follows
transformers' masks: query q sees keys kv with q - w < kv <= q, w keys counting its own, flash-attn's
``window_size=(w - 1, 0)``. A ``softcap`` (Gemma 2's attn_logit_softcapping) is the kernels' own: the scaled
scores become softcap · tanh(s / softcap) before the mask, as in transformers' eager attention. So are the
attention sinks ``s_aux`` (gpt-oss's, a logit per head): each adds exp(sink) to its head's softmax
denominator.

The padding mask reaches the function only because :func:`padding_mask` is registered under the same name in
transformers' mask interface: a name without a mask function gets ``attention_mask=None``, padding ignored.

Refused, each with an error that says what to do: attention dropout above 0 in training,
``output_attentions``, 4-D (custom) masks, float32 activations
on the Triton path (see :func:`check_half_precision`).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)

from horse.kernels import flash_attention, flash_attention_varlen, flash_attention_with_kvcache, runtime

NAME = "horse"


def check_half_precision(x: torch.Tensor, what: str) -> None:
    """Refuse float32 activations where the Triton kernels run (a GPU, or the CPU interpreter), unless
    autocast hands the kernels 16-bit inputs: their matmuls take float16 and bfloat16 only, and running
    float32 models on the float32 reference instead would be slow without a word."""
    if x.dtype == torch.float32 and runtime.runs_triton(x) and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"horse.hf: {what} got float32 activations on {x.device}, and the fused attention and MLP "
            "kernels take float16 or bfloat16 there. Load the model with torch_dtype=torch.bfloat16 (or "
            "float16), or run it under torch.autocast (Trainer: bf16=True or fp16=True); "
            "horse.hf.unapply(model) gives the model its own forwards back."
        )


def _refuse_unsupported(module, attention_mask, dropout, kwargs) -> None:
    layer = type(module).__name__
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"horse.hf attention ({layer}): got a {attention_mask.dim()}-D attention mask; it takes a 2-D "
            "padding mask (batch, seqlen) or none; a custom 4-D mask needs attn_implementation='sdpa' or "
            "'eager'."
        )
    if dropout > 0:
        raise ValueError(
            f"horse.hf attention ({layer}): attention dropout {dropout} in training, which the fused "
            "attention does not do. Set it to 0: from_pretrained(..., attention_dropout=0.0), for GPT-2 "
            "from_pretrained(..., attn_pdrop=0.0) (its default is 0.1), or on a built GPT-2 model "
            "`for block in model.transformer.h: block.attn.attn_dropout.p = 0.0`."
        )
    if kwargs.get("output_attentions"):
        raise ValueError(
            f"horse.hf attention ({layer}): output_attentions=True: the fused attention never forms the "
            "attention weights. Run the model with attn_implementation='eager' to get them."
        )


@dataclass
class Sequences:
    """Variable-length sequences in a (batch, seqlen) grid: which tokens belong to them, flattened in order,
    and their offsets and longest length, as flash_attention_varlen takes them."""

    rows: tuple[torch.Tensor, torch.Tensor] | None  # (batch index, position) of each token; None: every token
    cu_seqlens: torch.Tensor  # int32 (sequences + 1,)
    max_seqlen: int


def sequences_of_mask(mask: torch.Tensor) -> Sequences:
    """The rows a (batch, seqlen) bool mask keeps, one sequence per batch row."""
    lengths = mask.sum(-1, dtype=torch.int32)
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return Sequences(mask.nonzero(as_tuple=True), cu_seqlens, int(lengths.max()))


def documents_of_positions(position_ids: torch.Tensor, batch: int) -> Sequences | None:
    """The documents of packed rows: a token whose position is not the previous token's + 1 starts one (as
    transformers' masks find packed sequences). None when no row holds more than one."""
    positions = position_ids.expand(batch, -1)
    starts = torch.ones_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    first_tokens = starts.flatten().nonzero().flatten()
    total = torch.tensor([positions.numel()], device=positions.device)
    cu_seqlens = torch.cat([first_tokens, total]).to(torch.int32)
    return Sequences(None, cu_seqlens, int(cu_seqlens.diff().max()))


class _RecentResults:
    """Results of a function of a few tensors, kept while the same tensor objects come back unchanged: every
    layer of a forward hands the attention the same mask and position_ids, so the host reads that build the
    sequences (a device sync each) happen once a forward, not once a layer. A handful of entries, as Qwen2
    alternates a full and a sliding-window mask."""

    def __init__(self, size: int = 8):
        self.size, self.entries = size, []

    def get(self, fn, *args):
        tensors = tuple(a for a in args if isinstance(a, torch.Tensor))
        others = tuple(a for a in args if not isinstance(a, torch.Tensor))
        key = tuple((t, t._version) for t in tensors), others
        for entry_key, result in self.entries:
            if _same(entry_key, key):
                return result
        result = fn(*args)
        self.entries = [(key, result), *self.entries[: self.size - 1]]
        return result


def _same(a, b) -> bool:
    (tensors_a, others_a), (tensors_b, others_b) = a, b
    return (
        len(tensors_a) == len(tensors_b)
        and all(ta is tb and va == vb for (ta, va), (tb, vb) in zip(tensors_a, tensors_b, strict=True))
        and others_a == others_b
    )


_recent = _RecentResults()


def _needs_grad(*tensors: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _unpadded(q, k, v, mask: torch.Tensor, options: dict) -> torch.Tensor:
    """Attention of a padded batch: gather the tokens kept, attend per sequence, scatter back."""
    batch, seqlen_q, heads, head_dim = q.shape
    if k.shape[1] > mask.shape[1]:  # a static cache: keys past the mask are not written yet
        k, v = k[:, : mask.shape[1]], v[:, : mask.shape[1]]
    keys = _recent.get(sequences_of_mask, mask)
    # Queries are the last seqlen_q tokens of each row (left padding, as transformers assumes with a cache).
    queries = keys if seqlen_q == mask.shape[1] else _recent.get(sequences_of_mask, mask[:, -seqlen_q:])
    out = flash_attention_varlen(
        q[queries.rows],
        k[keys.rows],
        v[keys.rows],
        queries.cu_seqlens,
        keys.cu_seqlens,
        queries.max_seqlen,
        keys.max_seqlen,
        **options,
    )
    return out.new_zeros(batch, seqlen_q, heads, head_dim).index_put_(queries.rows, out)


def _packed(q, k, v, documents: Sequences, documents_k: Sequences, options: dict) -> torch.Tensor:
    """Attention of packed rows, each document on its own (a view for one row, as packing makes them)."""
    batch, seqlen_q, heads, head_dim = q.shape
    q, k, v = (t.reshape(-1, *t.shape[2:]) for t in (q, k, v))  # (batch · seqlen, heads, head_dim)
    out = flash_attention_varlen(
        q,
        k,
        v,
        documents.cu_seqlens,
        documents_k.cu_seqlens,
        documents.max_seqlen,
        documents_k.max_seqlen,
        **options,
    )
    return out.view(batch, seqlen_q, heads, head_dim)


def _given_documents(kwargs: dict, device: torch.device) -> tuple[Sequences, Sequences] | None:
    """The documents DataCollatorWithFlattening(return_flash_attn_kwargs=True) describes, if it did."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if any(kwargs.get(name) is None for name in names):
        return None
    cu_q, cu_k, max_q, max_k = (kwargs[name] for name in names)
    as_offsets = lambda cu: torch.as_tensor(cu, device=device).to(torch.int32)  # noqa: E731
    return Sequences(None, as_offsets(cu_q), int(max_q)), Sequences(None, as_offsets(cu_k), int(max_k))


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface on our kernels (see the module docstring); returns (out, None)."""
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    causal = module.is_causal if is_causal is None else is_causal
    # transformers' window of w keys counts the query's own: flash-attn's left side is w - 1 (causal sets
    # the right side to 0).
    window = (-1, -1) if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    options = {"causal": causal, "softmax_scale": scaling, "window_size": window, "softcap": softcap or 0.0}
    if s_aux is not None:  # the kernels take the sinks in float32; the cast passes their gradient back
        options["sinks"] = s_aux.float()
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (batch, seqlen, heads, head_dim) views
    check_half_precision(q, f"attention ({type(module).__name__})")
    batch, seqlen_q = q.shape[:2]
    if attention_mask is not None:
        return _unpadded(q, k, v, attention_mask, options), None
    if (given := _given_documents(kwargs, q.device)) is not None:
        return _packed(q, k, v, *given, options), None
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and seqlen_q == k.shape[1] and seqlen_q > 1:
        documents = _recent.get(documents_of_positions, position_ids, batch)
        if documents is not None:
            return _packed(q, k, v, documents, documents, options), None
    if seqlen_q < k.shape[1] and not _needs_grad(q, k, v):
        return flash_attention_with_kvcache(q, k, v, **options), None
    return flash_attention(q, k, v, **options), None


def padding_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function=None,
    attention_mask: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor | None:
    """transformers' mask interface for "horse": the 2-D padding mask (batch, kv_length) bool, its last
    kv_length columns (a sliding-window cache keeps only those), or None when it masks nothing. The causal
    shape, the window and packed documents are the attention function's to apply."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, -kv_length:]
    if mask.shape[1] == kv_length and bool(mask.all()):
        return None
    return mask
