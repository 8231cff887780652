"""The attention passes as PyTorch custom ops (``torch.ops.horse.flash_attn_fwd`` and
``flash_attn_bwd``), the forward's autograd calling the backward's op.
"""

import torch

from horse.kernels import runtime
from horse.kernels.attention.launch import Packed, attention_bwd, attention_fwd


def _packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Packed | None:
    return None if cu_seqlens_q is None else Packed(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)


def _softcap(softcap: float) -> float | None:
    """The launchers' softcap: None when off (0), so that the kernels compile without its code."""
    return softcap if softcap > 0 else None


def _attn_fwd_fake(
    q, k, v, sinks, softcap, causal, softmax_scale, window_left, window_right, cu_seqlens_q, *_
):
    lse_shape = (q.shape[0], q.shape[2], q.shape[1]) if cu_seqlens_q is None else (q.shape[1], q.shape[0])
    return q.new_empty(q.shape), q.new_empty(lse_shape, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, softcap, causal, softmax_scale, window_left, window_right, *sequences = inputs[:13]
    cu_q, cu_k, max_q, max_k = sequences
    first_keys = inputs[13] if len(inputs) > 13 else None  # the dispatcher drops a default
    # O(seqlen) tensors only (q, k, v, out, lse): the scores are recomputed in the backward, never saved.
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, sinks, first_keys)
    ctx.mask_args = (causal, softmax_scale, window_left, window_right)
    ctx.max_seqlens = (max_q, max_k)
    ctx.softcap = softcap


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k, sinks, first_keys = ctx.saved_tensors
    # dq, dk with dv (one pass) and dsinks, only where an input wants them (frozen inputs launch nothing).
    needs_dq, needs_dk, needs_dv, needs_dsinks = ctx.needs_input_grad[:4]
    needs = [needs_dq, needs_dk or needs_dv, needs_dsinks]
    sequences = (cu_q, cu_k, *ctx.max_seqlens)
    grads = _attn_bwd_op(
        dout, dlse, q, k, v, out, lse, sinks, ctx.softcap, *ctx.mask_args, *sequences, needs, first_keys
    )
    wanted = (needs_dq, needs_dk, needs_dv, needs_dsinks)
    return *(g if need else None for g, need in zip(grads, wanted, strict=True)), *[None] * 10


# The arguments both ops take after their tensors, in torch's schema language: the sinks (or None)
# and the softcap (0: off), the mask and the packed batch's sequences (None and 0 when not packed) as
# plain values, which custom ops take. Both end with document masking's first keys (None: off).
_MASK_AND_SEQUENCES = (
    "Tensor? sinks, float softcap, bool causal, float softmax_scale, SymInt window_left, "
    "SymInt window_right, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, SymInt max_seqlen_q, "
    "SymInt max_seqlen_k"
)
_FWD_SCHEMA = (
    f"(Tensor q, Tensor k, Tensor v, {_MASK_AND_SEQUENCES}, Tensor? first_keys=None) -> (Tensor, Tensor)"
)
_BWD_SCHEMA = (
    "(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
    f"{_MASK_AND_SEQUENCES}, bool[] needs, Tensor? first_keys=None) -> (Tensor, Tensor, Tensor, Tensor)"
)


@runtime.custom_op("flash_attn_fwd", _attn_fwd_fake, _backward, _setup_context, schema=_FWD_SCHEMA)
def _attn_fwd_op(q, k, v, sinks, softcap, causal, softmax_scale, window_left, window_right, *rest):
    *sequences, first_keys = rest if len(rest) == 5 else (*rest, None)  # the dispatcher drops a default
    window = (window_left, window_right)
    return attention_fwd(
        q, k, v, causal, softmax_scale, window, _packed(*sequences), _softcap(softcap), sinks, first_keys
    )


def _attn_bwd_fake(dout, dlse, q, k, v, out, lse, sinks, *args):
    needs_dq, needs_dkdv, needs_dsinks = args[9]  # after softcap, the mask and the sequences
    grads = tuple(
        t.new_empty(t.shape if need else (0,))
        for t, need in zip((q, k, v), (needs_dq, needs_dkdv, needs_dkdv), strict=True)
    )
    return *grads, q.new_empty(sinks.shape if needs_dsinks else (0,), dtype=torch.float32)


@runtime.custom_op("flash_attn_bwd", _attn_bwd_fake, schema=_BWD_SCHEMA)
def _attn_bwd_op(dout, dlse, q, k, v, out, lse, sinks, softcap, causal, softmax_scale, *rest):
    window_left, window_right, cu_q, cu_k, max_q, max_k, needs, *documents = rest
    sequences = (cu_q, cu_k, max_q, max_k)
    first_keys = documents[0] if documents else None  # the dispatcher drops a default
    window = (window_left, window_right)
    packed = _packed(*sequences)
    return attention_bwd(
        dout,
        dlse,
        q,
        k,
        v,
        out,
        lse,
        causal,
        softmax_scale,
        window,
        packed,
        needs,
        _softcap(softcap),
        sinks,
        first_keys,
    )
