"""The public functions: flash_attention, flash_attention_varlen and flash_attention_with_kvcache,
their arguments validated, then the custom op (the Triton kernels) or the float32 reference.
"""

import math

import torch

from horse.kernels import reference, runtime
from horse.kernels.attention import launch
from horse.kernels.attention.configs import MAX_HEAD_DIM
from horse.kernels.attention.launch import Packed, attention_fwd
from horse.kernels.attention.ops import _attn_fwd_op

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Above this many new tokens a query tile fills without packing heads or splitting keys: a prompt
# of equal-length sequences takes the prefill kernel (TMA, its tuned tiles) on the cache's rows.
DECODE_MAX_SEQLEN_Q = 16


def _validate(q, k, v, fn: str, packed: bool) -> None:
    layout = "(total_tokens, heads, head_dim)" if packed else "(batch, seqlen, heads, head_dim)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != (3 if packed else 4):
            raise ValueError(f"{fn}: {name} must be {layout}, got shape {list(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device} but q is on {q.device}")
        if t.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} is {t.dtype} but q is {q.dtype}; q, k and v must share a dtype")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(
                f"{fn}: {name} must have a contiguous last dimension (stride 1), got stride {t.stride(-1)}"
            )
    heads, head_dim = q.shape[-2:]
    if k.shape != v.shape:
        raise ValueError(f"{fn}: k and v must have the same shape, got {list(k.shape)} and {list(v.shape)}")
    if k.shape[-1] != head_dim or (not packed and k.shape[0] != q.shape[0]):
        what = f"head_dim {head_dim}" if packed else f"batch {q.shape[0]} and head_dim {head_dim}"
        raise ValueError(f"{fn}: k and v must match q's {what}, got shape {list(k.shape)}")
    if not 1 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head_dim must be in [1, {MAX_HEAD_DIM}], got {head_dim}")
    kv_heads = k.shape[-2]
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{fn}: q's heads ({heads}) must be a multiple of k and v's heads ({kv_heads})")
    if not packed and (q.shape[1] == 0 or k.shape[1] == 0 or q.shape[0] == 0):
        raise ValueError(
            f"{fn}: batch and sequence lengths must be at least 1, got q {list(q.shape)}, k {list(k.shape)}"
        )


def _validate_sequences(q, k, packed: Packed) -> None:
    """The packed batch's cu_seqlens and maxima. Their values are read only from CPU tensors in
    eager mode: on a GPU that would wait for the device at every call, and in a torch.compile graph
    it would break the graph."""
    fn = "flash_attention_varlen"
    cu_q, cu_k = packed.cu_seqlens_q, packed.cu_seqlens_k
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            got = (
                f"{cu.dtype} of shape {list(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            )
            raise ValueError(f"{fn}: {name} must be an int32 tensor of batch + 1 >= 2 offsets, got {got}")
        if cu.device != q.device:
            raise ValueError(f"{fn}: {name} is on {cu.device} but q is on {q.device}")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(
            f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length (batch + 1), got "
            f"{cu_q.numel()} and {cu_k.numel()}"
        )
    for name, value in (("max_seqlen_q", packed.max_seqlen_q), ("max_seqlen_k", packed.max_seqlen_k)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{fn}: {name} must be an int >= 0, got {value!r}")
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return
    for name, cu, total, longest in (
        ("cu_seqlens_q", cu_q, q.shape[0], packed.max_seqlen_q),
        ("cu_seqlens_k", cu_k, k.shape[0], packed.max_seqlen_k),
    ):
        lengths = cu.diff()
        if cu[0] != 0 or cu[-1] != total or (lengths < 0).any():
            raise ValueError(f"{fn}: {name} must rise from 0 to {total} (the packed rows), got {cu.tolist()}")
        if lengths.max() > longest:
            max_name = name.replace("cu_seqlens", "max_seqlen")
            raise ValueError(f"{fn}: {max_name} is {longest} but a sequence has {lengths.max().item()} rows")


def _runs_triton(q: torch.Tensor, fn: str, inputs: str = "q, k and v") -> bool:
    """Whether the Triton kernels run (:func:`runtime.runs_triton`); they take 16-bit inputs only."""
    if runtime.runs_triton(q) and q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: {inputs} must be float16 or bfloat16 on the Triton path, got {q.dtype}")
    return runtime.runs_triton(q)


def resolve_softmax_scale(softmax_scale: float | None, head_dim: int, fn: str) -> float:
    """softmax_scale, 1 / sqrt(head_dim) by default. It must be positive: the kernels take the row
    maximum of the raw scores and scale it, which a negative scale would turn into the minimum."""
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not scale > 0 or math.isinf(scale):
        raise ValueError(f"{fn}: softmax_scale must be a finite number > 0, got {softmax_scale!r}")
    return scale


def validate_score_mods(softcap, sinks, q: torch.Tensor, fn: str) -> tuple[float, torch.Tensor | None]:
    """(softcap, sinks) checked: softcap a finite number >= 0 (0: off), sinks None or a float32 tensor
    (heads,) on q's device, one logit per query head (made contiguous: the kernels index it by head)."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ValueError(f"{fn}: softcap must be a finite number >= 0 (0: off), got {softcap!r}")
    if sinks is None:
        return float(softcap), None
    heads = q.shape[-2]
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(
            f"{fn}: sinks must be a torch.Tensor of shape ({heads},) or None, got {type(sinks).__name__}"
        )
    if sinks.shape != (heads,):
        raise ValueError(
            f"{fn}: sinks must have shape ({heads},) (one logit per query head), got {list(sinks.shape)}"
        )
    if sinks.dtype != torch.float32:
        raise TypeError(f"{fn}: sinks must be float32, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"{fn}: sinks is on {sinks.device} but q is on {q.device}")
    return float(softcap), sinks.contiguous()


def validate_document_starts(document_starts, q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """document_starts checked: an int32 tensor (batch, seqlen) on q's device, with causal and as many
    keys as queries; on the CPU in eager mode (no read back from a GPU, no graph break) its values too:
    each row from 0, each column its own (a document begins) or the previous column's value."""
    fn = "flash_attention"
    batch, seqlen = q.shape[0], q.shape[1]
    if not isinstance(document_starts, torch.Tensor):
        raise TypeError(
            f"{fn}: document_starts must be a torch.Tensor ({batch}, {seqlen}) or None, got "
            f"{type(document_starts).__name__}"
        )
    if document_starts.shape != (batch, seqlen) or document_starts.dtype != torch.int32:
        raise ValueError(
            f"{fn}: document_starts must be an int32 tensor (batch, seqlen_q) = ({batch}, {seqlen}), got "
            f"{document_starts.dtype} of shape {list(document_starts.shape)}"
        )
    if document_starts.device != q.device:
        raise ValueError(f"{fn}: document_starts is on {document_starts.device} but q is on {q.device}")
    if not causal or k.shape[1] != seqlen:
        raise ValueError(
            f"{fn}: document_starts takes causal=True and seqlen_k = seqlen_q, got causal={causal}, "
            f"seqlen_q {seqlen} and seqlen_k {k.shape[1]}"
        )
    if q.device.type != "cpu" or torch.compiler.is_compiling():
        return
    columns = torch.arange(seqlen, dtype=torch.int32)
    previous = torch.cat([document_starts.new_zeros(batch, 1), document_starts[:, :-1]], dim=1)
    if not ((document_starts == columns) | (document_starts == previous)).all():
        raise ValueError(
            f"{fn}: document_starts[b, i] must be i (a document begins) or document_starts[b, i - 1] "
            f"(from 0 in each row), got {document_starts.tolist()}"
        )


def normalize_mask(causal: bool, window_size, fn: str = "flash_attention") -> tuple[bool, tuple[int, int]]:
    """(causal, window) with the window validated and causal folded into it: causal is the right
    side at 0, a window of (-1, 0) is plain causal, and a returned window other than (-1, -1) is
    never causal (its right side says it)."""
    sides = window_size if isinstance(window_size, (tuple, list)) else ()
    if len(sides) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n >= -1 for n in sides):
        raise ValueError(
            f"{fn}: window_size must be two ints (left, right), each >= 0 or -1 for "
            f"unbounded, got {window_size!r}"
        )
    left, right = window_size
    if causal:
        right = 0
    if left == -1 and right == 0:
        return True, (-1, -1)
    return (False, (left, right)) if (left, right) != (-1, -1) else (causal, (-1, -1))


def _attention(
    fn: str,
    q,
    k,
    v,
    packed: Packed | None,
    causal,
    softmax_scale,
    return_lse,
    window_size,
    softcap,
    sinks,
    document_starts=None,
):
    """:func:`flash_attention`, or with packed :func:`flash_attention_varlen`, after their arguments."""
    q, k, v = runtime.autocast(q, k, v)
    _validate(q, k, v, fn, packed=packed is not None)
    softcap, sinks = validate_score_mods(softcap, sinks, q, fn)
    if packed is not None:
        _validate_sequences(q, k, packed)
    if document_starts is not None:
        validate_document_starts(document_starts, q, k, causal)
    causal, window = normalize_mask(causal, window_size, fn)
    scale = resolve_softmax_scale(softmax_scale, q.shape[-1], fn)
    sequences = (None, None, 0, 0)
    if packed is not None:
        cu_q, cu_k = packed.cu_seqlens_q.contiguous(), packed.cu_seqlens_k.contiguous()
        sequences = (cu_q, cu_k, packed.max_seqlen_q, packed.max_seqlen_k)
    if _runs_triton(q, fn):
        mask = (causal, window, None)
        if document_starts is not None:  # causal with each query's first key, the window's left edge in it
            mask = (True, (-1, -1), launch.document_first_keys(document_starts, window[0]))
        causal_mask, window_mask, first_keys = mask
        out, lse = _attn_fwd_op(
            q, k, v, sinks, softcap, causal_mask, scale, *window_mask, *sequences, first_keys
        )
    elif packed is None:
        out, lse = reference.attention(
            q,
            k,
            v,
            causal,
            scale,
            window_size=window,
            softcap=softcap,
            sinks=sinks,
            document_starts=document_starts,
        )
    else:
        out, lse = reference.attention_varlen(
            q, k, v, cu_q, cu_k, causal, scale, window_size=window, softcap=softcap, sinks=sinks
        )
    out = out.to(q.dtype)  # the reference's float32 back to q's dtype
    return (out, lse) if return_lse else out


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    document_starts: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact attention, FlashAttention-style, differentiable in q, k, v and sinks (and through lse).

    q: (batch, seqlen_q, heads, head_dim); k, v: (batch, seqlen_k, kv_heads, head_dim), heads a
    multiple of kv_heads; float16 or bfloat16 (float32 only on the CPU reference path); head_dim at
    most 512; any strides with a unit stride in the last dimension. causal masks to the
    bottom-right corner (query i sees keys j <= i + seqlen_k - seqlen_q; a query that sees none
    gets zeros). window_size (left, right) is a sliding window, as flash-attn's: query i sees keys
    i + seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q + right, -1 for an unbounded side;
    with causal the right side is 0. softmax_scale (> 0) defaults to 1 / sqrt(head_dim). Every argument
    after v is keyword-only: flash-attn's fourth positional argument is dropout_p, which this
    function does not take, so ``flash_attention(q, k, v, 0.1)`` raises rather than runs causal.

    softcap (flash-attn's): > 0 turns the scaled scores s into softcap · tanh(s / softcap) before the
    mask and the softmax (Gemma 2's 50); 0 leaves them. sinks (gpt-oss's s_aux): None, or a float32
    tensor (heads,) of learnable logits, one per query head, each adding exp(sinks[h]) to the softmax
    denominator of every row of head h (a sink attends to nothing: out = Σ_j exp(s_j) v_j / (Σ_j
    exp(s_j) + exp(sinks[h]))); lse includes it, and a row that sees no key gets zeros and lse = its
    sink. Both compose with causal, windows, GQA, the packed batch and the KV cache.

    document_starts (document masking of rows that pack several documents): None, or an int32 tensor
    (batch, seqlen) of each token's document's first column (document_starts[b, i] is i where a
    document begins, else document_starts[b, i - 1]), with causal=True and seqlen_k = seqlen_q: query
    i sees keys document_starts[b, i] to i, its document's up to itself (and within a window, if
    given). The dense kernels' grid, a program per query tile, whatever the documents; the values are
    trusted on a GPU (checked on the CPU). Composes with GQA, windows, softcap and sinks.

    Under torch.autocast the inputs are cast to its dtype first, as a matmul's would be.

    Returns out (batch, seqlen_q, heads, head_dim) in q's dtype, or (out, lse) with return_lse,
    lse (batch, heads, seqlen_q) float32 the natural log-sum-exp of each row's scaled scores.
    """
    return _attention(
        "flash_attention",
        q,
        k,
        v,
        None,
        causal,
        softmax_scale,
        return_lse,
        window_size,
        softcap,
        sinks,
        document_starts,
    )


def flash_attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`flash_attention` over a packed batch of variable-length sequences, flash-attn's varlen
    layout: no padding, each sequence attending only within itself.

    q: (total_q, heads, head_dim), k, v: (total_k, kv_heads, head_dim), the sequences one after
    another: sequence b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and its keys rows
    cu_seqlens_k[b]:cu_seqlens_k[b + 1] of k and v (int32, batch + 1 offsets rising from 0 to the
    total; a sequence may be empty). max_seqlen_q and max_seqlen_k bound the lengths: they size the
    launch without reading the offsets back from the device, so on a GPU the offsets and maxima are
    trusted, as flash-attn trusts them (on the CPU they are checked). causal, window_size,
    softmax_scale, softcap and sinks as in :func:`flash_attention`, per sequence (causal aligned to each one's
    bottom-right corner). Returns out like q, or (out, lse) with return_lse, lse (heads, total_q).
    """
    packed = Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attention(
        "flash_attention_varlen",
        q,
        k,
        v,
        packed,
        causal,
        softmax_scale,
        return_lse,
        window_size,
        softcap,
        sinks,
    )


def flash_attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: int | torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few new queries to a KV cache, appending the new keys and values to it in
    place first: flash-attn's ``flash_attn_with_kvcache``, for decoding.

    q: (batch, seqlen_q, heads, head_dim); k_cache, v_cache: (batch, seqlen_cache, kv_heads,
    head_dim), heads a multiple of kv_heads; cache_seqlens: the tokens already cached per sequence,
    an int or an int32 tensor (batch,) (None: the whole cache). k, v (batch, seqlen_new, kv_heads,
    head_dim), both or neither, are written to the caches at positions cache_seqlens[b] ..
    cache_seqlens[b] + seqlen_new - 1; sequence b then attends to its first cache_seqlens[b] +
    seqlen_new keys. causal and window_size align to each sequence's bottom-right corner, as in
    :func:`flash_attention`: query i is at position i + seqlen_k - seqlen_q, so the new tokens see
    the cache and the new tokens before them; softcap and sinks as there (the sinks join in the
    reduce of the splits). float16 or bfloat16 (float32 only on the CPU reference
    path), the caches in q's dtype; a unit stride in the last dimension. The keys are split among
    programs (two per SM) and a GQA group's query heads share one tile; a second pass reduces the
    splits. The lengths are trusted on a GPU (checked on the CPU). Returns out like q.
    """
    fn = "flash_attention_with_kvcache"
    q = runtime.autocast(q)[0]
    _validate(q, k_cache, v_cache, fn, packed=False)
    softcap, sinks = validate_score_mods(softcap, sinks, q, fn)
    batch, seqlen_q, _, head_dim = q.shape
    seqlen_cache = k_cache.shape[1]
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together (the new keys and values), or neither")
    seqlen_new = 0
    if k is not None:
        k, v = (t.to(q.dtype) for t in (k, v))
        seqlen_new = k.shape[1]
        if k.dim() != 4 or k.shape != v.shape or k.shape[0] != batch or k.shape[2:] != k_cache.shape[2:]:
            raise ValueError(
                f"{fn}: k and v must be (batch, seqlen_new, kv_heads, head_dim) = ({batch}, *, "
                f"{k_cache.shape[2]}, {head_dim}), got {list(k.shape)} and {list(v.shape)}"
            )
    if cache_seqlens is None:
        cache_seqlens = seqlen_cache - seqlen_new
    is_int = isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool)
    if not is_int:
        if not isinstance(cache_seqlens, torch.Tensor):
            raise ValueError(f"{fn}: cache_seqlens must be an int or an int32 tensor, got {cache_seqlens!r}")
        if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (batch,):
            raise ValueError(
                f"{fn}: cache_seqlens must be an int or an int32 tensor ({batch},), got "
                f"{cache_seqlens.dtype} of shape {list(cache_seqlens.shape)}"
            )
        if cache_seqlens.device != q.device:
            raise ValueError(f"{fn}: cache_seqlens is on {cache_seqlens.device} but q is on {q.device}")
    # A tensor's lengths are read only on the CPU in eager mode: no wait for the GPU, no graph break.
    if is_int or (q.device.type == "cpu" and not torch.compiler.is_compiling()):
        values = [cache_seqlens] if is_int else cache_seqlens.tolist()
        if not all(0 <= n <= seqlen_cache - seqlen_new for n in values):
            raise ValueError(
                f"{fn}: cache_seqlens + seqlen_new must lie in [0, {seqlen_cache}] (the cache's length), "
                f"got cache_seqlens {cache_seqlens if is_int else values} and seqlen_new {seqlen_new}"
            )
    lengths = cache_seqlens
    if is_int:
        lengths = torch.full((batch,), cache_seqlens, dtype=torch.int32, device=q.device)
    causal, window = normalize_mask(causal, window_size, fn)
    scale = resolve_softmax_scale(softmax_scale, head_dim, fn)
    if k is not None:
        if is_int:
            k_cache[:, cache_seqlens : cache_seqlens + seqlen_new] = k
            v_cache[:, cache_seqlens : cache_seqlens + seqlen_new] = v
        else:  # each sequence's rows at its own length: one scatter per cache
            rows = (lengths[:, None] + torch.arange(seqlen_new, device=q.device)).long()  # (batch, new)
            sequences = torch.arange(batch, device=q.device)[:, None]
            k_cache[sequences, rows] = k
            v_cache[sequences, rows] = v
        lengths = lengths + seqlen_new
    if _runs_triton(q, fn, "q and the caches"):
        if seqlen_q > DECODE_MAX_SEQLEN_Q and is_int:  # a prompt: the prefill kernel
            end = cache_seqlens + seqlen_new
            cache = (k_cache[:, :end], v_cache[:, :end])
            return attention_fwd(q, *cache, causal, scale, window, None, softcap or None, sinks)[0]
        return launch.attention_decode(
            q, k_cache, v_cache, lengths, causal, scale, window, softcap or None, sinks
        )
    out = reference.attention_kvcache(q, k_cache, v_cache, lengths, causal, scale, window, softcap, sinks)
    return out.to(q.dtype)
