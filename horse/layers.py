"""Drop-in fused layers: same constructors, parameter names and state dicts as the modules they replace.

The norms subclass ``torch.nn.LayerNorm`` and ``torch.nn.RMSNorm``, so a state dict loads either way,
``isinstance`` checks still hold, and :func:`replace_norms` swaps a whole model in one line.
:class:`FusedMLP` keeps the GPT-2 or the LLaMA MLP's submodule names, so their state dicts load, and
:class:`FusedMoE` those of transformers' sparse MoE blocks (Qwen3-MoE, Mixtral, OLMoE). Where
they run follows ``horse.kernels.runtime``: Triton kernels on CUDA tensors, the float32 reference on CPU
tensors unless ``TRITON_INTERPRET=1`` was set before triton was imported.
"""

import torch
from torch import nn

from horse import kernels


class FusedLayerNorm(nn.LayerNorm):
    """``torch.nn.LayerNorm`` on the Triton LayerNorm kernel."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return kernels.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def forward_residual(
        self, input: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = input + residual`` and ``self(h)`` in one kernel; returns ``(self(h), h)``."""
        return kernels.add_layer_norm(
            input, residual, self.normalized_shape, self.weight, self.bias, self.eps
        )


class FusedRMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` on the Triton RMSNorm kernel (``eps=None`` is float32's eps, as torch).

    weight_offset (keyword only): the scale is ``weight_offset + weight``, added and multiplied in float32
    before the cast to the input's dtype (Gemma's RMSNorm: 1.0); the weight starts at ``1 - weight_offset``,
    so the scale starts at 1 (Gemma's zeros). It needs elementwise_affine.
    """

    def __init__(
        self,
        normalized_shape: int | list[int] | torch.Size,
        eps: float | None = None,
        elementwise_affine: bool = True,
        device=None,
        dtype=None,
        *,
        weight_offset: float = 0.0,
    ) -> None:
        if weight_offset != 0.0 and not elementwise_affine:
            raise ValueError(f"FusedRMSNorm: weight_offset {weight_offset} needs elementwise_affine=True")
        self.weight_offset = weight_offset  # before nn.RMSNorm's __init__, whose reset_parameters reads it
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.constant_(self.weight, 1.0 - self.weight_offset)

    def extra_repr(self) -> str:
        offset = f", weight_offset={self.weight_offset}" if self.weight_offset != 0.0 else ""
        return super().extra_repr() + offset

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(
            input, self.normalized_shape, self.weight, self.eps, weight_offset=self.weight_offset
        )

    def forward_residual(
        self, input: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``h = input + residual`` and ``self(h)`` in one kernel; returns ``(self(h), h)``."""
        return kernels.add_rms_norm(
            input, residual, self.normalized_shape, self.weight, self.eps, weight_offset=self.weight_offset
        )


def _fused_copy(norm: nn.Module) -> nn.Module:
    # Built on the meta device, then handed the original Parameters: no copy, and an optimizer
    # that already holds them keeps working.
    if isinstance(norm, nn.LayerNorm):
        fused = FusedLayerNorm(
            norm.normalized_shape,
            norm.eps,
            norm.elementwise_affine,
            bias=norm.bias is not None,
            device="meta",
        )
    else:
        fused = FusedRMSNorm(norm.normalized_shape, norm.eps, norm.elementwise_affine, device="meta")
    for name, param in norm.named_parameters(recurse=False):
        setattr(fused, name, param)
    fused.train(norm.training)
    return fused


def replace_norms(model: nn.Module) -> nn.Module:
    """Replace every ``nn.LayerNorm`` and ``nn.RMSNorm`` in ``model`` (in place) by its fused twin.

    The fused modules share the original parameters, so state dicts, optimizers and weight tying
    carry over. Returns ``model``; a bare norm passed in is returned as its fused replacement.
    """
    if _replaceable(model):
        return _fused_copy(model)
    for name, child in model.named_children():
        if _replaceable(child):
            setattr(model, name, _fused_copy(child))
        else:
            replace_norms(child)
    return model


def _replaceable(module: nn.Module) -> bool:
    return type(module) in (nn.LayerNorm, nn.RMSNorm)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form, as GPT-NeoX and LLaMA) on (batch, seqlen, heads,
    head_dim) tensors, or (tokens, heads, head_dim) ones with a position per token, for positions
    below max_seqlen. The tables are float32 buffers, not saved, and the rotation runs in float32
    whatever the input's dtype (the result is cast back to it)."""

    def __init__(self, head_dim: int, max_seqlen: int, base: float = 10000.0, device=None):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be even, got {head_dim}")
        inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        angles = torch.outer(torch.arange(max_seqlen, device=device, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # (max_seqlen, head_dim)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(
        self, x: torch.Tensor, offset: int = 0, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x (batch, seqlen, heads, head_dim) at positions offset .. offset + seqlen - 1, or x
        (tokens, heads, head_dim) at ``positions`` (tokens,), each below max_seqlen."""
        if positions is None:
            end = offset + x.shape[1]
            if end > self.cos.shape[0]:
                raise ValueError(
                    f"RotaryEmbedding: position {end - 1} is past max_seqlen {self.cos.shape[0]}"
                )
            positions = slice(offset, end)
        cos, sin = self.cos[positions, None, :], self.sin[positions, None, :]  # (seqlen, 1, head_dim)
        x32 = x.float()
        half = x.shape[-1] // 2
        rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)  # pairs (i, i + head_dim / 2)
        return (x32 * cos + rotated * sin).to(x.dtype)


class FusedSelfAttention(nn.Module):
    """The attention block of a GPT-style model on the flash-attention kernel.

    ``c_attn`` projects (batch, seqlen, d_model) to q, k and v at once (n_heads + 2 n_kv_heads heads
    of d_model / n_heads), optional rotary embeddings (positions below max_seqlen) turn q and k,
    ``horse.kernels.flash_attention`` attends (causal by default, window_size (left, right) a sliding window
    as in flash-attn, -1 unbounded; k and v shared by groups of n_heads / n_kv_heads query heads),
    and ``c_proj`` projects back. Parameter names follow GPT-2
    (nanoGPT's nn.Linear layout), and a state dict with separate ``q_proj``, ``k_proj``, ``v_proj``
    and ``o_proj`` (LLaMA) loads too, fused on the way in.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        bias: bool = True,
        causal: bool = True,
        window_size: tuple[int, int] = (-1, -1),
        rotary: bool = False,
        max_seqlen: int = 4096,
        rope_base: float = 10000.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if d_model % n_heads:
            raise ValueError(
                f"FusedSelfAttention: d_model ({d_model}) must be a multiple of n_heads ({n_heads})"
            )
        if n_heads % n_kv_heads:
            raise ValueError(
                f"FusedSelfAttention: n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        # A bad window fails here, not at the first call.
        kernels.attention.normalize_mask(causal, window_size, "FusedSelfAttention")
        self.causal, self.window_size = causal, tuple(window_size)
        factory = {"device": device, "dtype": dtype}
        self.c_attn = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias, **factory)
        self.c_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=bias, **factory)
        self.rotary = RotaryEmbedding(self.head_dim, max_seqlen, rope_base, device) if rotary else None
        self.register_load_state_dict_pre_hook(_fuse_separate_projections)

    def forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None, max_seqlen: int | None = None
    ) -> torch.Tensor:
        """x (batch, seqlen, d_model); or, with cu_seqlens (int32 offsets, one more than the
        documents) and max_seqlen (the longest document), a packed (total_tokens, d_model) batch of
        documents that attend only within themselves, rotary positions restarting at each."""
        if cu_seqlens is not None:
            return self._packed_forward(x, cu_seqlens, max_seqlen)
        q, k, v = self.qkv(x)
        # (batch, seqlen, n_heads, head_dim)
        y = kernels.flash_attention(q, k, v, causal=self.causal, window_size=self.window_size)
        return self.c_proj(y.flatten(2))

    def qkv(self, x: torch.Tensor, **position) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (..., n_heads, head_dim), k and v (..., n_kv_heads, head_dim): strided views of c_attn(x),
        q and k rotated (``position``: RotaryEmbedding's offset or positions). x (..., d_model)."""
        qkv = self.c_attn(x)
        qkv = qkv.view(*qkv.shape[:-1], self.n_heads + 2 * self.n_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)
        if self.rotary is not None:
            q, k = self.rotary(q, **position), self.rotary(k, **position)
        return q, k, v

    def _packed_forward(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int | None
    ) -> torch.Tensor:
        if x.dim() != 2 or max_seqlen is None:
            raise ValueError(
                "FusedSelfAttention: with cu_seqlens, x must be packed (total_tokens, d_model) and "
                f"max_seqlen given, got x of shape {list(x.shape)} and max_seqlen {max_seqlen}"
            )
        positions = None
        if self.rotary is not None:
            # Each token's position in its document, without reading the offsets back from the GPU.
            rows = torch.arange(x.shape[0], device=x.device)
            document = torch.searchsorted(cu_seqlens[1:], rows.to(cu_seqlens.dtype), right=True)
            positions = rows - cu_seqlens[document]
        q, k, v = self.qkv(x, positions=positions)  # (tokens, heads, head_dim)
        y = kernels.flash_attention_varlen(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_seqlen,
            max_seqlen,
            causal=self.causal,
            window_size=self.window_size,
        )
        return self.c_proj(y.flatten(1))


def _fuse_separate_projections(module, state_dict, prefix, *args):
    """load_state_dict pre-hook: q_proj/k_proj/v_proj/o_proj (LLaMA layout) -> c_attn/c_proj."""
    names = [f"{prefix}{p}_proj" for p in "qkv"]
    if f"{names[0]}.weight" not in state_dict:
        return
    for kind in ("weight", "bias"):
        if f"{names[0]}.{kind}" in state_dict:
            state_dict[f"{prefix}c_attn.{kind}"] = torch.cat([state_dict.pop(f"{n}.{kind}") for n in names])
        if f"{prefix}o_proj.{kind}" in state_dict:
            state_dict[f"{prefix}c_proj.{kind}"] = state_dict.pop(f"{prefix}o_proj.{kind}")


class FusedMLP(nn.Module):
    """The transformer MLP on the fused GEMM kernels, with the parameter names of the MLP it replaces.

    ``gated=False``, GPT-2 (nanoGPT's nn.Linear layout): ``c_proj(act(c_fc(x)))`` with ``c_fc``
    d_model → hidden and ``c_proj`` hidden → d_model, biases unless ``bias=False``; activation
    defaults to gelu_tanh, GPT-2's (nanoGPT's nn.GELU() is ``activation="gelu"``).
    ``gated=True``, LLaMA: ``down_proj(act(gate_proj(x)) * up_proj(x))``, no biases; activation
    defaults to silu (SwiGLU). Any of ``horse.kernels.mlp.ACTIVATIONS`` goes.

    The submodules are plain ``nn.Linear``, so either layout's state dict loads as it is, and this
    module's loads back into the original. Runs ``horse.kernels.fused_mlp`` /
    ``horse.kernels.fused_gated_mlp``: float16 or bfloat16 (float32 only on the CPU reference path); no
    dropout.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        *,
        gated: bool = False,
        activation: str | None = None,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        activation = activation or ("silu" if gated else "gelu_tanh")
        if activation not in kernels.mlp.ACTIVATIONS:
            expected = ", ".join(kernels.mlp.ACTIVATIONS)
            raise ValueError(f"FusedMLP: unknown activation {activation!r}; expected one of {expected}")
        self.gated, self.activation = gated, activation
        factory = {"device": device, "dtype": dtype}
        if gated:
            if bias:
                raise ValueError("FusedMLP: the gated (LLaMA) MLP has no biases; pass bias=False")
            self.gate_proj = nn.Linear(d_model, hidden, bias=False, **factory)
            self.up_proj = nn.Linear(d_model, hidden, bias=False, **factory)
            self.down_proj = nn.Linear(hidden, d_model, bias=False, **factory)
        else:
            self.c_fc = nn.Linear(d_model, hidden, bias=bias, **factory)
            self.c_proj = nn.Linear(hidden, d_model, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
            return kernels.fused_gated_mlp(x, *weights, activation=self.activation)
        fc, proj = self.c_fc, self.c_proj
        return kernels.fused_mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, activation=self.activation)

    def extra_repr(self) -> str:
        return f"gated={self.gated}, activation={self.activation!r}"


ROUTERS = ("softmax", "sigmoid")


class MoERouter(nn.Module):
    """The router of a mixture-of-experts block: logits = x Wᵀ (W (experts, hidden), no bias), then the
    top_k experts by softmax or sigmoid score, their scores renormalised to sum to 1 if
    ``normalize``. Its forward returns (logits, weights, ids): logits (tokens, experts) in x's dtype,
    weights (tokens, top_k) float32, ids (tokens, top_k) int64, as transformers' top-k routers."""

    def __init__(
        self, hidden: int, experts: int, top_k: int, *, scoring: str, normalize: bool, device=None, dtype=None
    ):
        super().__init__()
        self.top_k, self.scoring, self.normalize = top_k, scoring, normalize
        self.weight = nn.Parameter(torch.empty(experts, hidden, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)  # nn.Linear's

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x, self.weight)
        scores = logits.float().softmax(-1) if self.scoring == "softmax" else logits.float().sigmoid()
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights, ids


class MoEExperts(nn.Module):
    """The experts of a mixture-of-experts block, stacked as transformers 5.25 stores them: gate_up_proj
    (experts, 2·inter, hidden), gate rows first, and down_proj (experts, hidden, inter)."""

    def __init__(self, hidden: int, inter: int, experts: int, *, activation: str, device=None, dtype=None):
        super().__init__()
        self.activation = activation
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden, **factory))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter, **factory))
        for weight in (self.gate_up_proj, self.down_proj):
            bound = weight.shape[-1] ** -0.5  # nn.Linear's, an expert's fan_in
            nn.init.uniform_(weight, -bound, bound)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return kernels.moe_mlp(x, ids, weights, self.gate_up_proj, self.down_proj, activation=self.activation)


class FusedMoE(nn.Module):
    """A mixture-of-experts MLP block on ``horse.kernels.moe_mlp``, with transformers' parameter names
    (``gate.weight``, ``experts.gate_up_proj``, ``experts.down_proj``), so the sparse MoE blocks of
    Qwen3-MoE, Mixtral and OLMoE load as they are and load back (Qwen2-MoE's shared expert is not
    part of it).

    Each token goes to its top_k experts by router score, ``router`` "softmax" (Qwen3-MoE, Mixtral,
    OLMoE) or "sigmoid"; ``normalize`` renormalises the top_k scores to sum to 1 (Mixtral: always;
    Qwen3-MoE and OLMoE: their config's norm_topk_prob). The experts are SwiGLU (``activation``
    "silu") or GeGLU ("gelu_tanh"). forward(x (..., hidden)) returns (y (..., hidden), router_logits
    (tokens, experts)): the logits are what :func:`load_balancing_loss` takes, as transformers'
    ``output_router_logits`` gives them. float16 or bfloat16 (float32 only on the CPU reference path).
    """

    def __init__(
        self,
        hidden: int,
        inter: int,
        experts: int,
        top_k: int,
        *,
        router: str = "softmax",
        normalize: bool = True,
        activation: str = "silu",
        device=None,
        dtype=None,
    ):
        super().__init__()
        if router not in ROUTERS:
            raise ValueError(f"FusedMoE: unknown router {router!r}; expected one of {', '.join(ROUTERS)}")
        if activation not in kernels.moe.ACTIVATIONS:
            expected = ", ".join(kernels.moe.ACTIVATIONS)
            raise ValueError(f"FusedMoE: unknown activation {activation!r}; expected one of {expected}")
        if not 1 <= top_k <= experts:
            raise ValueError(f"FusedMoE: top_k must be 1 to experts ({experts}), got {top_k}")
        factory = {"device": device, "dtype": dtype}
        self.gate = MoERouter(hidden, experts, top_k, scoring=router, normalize=normalize, **factory)
        self.experts = MoEExperts(hidden, inter, experts, activation=activation, **factory)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = x.reshape(-1, x.shape[-1])  # (tokens, hidden)
        router_logits, weights, ids = self.gate(tokens)
        y = self.experts(tokens, ids, weights)  # (tokens, hidden)
        return y.view(x.shape), router_logits

    def extra_repr(self) -> str:
        gate = self.gate
        return f"top_k={gate.top_k}, router={gate.scoring!r}, normalize={gate.normalize}"


def load_balancing_loss(
    router_logits, experts: int, top_k: int, attention_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """The load-balancing auxiliary loss (Switch Transformer's) over a model's MoE layers, as
    transformers 5.25 computes it (``load_balancing_loss_func``): experts · Σ_e f_e · P_e, f_e the
    share of the top_k choices that went to expert e and P_e its mean softmax probability, both
    taken over every layer's tokens together (not a sum of per-layer losses), and over the tokens
    attention_mask (batch, seqlen) keeps. router_logits: one (tokens, experts) tensor a layer."""
    layers = tuple(router_logits)
    keep = None if attention_mask is None else attention_mask.reshape(-1, 1).float()
    choices = torch.zeros(experts, dtype=torch.float32, device=layers[0].device)
    probability = torch.zeros(experts, dtype=torch.float32, device=layers[0].device)
    rows = 0.0
    for logits in layers:
        probs = logits.float().softmax(-1)  # (tokens, experts)
        chosen = nn.functional.one_hot(probs.topk(top_k, dim=-1).indices, experts).sum(1).float()
        if keep is not None:
            probs, chosen = probs * keep, chosen * keep
        choices = choices + chosen.sum(0)
        probability = probability + probs.sum(0)
        rows = rows + (probs.shape[0] if keep is None else keep.sum())
    return experts * torch.sum((choices / rows) * (probability / rows))
