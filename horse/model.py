"""The GPT model, nanoGPT-shaped, on the drop-in layers of ``horse.layers``.

    logits = norm_f(blocks(embed(idx))) @ wteᵀ       the LM head is the token embedding, tied
                                                     (or its own lm_head, as LLaMA's)

Every block is pre-norm: ``h = h + attn(norm_1(h)); h = h + mlp(norm_2(h))``. With backend
``"triton"`` each residual add is fused into the norm that follows it (``forward_residual`` of the
fused norms: one kernel reads the branch output and the stream, writes the new stream and its
norm), so the blocks pass on ``(x, h)``: the last branch output, not yet added, and the stream.
Attention runs ``horse.kernels.flash_attention`` and the MLP ``horse.kernels.fused_mlp`` /
``horse.kernels.fused_gated_mlp`` whenever the compute dtype (autocast's, or the input's) is float16 or
bfloat16; in float32 those two stay on SDPA and nn.Linear, because the matmul kernels take half
precision only (tl.dot would compute float32 as TF32), while the norms stay fused in every dtype.
Backend ``"reference"`` runs the same weights on plain torch modules (``nn.LayerNorm``,
``nn.RMSNorm``, SDPA, nn.Linear, unfused adds). Parameter names are the same on both, so a state
dict loads either way.

With ``moe_experts`` > 0 each block's MLP is a mixture of experts instead (``MoE``, on
``horse.layers.FusedMoE``): a softmax top-k router sends each token to moe_top_k of moe_experts gated
experts, and the training loss adds ``router_aux_loss_coef`` times the load-balancing loss of every
block's router logits (``horse.layers.load_balancing_loss``, as transformers computes it).

The model is dense: ``horse.parallel.parallelize(model, mesh)`` makes it one rank's
tensor-parallel shard afterwards, by a plan that cuts its weights, hooks the collectives onto its
modules and makes its down projections row-parallel; its own forwards run at every tp.

    python -m horse.model        # the presets: parameters and training FLOPs per token
"""

import argparse
import hashlib
import math
import typing
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)
from torch import nn

from horse import kernels
from horse.kernels import reference
from horse.kernels.cross_entropy import VocabShard, head_loss
from horse.layers import (
    FusedLayerNorm,
    FusedMoE,
    FusedRMSNorm,
    FusedSelfAttention,
    MoEExperts,
    RotaryEmbedding,
    load_balancing_loss,
)

BACKENDS = ("triton", "reference")


@dataclass
class GPTConfig:
    """The architecture. Where it runs (backend, device, precision) is the caller's choice.

    vocab_size: rows of the token embedding (and outputs of the LM head)
    vocab_used: ids in use; the padding rows above get logits of -inf (never sampled, no loss); None: all
    block_size: longest sequence the model takes (the learned position table, the rotary table)
    n_layer: transformer blocks
    n_head: query heads
    n_kv_heads: key/value heads for grouped-query attention (a divisor of n_head); None: n_head
    attn_window: sliding window (Mistral's): a position sees itself and the attn_window before it; None: all
    d_model: width of the residual stream
    mlp_hidden: hidden width of the MLP; None: 4·d_model for gelu, 8/3·d_model rounded up to 64 for swiglu
    positions: learned (GPT-2's position table) or rotary (RoPE on queries and keys)
    norm: layernorm or rmsnorm
    mlp: gelu (tanh approximation, as GPT-2) or swiglu
    bias: biases in the linear layers and the LayerNorms (the swiglu MLP has none, as LLaMA)
    rope_base: rotary base frequency
    norm_eps: epsilon of every norm
    tie_embeddings: the LM head is the token embedding (GPT-2); else a separate lm_head (LLaMA)
    document_masking: each document of a row (after an end of text, up to the next) attends within itself
    eot_id: the end-of-text token that ends a document; None: the data has none
    moe_experts: experts of each block's MLP, then a mixture of experts (Mixtral's: see MoE); 0: the dense MLP
    moe_top_k: experts each token goes to, 1 to moe_experts
    moe_inter: hidden width of each expert; None: the swiglu MLP's (8/3·d_model rounded up to 64)
    router_aux_loss_coef: weight of the load-balancing loss in the training loss (transformers' default)
    """

    vocab_size: int = 50304  # GPT-2's 50,257 rounded up to a multiple of 64 for the tensor cores
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_kv_heads: int | None = None
    attn_window: int | None = None
    d_model: int = 768
    mlp_hidden: int | None = None
    positions: Literal["learned", "rotary"] = "learned"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    mlp: Literal["gelu", "swiglu"] = "gelu"
    bias: bool = True
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_used: int | None = None
    tie_embeddings: bool = True
    document_masking: bool = False
    eot_id: int | None = None
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_inter: int | None = None
    router_aux_loss_coef: float = 0.001

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be a multiple of n_head ({self.n_head})"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads < 1 or self.n_head % self.n_kv_heads):
            raise ValueError(f"GPTConfig.n_kv_heads ({self.n_kv_heads}) must divide n_head ({self.n_head})")
        if self.attn_window is not None and self.attn_window < 0:
            raise ValueError(f"GPTConfig.attn_window must be at least 0 (or None), got {self.attn_window}")
        if self.vocab_used is not None and not 1 <= self.vocab_used <= self.vocab_size:
            raise ValueError(
                f"GPTConfig.vocab_used must be between 1 and vocab_size ({self.vocab_size}), "
                f"got {self.vocab_used}"
            )
        if self.mlp_hidden is not None and self.mlp_hidden < 1:
            raise ValueError(f"GPTConfig.mlp_hidden must be at least 1, got {self.mlp_hidden}")
        hints = typing.get_type_hints(GPTConfig)
        for name in ("positions", "norm", "mlp"):
            choices = typing.get_args(hints[name])
            if getattr(self, name) not in choices:
                raise ValueError(f"GPTConfig.{name} must be one of {choices}, got {getattr(self, name)!r}")
        if self.document_masking and self.eot_id is None:
            raise ValueError("GPTConfig.document_masking needs eot_id, the token that ends a document")
        if self.eot_id is not None and not 0 <= self.eot_id < self.vocab_size:
            raise ValueError(
                f"GPTConfig.eot_id must be a token id in [0, vocab_size {self.vocab_size}), got {self.eot_id}"
            )
        if self.positions == "rotary" and self.head_dim % 2:
            raise ValueError(f"GPTConfig: rotary positions need an even head_dim, got {self.head_dim}")
        if self.moe_experts < 0:
            raise ValueError(
                f"GPTConfig.moe_experts must be at least 0 (0: the dense MLP), got {self.moe_experts}"
            )
        if self.moe_experts and not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(
                f"GPTConfig.moe_top_k must be between 1 and moe_experts ({self.moe_experts}), "
                f"got {self.moe_top_k}"
            )
        if self.moe_inter is not None and self.moe_inter < 1:
            raise ValueError(f"GPTConfig.moe_inter must be at least 1 (or None), got {self.moe_inter}")
        if not self.router_aux_loss_coef >= 0:
            raise ValueError(
                f"GPTConfig.router_aux_loss_coef must be at least 0, got {self.router_aux_loss_coef}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_head if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden(self) -> int:
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        if self.mlp == "swiglu":  # two input matrices instead of one: 2/3 of the width keeps the FLOPs
            return self.swiglu_hidden
        return 4 * self.d_model

    @property
    def swiglu_hidden(self) -> int:
        """8/3·d_model rounded up to 64: a swiglu MLP of the FLOPs of a 4·d_model gelu one."""
        return -(-8 * self.d_model // 3 // 64) * 64

    @property
    def expert_hidden(self) -> int:
        """Hidden width of each expert (moe_experts > 0)."""
        return self.swiglu_hidden if self.moe_inter is None else self.moe_inter


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


def tiny() -> GPTConfig:
    """3.2M parameters on bytes: learns visible Shakespeare on two CPU cores in a few minutes.

    A short block: at a fixed token budget, 32 windows of 64 bytes per step fell to a validation
    loss of 2.06 in 250 steps where 8 windows of 256 were still at 2.45 (bigram level) after 300.
    """
    return GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, d_model=256)


def gpt2_124m() -> GPTConfig:
    return GPTConfig(n_layer=12, n_head=12, d_model=768)


def gpt2_350m() -> GPTConfig:
    return GPTConfig(n_layer=24, n_head=16, d_model=1024)


def gpt2_774m() -> GPTConfig:
    return GPTConfig(n_layer=36, n_head=20, d_model=1280)


def gpt2_1_5b() -> GPTConfig:
    return GPTConfig(n_layer=48, n_head=25, d_model=1600)


def tiny_moe() -> GPTConfig:
    """tiny with each MLP a mixture of 8 SwiGLU experts of width 256, 2 a token: 7.4M parameters,
    2.7M of them active (a token's share of the experts: 2 of 8)."""
    return GPTConfig(
        vocab_size=256,
        block_size=64,
        n_layer=4,
        n_head=4,
        d_model=256,
        mlp="swiglu",
        moe_experts=8,
        moe_top_k=2,
        moe_inter=256,
    )


def moe_124m() -> GPTConfig:
    """gpt2-124m's attention and embeddings, in LLaMA's style (rotary, RMSNorm, no biases), each MLP 8
    SwiGLU experts of width 1024, 2 a token: a token computes GPT-2's 4·768-wide MLP's FLOPs (2 experts
    x 3 matrices x 1024 = 2 x 3072); 124M active parameters, 294M in all (python -m horse.model)."""
    return GPTConfig(
        n_layer=12,
        n_head=12,
        d_model=768,
        positions="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        moe_experts=8,
        moe_top_k=2,
        moe_inter=1024,
    )


def moe_1b_7b() -> GPTConfig:
    """OLMoE-1B-7B's shape (16 layers, d_model 2048, 16 heads, 64 experts of width 1024, 8 a token),
    its embedding tied: 1.18B active parameters, 6.8B in all."""
    return GPTConfig(
        block_size=4096,
        n_layer=16,
        n_head=16,
        d_model=2048,
        positions="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        moe_experts=64,
        moe_top_k=8,
        moe_inter=1024,
    )


PRESETS = {
    "tiny": tiny,
    "tiny-moe": tiny_moe,
    "gpt2-124m": gpt2_124m,
    "moe-124m": moe_124m,
    "gpt2-350m": gpt2_350m,
    "gpt2-774m": gpt2_774m,
    "gpt2-1.5b": gpt2_1_5b,
    "moe-1b-7b": moe_1b_7b,
}


def preset(name: str) -> GPTConfig:
    """The configuration of a named preset (``tiny``, ``gpt2-124m``, ...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]()


# ----------------------------------------------------------------------------------------------
# Layers
# ----------------------------------------------------------------------------------------------


def runs_half_kernels(backend: str, x: torch.Tensor) -> bool:
    """Whether the half-precision kernels (attention, MLP) take x: backend triton, and x computed
    in float16 or bfloat16, by autocast or by its own dtype."""
    if backend != "triton":
        return False
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    return dtype in (torch.float16, torch.bfloat16)


@dataclass
class Documents:
    """The documents packed in a batch of rows (B, T): a document is the tokens after an end of text
    up to and including the next one (a row's first token starts one, its last ends one), and with
    document masking it is a sequence of its own. Built on the device from the tokens by
    :func:`documents_of`, with no value read back to the host.

    positions: (B, T) int64, each token's position in its document (0 at its first token)
    document: (B, T) int64, each token's document's number in its row (0, 1, ...)
    starts: (B, T) int32, each token's document's first column: flash_attention's document_starts,
        whose kernels keep the dense grid (a program per query tile) whatever the documents
    """

    positions: torch.Tensor
    document: torch.Tensor
    starts: torch.Tensor


def documents_of(idx: torch.Tensor, eot_id: int) -> Documents:
    """The documents of the rows idx (B, T) whose documents end at token eot_id."""
    batch, seqlen = idx.shape
    starts = torch.ones_like(idx, dtype=torch.bool)  # (B, T): a token that begins a document
    starts[:, 1:] = idx[:, :-1] == eot_id
    columns = torch.arange(seqlen, device=idx.device).expand(batch, seqlen)
    first = torch.where(starts, columns, 0).cummax(dim=1).values  # (B, T): its document's first column
    return Documents(columns - first, starts.cumsum(dim=1) - 1, first.to(torch.int32))


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    documents: Documents | None = None,
) -> torch.Tensor:
    """Causal attention on SDPA. q (B, Tq, n_head, hd); k, v (B, Tk, n_kv_heads, hd) with Tk >= Tq,
    the queries being the last Tq positions (the mask is aligned to the bottom-right corner, so new
    tokens decode against a longer cache); with a window, each query also sees only the window keys
    before its own; with documents (Tq = Tk), only the keys of its own document. Returns (B, Tq,
    n_head, hd). horse.kernels.flash_attention(q, k, v, causal=True, window_size=(window, -1)) takes
    the same layout and mask, and its document_starts the documents (CausalSelfAttention)."""
    tq, tk = q.shape[1], k.shape[1]
    mask = None
    if window is not None and window < tk - 1:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq).triu(tk - tq - window)
    elif tq not in (1, tk) or documents is not None:
        mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
    if documents is not None:  # (B, 1, T, T): and within the query's document
        same = documents.document[:, :, None] == documents.document[:, None, :]
        mask = (mask & same)[:, None]
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2),  # (B, n_head, Tq, hd)
        k.transpose(1, 2),  # (B, n_kv_heads, Tk, hd)
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None and tq == tk,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return y.transpose(1, 2)  # (B, Tq, n_head, hd)


class KVCache:
    """Keys and values of the tokens seen so far, so that generation feeds each new token alone."""

    def __init__(self, config: GPTConfig):
        self.max_len = config.block_size
        self.k: list[torch.Tensor | None] = [None] * config.n_layer
        self.v: list[torch.Tensor | None] = [None] * config.n_layer
        self.length = 0  # tokens cached; GPT.forward advances it

    def buffers(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole (B, max_len, n_kv_heads, hd) buffers of ``layer``, allocated on first use like
        k, v (B, T, n_kv_heads, hd): in the dtype autocast gives them."""
        if self.k[layer] is None:
            shape = (k.shape[0], self.max_len, *k.shape[2:])
            self.k[layer], self.v[layer] = k.new_empty(shape), v.new_empty(shape)
        return self.k[layer], self.v[layer]

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append k, v (B, T, n_kv_heads, hd) of ``layer``; returns (B, length + T, n_kv_heads, hd) each."""
        self.buffers(layer, k, v)
        end = self.length + k.shape[1]
        self.k[layer][:, self.length : end] = k
        self.v[layer][:, self.length : end] = v
        return self.k[layer][:, :end], self.v[layer][:, :end]


class CausalSelfAttention(FusedSelfAttention):
    """``horse.layers.FusedSelfAttention`` (its c_attn, c_proj and rotary, shared by every block) with
    the model's two additions: a KV cache, and SDPA on the reference backend or outside half precision."""

    def __init__(self, config: GPTConfig, backend: str, rotary: RotaryEmbedding | None):
        window = (-1 if config.attn_window is None else config.attn_window, -1)
        d, heads, kv_heads = config.d_model, config.n_head, config.kv_heads
        super().__init__(d, heads, n_kv_heads=kv_heads, bias=config.bias, window_size=window)
        self.backend, self.rotary = backend, rotary

    def forward(
        self,
        x: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        documents: Documents | None = None,
    ) -> torch.Tensor:
        """x (B, T, C); with documents (no cache) each document of a row attends within itself, its
        positions from 0."""
        start = 0 if cache is None else cache.length
        position = {"offset": start} if documents is None else {"positions": documents.positions}
        q, k, v = self.qkv(x, **position)  # (B, T, n_heads, hd), (B, T, n_kv_heads, hd) twice
        if documents is not None and runs_half_kernels(self.backend, q):
            # Each query sees its own document's keys up to itself: the dense kernels' grid.
            y = kernels.flash_attention(
                q, k, v, causal=True, window_size=self.window_size, document_starts=documents.starts
            )  # (B, T, n_heads, hd)
        elif cache is not None and runs_half_kernels(self.backend, q):
            # Appends k, v to the cache in place and decodes against it: keys split among programs.
            k_cache, v_cache = cache.buffers(layer, k, v)  # (B, block_size, n_kv_heads, hd)
            y = kernels.flash_attention_with_kvcache(
                q, k_cache, v_cache, cache_seqlens=start, k=k, v=v, causal=True, window_size=self.window_size
            )  # (B, T, n_heads, hd)
        elif runs_half_kernels(self.backend, q):
            y = kernels.flash_attention(q, k, v, causal=True, window_size=self.window_size)
        else:
            if cache is not None:
                k, v = cache.update(layer, k, v)  # (B, cached + T, n_kv_heads, hd)
            window = self.window_size[0]
            y = causal_attention(q, k, v, None if window < 0 else window, documents)
        return self.c_proj(y.flatten(2))  # (B, T, n_heads · hd) -> (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, backend: str):
        super().__init__()
        self.backend = backend
        # The parameter names of horse.layers.FusedMLP: GPT-2's, or LLaMA's (no biases) for swiglu.
        self.swiglu = config.mlp == "swiglu"
        d, hidden = config.d_model, config.hidden
        if self.swiglu:
            self.gate_proj = nn.Linear(d, hidden, bias=False)
            self.up_proj = nn.Linear(d, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, d, bias=False)
        else:
            self.c_fc = nn.Linear(d, hidden, bias=config.bias)
            self.c_proj = nn.Linear(hidden, d, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down = self.down_proj if self.swiglu else self.c_proj
        half = runs_half_kernels(self.backend, x)
        if half and isinstance(down, nn.Linear):  # the whole MLP in one call
            if self.swiglu:
                weights = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
                return kernels.fused_gated_mlp(x, *weights, activation="silu")
            fc, proj = self.c_fc, self.c_proj
            return kernels.fused_mlp(x, fc.weight, fc.bias, proj.weight, proj.bias, activation="gelu_tanh")
        # The up projections with their activation, then the down projection as a module of its own:
        # tensor parallelism (horse.parallel) makes it row-parallel, summing the ranks' partial outputs.
        if half and self.swiglu:  # (B, T, hidden) inside
            h = kernels.gated_linear(x, self.gate_proj.weight, self.up_proj.weight, activation="silu")
        elif half:
            h = kernels.linear_act(x, self.c_fc.weight, self.c_fc.bias, activation="gelu_tanh")
        elif self.swiglu:
            h = F.silu(self.gate_proj(x)) * self.up_proj(x)
        else:
            h = F.gelu(self.c_fc(x), approximate="tanh")
        return down(h)


def expert_activation(config: GPTConfig) -> str:
    """The experts' gated activation: SwiGLU for mlp swiglu, GeGLU (tanh GELU) for gelu."""
    return "silu" if config.mlp == "swiglu" else "gelu_tanh"


class Experts(MoEExperts):
    """``horse.layers.MoEExperts`` with the model's switch: ``horse.kernels.moe_mlp`` whenever the compute
    dtype is float16 or bfloat16 on backend triton; else (the reference backend, or float32, which the
    kernels do not take) the loop over experts in plain torch, in float32."""

    def __init__(self, config: GPTConfig, backend: str):
        activation = expert_activation(config)
        super().__init__(config.d_model, config.expert_hidden, config.moe_experts, activation=activation)
        self.backend = backend

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (tokens, C); ids, weights (tokens, top_k) -> (tokens, C)"""
        if runs_half_kernels(self.backend, x):
            return super().forward(x, ids, weights)
        with torch.autocast(x.device.type, enabled=False):
            experts = (self.gate_up_proj, self.down_proj)
            y = reference.moe_mlp(x, ids, weights, *experts, activation=self.activation)
        return y.to(x.dtype)


class MoE(FusedMoE):
    """The block's MLP as a mixture of experts: ``horse.layers.FusedMoE`` (its router ``gate`` and its
    ``experts``, transformers' names and layout), Mixtral's: a softmax top-k router whose top-k weights
    are renormalised to sum to 1, gated experts without biases (SwiGLU for mlp swiglu, GeGLU for gelu),
    on the model's :class:`Experts`. forward(x (B, T, C)) returns (y (B, T, C), router logits (B·T,
    moe_experts))."""

    def __init__(self, config: GPTConfig, backend: str):
        d, hidden, experts, top_k = config.d_model, config.expert_hidden, config.moe_experts, config.moe_top_k
        activation = expert_activation(config)
        super().__init__(d, hidden, experts, top_k, router="softmax", normalize=True, activation=activation)
        self.experts = Experts(config, backend)  # FusedMoE's experts, with the model's backend switch


def make_norm(config: GPTConfig, backend: str) -> nn.Module:
    """The block's norm: the fused Triton module or its torch twin (same parameters either way)."""
    if config.norm == "layernorm":
        cls = FusedLayerNorm if backend == "triton" else nn.LayerNorm
        return cls(config.d_model, eps=config.norm_eps, bias=config.bias)
    cls = FusedRMSNorm if backend == "triton" else nn.RMSNorm
    return cls(config.d_model, eps=config.norm_eps)


def add_norm(norm: nn.Module, x: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then norm: ``(norm(h + x), h + x)``; h None starts the stream at x."""
    if h is None:
        return norm(x), x
    if isinstance(norm, (FusedLayerNorm, FusedRMSNorm)):
        # Under autocast the branch output x is float16 and the stream float32, as after h + x.
        return norm.forward_residual(x.to(h.dtype), h)
    h = h + x
    return norm(h), h


class Block(nn.Module):
    def __init__(self, config: GPTConfig, backend: str, rotary: RotaryEmbedding | None):
        super().__init__()
        self.norm_1 = make_norm(config, backend)
        self.attn = CausalSelfAttention(config, backend, rotary)
        self.norm_2 = make_norm(config, backend)
        # The MLP, or a mixture of experts in its place (their own names, so that the plans differ).
        self.mlp = MLP(config, backend) if not config.moe_experts else None
        self.moe = MoE(config, backend) if config.moe_experts else None

    def forward(self, x, h, cache: KVCache | None, layer: int, documents: Documents | None = None):
        """x (B, T, C): the previous branch output, not yet added to the stream h (B, T, C). Returns
        (this block's MLP output, the stream, its router logits (B·T, moe_experts), None without experts)."""
        y, h = add_norm(self.norm_1, x, h)
        y, h = add_norm(self.norm_2, self.attn(y, cache, layer, documents), h)
        if self.moe is None:
            return self.mlp(y), h, None
        y, router_logits = self.moe(y)
        return y, h, router_logits


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


# A parameter's initial values come row by row (dim 0) from generators seeded from the run's seed, the
# parameter's name and the row's block of ROWS_PER_SEED: a rank draws only the rows it holds, and
# every layout (tp, FSDP's shards) gets the same weights from the same seed, on any device.
ROWS_PER_SEED = 64


def initial_rows(
    name: str, shape: torch.Size, rows: torch.Tensor, config: GPTConfig, seed: int
) -> torch.Tensor:
    """Rows ``rows`` (a 1-D int64 tensor of increasing indices into dim 0) of the GPT parameter
    ``name``, whose whole shape is ``shape``, as a GPT freshly initialised from ``seed`` holds them:
    float32 on the CPU, shape (len(rows), *shape[1:]). GPT-2's initialisation: biases zero, norm
    weights one, the other weights normal with std 0.02, except the projections that write into the
    residual stream, scaled by 1/sqrt(number of residual adds) so the stream's variance does not grow
    with depth."""
    module, _, param = name.rpartition(".")
    out_shape = (len(rows), *shape[1:])
    if param == "bias":
        return torch.zeros(out_shape)
    if module.rpartition(".")[2].startswith("norm"):
        return torch.ones(out_shape)
    writes_stream = module.endswith(("c_proj", "down_proj")) or param == "down_proj"  # the experts' too
    std = 0.02 / math.sqrt(2 * config.n_layer) if writes_stream else 0.02
    row_size = math.prod(shape[1:])
    out = torch.empty(len(rows), row_size)
    blocks = rows // ROWS_PER_SEED
    for block in blocks.unique().tolist():
        first = block * ROWS_PER_SEED
        digest = hashlib.sha256(f"{seed}/{name}/{block}".encode()).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest[:8]) >> 1)
        values = torch.randn(min(ROWS_PER_SEED, shape[0] - first), row_size, generator=generator)
        in_block = blocks == block
        out[in_block] = values[rows[in_block] - first] * std
    return out.view(out_shape)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, backend: str = "reference", fused_loss: bool = True):
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"GPT: backend must be one of {BACKENDS}, got {backend!r}")
        self.config, self.backend = config, backend
        # GPT.loss: the LM head fused with the loss (no logits held), or logits then F.cross_entropy
        self.fused_loss = fused_loss
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.block_size, config.d_model) if config.positions == "learned" else None
        self.rotary = None  # one table (float32, not saved: derived from the config) for every block
        if config.positions == "rotary":
            self.rotary = RotaryEmbedding(config.head_dim, config.block_size, config.rope_base)
        self.blocks = nn.ModuleList(Block(config, backend, self.rotary) for _ in range(config.n_layer))
        self.norm_f = make_norm(config, backend)
        self.lm_head = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        # The LM head's share of the vocabulary, which tensor parallelism (horse.parallel) cuts by rows:
        # its first id and the collectives that combine the ranks' loss statistics (None: all of it,
        # from id 0); head_input, where the head's input passes, is where it gathers that from the ranks.
        self.vocab_shard: VocabShard | None = None
        self.head_input = nn.Identity()
        if self.wte.weight.device.type != "meta":  # on meta, whoever allocates initialises
            self.init_weights(int(torch.randint(2**62, ())))  # a seed from the global RNG

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Every parameter of this whole model initialised from ``seed`` (:func:`initial_rows`)."""
        for name, p in self.named_parameters():
            p.copy_(initial_rows(name, p.shape, torch.arange(p.shape[0]), self.config, seed))

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab_size). With a cache, idx continues the cached
        tokens, and its keys and values are appended to the cache."""
        return self.logits(self.features(idx, cache))

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head (vocab_size, C): the token embedding, or lm_head's own weight."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    @property
    def vocab_start(self) -> int:
        """The id of the LM head's first row: 0, or a tensor-parallel rank's first id."""
        return 0 if self.vocab_shard is None else self.vocab_shard.start

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        """The LM head: y (B, T, C) -> logits (B, T, vocab_size), the padding ids (vocab_used on) -inf.
        On a tensor-parallel rank: this rank's columns (B, T, vocab_size / tp)."""
        logits = F.linear(self.head_input(y), self.head_weight)  # (B, T, the head's rows)
        used = self.config.vocab_used
        if used is not None and used < self.config.vocab_size:
            ids = torch.arange(logits.shape[-1], device=y.device) + self.vocab_start
            logits = logits.masked_fill(ids >= used, float("-inf"))  # the padding rows
        return logits

    def embed(self, idx: torch.Tensor, positions: int | torch.Tensor) -> torch.Tensor:
        """idx (B, T) at positions (an int: the first token's, the rest following it; or each
        token's, (B, T)) -> the stream's start (B, T, C)."""
        x = self.wte(idx)  # (B, T, C)
        if self.wpe is not None:
            if isinstance(positions, int):
                positions = torch.arange(positions, positions + idx.shape[1], device=idx.device)
            x = x + self.wpe(positions)  # (T, C) over B, or (B, T, C)
        return x

    def features(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """idx (B, T) -> the final norm's output (B, T, C), the LM head's input."""
        return self.features_and_router_logits(idx, cache)[0]

    def features_and_router_logits(
        self, idx: torch.Tensor, cache: KVCache | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """idx (B, T) -> (the final norm's output (B, T, C), each block's router logits (B·T,
        moe_experts) in block order: none without experts)."""
        start = cache.length if cache is not None else 0
        if start + idx.shape[1] > self.config.block_size:
            raise ValueError(
                f"GPT: {start + idx.shape[1]} positions (cached {start} + input {idx.shape[1]}) exceed "
                f"block_size {self.config.block_size}"
            )
        documents = None  # generation (a cache) runs one document
        if self.config.document_masking and cache is None:
            documents = documents_of(idx, self.config.eot_id)
        x, h = self.embed(idx, start if documents is None else documents.positions), None
        router_logits = []
        for layer, block in enumerate(self.blocks):
            x, h, logits = block(x, h, cache, layer, documents)
            if logits is not None:
                router_logits.append(logits)
        y, _ = add_norm(self.norm_f, x, h)
        if cache is not None:
            cache.length += idx.shape[1]
        return y, router_logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of next-token prediction; idx, targets (B, T). With fused_loss (the
        default) the LM head and the loss run fused in row chunks and the logits never exist whole
        (``horse.kernels.cross_entropy.head_loss``): the Triton kernels on backend triton, their
        plain-PyTorch twins on reference. With experts, in training mode, plus router_aux_loss_coef
        times the load-balancing loss of the blocks' router logits together (``load_balancing_loss``),
        whose value is kept, detached, in ``router_aux_loss``; in eval mode the cross-entropy alone."""
        y, router_logits = self.features_and_router_logits(idx)
        if not self.fused_loss:
            if self.vocab_shard is not None:
                raise ValueError("GPT.loss: the unfused loss (fused_loss False) runs at tp=1 only")
            loss = F.cross_entropy(self.logits(y).flatten(0, 1), targets.flatten())
        else:
            in_use = (self.config.vocab_used or self.config.vocab_size) - self.vocab_start
            head = self.head_weight[: max(0, in_use)]  # the rows in use (the padding's left out)
            y = self.head_input(y).flatten(0, 1)  # (B·T, C)
            use_triton = self.backend == "triton"
            loss = head_loss(
                y, head, targets.flatten(), use_triton=use_triton, shard=self.vocab_shard, fn="GPT.loss"
            )
        if not router_logits or not self.training:
            return loss
        config = self.config
        aux = load_balancing_loss(router_logits, config.moe_experts, config.moe_top_k)
        self.router_aux_loss = aux.detach()
        return loss + config.router_aux_loss_coef * aux

    def num_params(self) -> int:
        """Parameters (a tensor-parallel rank's own), a tied embedding / LM head counted once."""
        return sum(p.numel() for p in self.parameters())

    def num_active_params(self) -> int:
        """Parameters a token computes with: :meth:`num_params`, the experts counted moe_top_k of
        moe_experts (each token's share); all of them in a dense model."""
        experts = sum(p.numel() for block in self.blocks if block.moe for p in block.moe.experts.parameters())
        inactive = (
            experts * (self.config.moe_experts - self.config.moe_top_k) // max(1, self.config.moe_experts)
        )
        return self.num_params() - inactive

    def flops_per_token(self, seq_len: int) -> int:
        """Training FLOPs per token at sequence length seq_len: 6·N (forward and backward of every
        matmul; N the active parameters (:meth:`num_active_params`), leaving out the position table,
        a lookup, and keeping the token embedding only when it is also the LM head) plus
        12·n_layer·d_model·seq_len for attention's scores and weighted sum, seq_len capped at
        attn_window + 1 with a sliding window (the most keys a query sees). Counted from the layers,
        so a tensor-parallel rank's is its share: its parameters, its heads."""
        lookups = [self.wpe] + ([self.wte] if self.lm_head is not None else [])
        n = self.num_active_params() - sum(m.weight.numel() for m in lookups if m is not None)
        window = self.config.attn_window
        keys = seq_len if window is None else min(seq_len, window + 1)
        width = sum(block.attn.n_heads * block.attn.head_dim for block in self.blocks)  # n_layer · d_model
        return 6 * n + 12 * width * keys


def num_params(config: GPTConfig) -> int:
    """Parameters of a model of this config, counted on the meta device (nothing allocated)."""
    with torch.device("meta"):
        return GPT(config).num_params()


def num_active_params(config: GPTConfig) -> int:
    """Parameters a token of a model of this config computes with (GPT.num_active_params, on meta)."""
    with torch.device("meta"):
        return GPT(config).num_active_params()


def flops_per_token(config: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token of the whole model at seq_len (GPT.flops_per_token, on the meta device)."""
    with torch.device("meta"):
        return GPT(config).flops_per_token(seq_len)


def main(argv: list[str] | None = None) -> None:
    description = (
        "The presets: parameters (all, and those a token computes with), layers, width, heads, experts "
        "and training FLOPs per token."
    )
    argparse.ArgumentParser(prog="python -m horse.model", description=description).parse_args(argv)
    header = f"{'preset':<10} {'params':>8} {'active':>8} {'layers':>6} {'d_model':>7} {'heads':>5}"
    print(f"{header} {'experts':>7}  GFLOP/token (training)")
    for name, make in PRESETS.items():
        config = make()
        params, active = num_params(config) / 1e6, num_active_params(config) / 1e6
        gflops = flops_per_token(config, config.block_size) / 1e9
        shape = f"{config.n_layer:>6} {config.d_model:>7} {config.n_head:>5}"
        experts = f"{config.moe_top_k}/{config.moe_experts}" if config.moe_experts else "-"
        print(
            f"{name:<10} {params:7.1f}M {active:7.1f}M {shape} {experts:>7}  {gflops:.2f} at seq_len "
            f"{config.block_size}"
        )


if __name__ == "__main__":
    main()
