"""Plain-PyTorch references for every kernel in the package, computed in float32.

They are the truth the tests compare against and the eager baselines the benchmarks time. Each
takes the same arguments as its kernel and returns float32 (float64 for float64 inputs, which the
tests use for the truth); a residual sum comes back in the input's dtype, as the kernels return it.
"""

import itertools

import torch


def _upcast(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float64 else t.float()


def _affine(y: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    if weight is not None:
        y = y * _upcast(weight)
    if bias is not None:
        y = y + _upcast(bias)
    return y


def _flat_dims(normalized_shape) -> tuple[int, ...]:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return tuple(range(-n, 0))


def residual_add(x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """h = x + residual, summed in float32 and rounded to x's dtype."""
    return (x.float() + residual.float()).to(x.dtype)


def layer_norm(x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm over the trailing ``normalized_shape`` dims (biased variance)."""
    dims = _flat_dims(normalized_shape)
    x = _upcast(x)
    mean = x.mean(dim=dims, keepdim=True)
    var = (x - mean).square().mean(dim=dims, keepdim=True)
    return _affine((x - mean) * torch.rsqrt(var + eps), weight, bias)


def rms_norm(x, normalized_shape, weight=None, eps: float | None = None, weight_offset: float = 0.0):
    """RMSNorm over the trailing ``normalized_shape`` dims; eps=None is float32's eps. The scale is
    ``weight_offset + weight`` (Gemma's RMSNorm: 1 + weight), added in float32."""
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    dims = _flat_dims(normalized_shape)
    x = _upcast(x)
    if weight_offset != 0.0:
        weight = _upcast(weight) + weight_offset
    return _affine(x * torch.rsqrt(x.square().mean(dim=dims, keepdim=True) + eps), weight, None)


def add_layer_norm(x, residual, normalized_shape, weight=None, bias=None, eps: float = 1e-5):
    """(layer_norm(h), h) with h = x + residual in x's dtype."""
    h = residual_add(x, residual)
    return layer_norm(h, normalized_shape, weight, bias, eps), h


def add_rms_norm(x, residual, normalized_shape, weight=None, eps: float | None = None, weight_offset=0.0):
    """(rms_norm(h), h) with h = x + residual in x's dtype."""
    h = residual_add(x, residual)
    return rms_norm(h, normalized_shape, weight, eps, weight_offset), h


def attention(
    q,
    k,
    v,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,
):
    """Explicit-softmax attention in float32 (float64 for float64 inputs): (out, lse).

    Layout (batch, seqlen, heads, head_dim); k and v may have fewer heads (grouped-query). causal
    is aligned to the bottom-right corner; window_size (left, right) limits query i to keys
    i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right (-1: unbounded); a query that
    sees no key gets zeros and lse = -inf. softcap > 0 turns the scaled scores s into softcap ·
    tanh(s / softcap) before the mask; sinks (heads,) add exp(sinks[h]) to each row's softmax
    denominator of head h (a key of value 0 every row sees: lse includes it, a row with no key gets
    zeros and lse = its sink).
    With upcast=False it computes in the inputs' dtype instead, rounding the scores and the
    probabilities as a fused kernel does: PyTorch's own error at that precision, for the tests.
    """
    if upcast:
        q, k, v = _upcast(q), _upcast(k), _upcast(v)
    heads, kv_heads, head_dim = q.shape[2], k.shape[2], q.shape[3]
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    left, right = window_size
    if causal:
        right = 0
    if left >= 0 or right >= 0:
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        diagonal = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
        cols = torch.arange(seqlen_k, device=q.device)[None, :]
        hidden = torch.zeros(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
        if right >= 0:
            hidden |= cols > diagonal + right
        if left >= 0:
            hidden |= cols < diagonal - left
        scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:  # the sink's column: every row's lse finite, a row without keys no NaN
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
        lse = torch.logsumexp(torch.cat([scores, sink], dim=-1), dim=-1, keepdim=True)
        return torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse), v), lse.squeeze(-1)
    # A row with no visible key would give -inf - -inf = NaN, in the values and in the gradients:
    # give it finite dummy scores, then zero its probabilities and set its lse to -inf.
    has_key = (scores > float("-inf")).any(dim=-1, keepdim=True)
    scores = torch.where(has_key, scores, 0.0)
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    probs = torch.exp(scores - lse) * has_key
    lse = torch.where(has_key, lse, float("-inf")).squeeze(-1)  # (batch, heads, seqlen_q)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v), lse


def attention_kvcache(
    q,
    k_cache,
    v_cache,
    seqlens_k,
    causal=False,
    softmax_scale=None,
    window_size=(-1, -1),
    softcap=0.0,
    sinks=None,
):
    """:func:`attention` of each sequence b of q (batch, seqlen_q, heads, head_dim) to the first
    seqlens_k[b] keys of the caches (batch, seqlen_cache, kv_heads, head_dim): out only."""
    outs = [
        attention(q[b : b + 1], k_cache[b : b + 1, :n], v_cache[b : b + 1, :n], causal, softmax_scale,
                  window_size=window_size, softcap=softcap, sinks=sinks)[0]
        for b, n in enumerate(torch.as_tensor(seqlens_k).tolist())
    ]  # fmt: skip
    return torch.cat(outs)


def attention_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,
):
    """:func:`attention` of each sequence of a packed batch: q (total_q, heads, head_dim), k, v
    (total_k, kv_heads, head_dim), sequence b in rows cu_seqlens[b]:cu_seqlens[b + 1]. Returns out
    (total_q, heads, head_dim) and lse (heads, total_q)."""
    outs, lses = [], []
    bounds = zip(
        itertools.pairwise(cu_seqlens_q.tolist()), itertools.pairwise(cu_seqlens_k.tolist()), strict=True
    )
    for (q0, q1), (k0, k1) in bounds:
        out, lse = attention(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            causal,
            softmax_scale,
            upcast,
            window_size,
            softcap,
            sinks,
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


def apply_activation(z: torch.Tensor, activation: str) -> torch.Tensor:
    """The MLP activations by name: none, relu, relu2 (relu squared), gelu (erf), gelu_tanh, silu."""
    if activation == "none":
        return z
    if activation == "relu":
        return torch.relu(z)
    if activation == "relu2":
        return torch.relu(z).square()
    if activation == "gelu":
        return torch.nn.functional.gelu(z)
    if activation == "gelu_tanh":
        return torch.nn.functional.gelu(z, approximate="tanh")
    if activation == "silu":
        return torch.nn.functional.silu(z)
    raise ValueError(f"unknown activation {activation!r}")


def linear_act(x, weight, bias=None, *, activation: str) -> torch.Tensor:
    """act(x Wᵀ + b), W as nn.Linear's (out_features, in_features)."""
    bias = None if bias is None else _upcast(bias)
    return apply_activation(torch.nn.functional.linear(_upcast(x), _upcast(weight), bias), activation)


def gated_linear(x, w_gate, w_up, *, activation: str) -> torch.Tensor:
    """act(x W_gateᵀ) ⊙ (x W_upᵀ): SwiGLU with silu, GeGLU with gelu."""
    x = _upcast(x)
    gate = torch.nn.functional.linear(x, _upcast(w_gate))
    return apply_activation(gate, activation) * torch.nn.functional.linear(x, _upcast(w_up))


def fused_mlp(x, w_in, b_in, w_out, b_out, *, activation: str) -> torch.Tensor:
    """The GPT-2 MLP: act(x W_inᵀ + b_in) W_outᵀ + b_out."""
    return linear_act(linear_act(x, w_in, b_in, activation=activation), w_out, b_out, activation="none")


def fused_gated_mlp(x, w_gate, w_up, w_down, *, activation: str) -> torch.Tensor:
    """The LLaMA MLP: (act(x W_gateᵀ) ⊙ (x W_upᵀ)) W_downᵀ."""
    h = gated_linear(x, w_gate, w_up, activation=activation)
    return linear_act(h, w_down, None, activation="none")


def cross_entropy(
    logits,
    target,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
) -> torch.Tensor:
    """``F.cross_entropy`` of logits (..., V) flattened to rows, against target (...), plus
    ``z_loss · logsumexp²`` per row; with softcap, of ``softcap · tanh(logits / softcap)``. A mean over
    no rows (all ignored) is NaN, as F.cross_entropy's (horse.kernels.linear_cross_entropy's is 0)."""
    z = _upcast(logits).reshape(-1, logits.shape[-1])
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    t = target.reshape(-1)
    valid = t != ignore_index
    rows = torch.nn.functional.cross_entropy(
        z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    if z_loss:
        rows = rows + torch.where(valid, z_loss * torch.logsumexp(z, dim=-1).square(), 0.0)
    if reduction == "none":
        return rows.view(target.shape)
    if reduction == "sum":
        return rows.sum()
    return rows.sum() / valid.sum()


def linear_cross_entropy(x, weight, target, bias=None, **options) -> torch.Tensor:
    """:func:`cross_entropy` of the logits x Wᵀ + b, with them materialised (the truth of the fused op)."""
    bias = None if bias is None else _upcast(bias)
    return cross_entropy(torch.nn.functional.linear(_upcast(x), _upcast(weight), bias), target, **options)


GPT_OSS_SWIGLU_ALPHA = 1.702  # transformers' GptOssConfig.swiglu_alpha


def moe_glu(
    gate: torch.Tensor, up: torch.Tensor, activation: str, limit: float | None = None
) -> torch.Tensor:
    """act(gate) · up of an expert: SwiGLU ("silu"), GeGLU ("gelu_tanh"), or with limit gpt-oss's
    clamped SwiGLU, (clamp(up, ±limit) + 1) · g · sigmoid(1.702 g), g = min(gate, limit)."""
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * GPT_OSS_SWIGLU_ALPHA)
    return apply_activation(gate, activation) * up


def moe_mlp(
    x,
    expert_ids,
    expert_weights,
    gate_up_proj,
    down_proj,
    *,
    activation: str,
    gate_up_bias=None,
    down_bias=None,
    limit: float | None = None,
    gate_up_interleaved: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """The routed experts as a loop over experts (horse.kernels.moe_mlp's arguments), in float32
    (float64 for float64 inputs). With upcast=False it computes in the inputs' dtype instead, as
    transformers' eager loop does (each product rounded, the weighted rows added to the output in
    that dtype): PyTorch's own error at that precision, for the tests."""
    cast = _upcast if upcast else (lambda t: t)
    x, gate_up_proj, down_proj = cast(x), cast(gate_up_proj), cast(down_proj)
    expert_weights = cast(expert_weights).to(x.dtype)
    out = torch.zeros_like(x)
    inter = gate_up_proj.shape[1] // 2
    for expert in range(gate_up_proj.shape[0]):
        token, k = torch.where(expert_ids == expert)
        gate_up = torch.nn.functional.linear(x[token], gate_up_proj[expert])
        if gate_up_bias is not None:
            gate_up = gate_up + cast(gate_up_bias[expert])
        if gate_up_interleaved:
            gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
        else:
            gate, up = gate_up[:, :inter], gate_up[:, inter:]
        rows = torch.nn.functional.linear(moe_glu(gate, up, activation, limit), down_proj[expert])
        if down_bias is not None:
            rows = rows + cast(down_bias[expert])
        out = out.index_add(0, token, rows * expert_weights[token, k, None])
    return out
