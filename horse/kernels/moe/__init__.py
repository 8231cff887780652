"""Mixture-of-experts MLPs: the routed experts of an MoE layer as grouped GEMMs, forward and backward.

    y_t = Σ_k w_t,k · expert_{e_t,k}(x_t)
    expert_e(x) = (act(x W_gate,eᵀ + b_gate,e) ⊙ (x W_up,eᵀ + b_up,e)) W_down,eᵀ + b_down,e

act is "silu" (SwiGLU: Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE), "gelu_tanh" (GeGLU), or with ``limit``
gpt-oss's clamped SwiGLU. The weights come as transformers 5.25 packs them (gate_up_proj (experts,
2·inter, hidden), down_proj (experts, hidden, inter)) or as any strided view of that shape (gpt-oss's
transposed storage, gate and up interleaved by ``gate_up_interleaved``): every kernel reads by
strides, nothing is copied. Dropless: every routed (token, k) pair is computed, no capacity factor.
float16 or bfloat16 on the Triton path (float32 accumulation); off it, the float32 reference of
``horse.kernels.reference`` (float32 allowed there). At most 1,024 experts on the Triton path (the
sort's one-hot blocks).

Forward, no host sync:
1. ``routing._count_kernel`` and ``routing._place_kernel``: a stable counting sort of the tokens·top_k
   pairs by expert, a program a block of pairs: each block's count by expert, integer prefix sums
   over experts and blocks (tensor ops on the device), then each pair its row, a block's pairs of an
   expert in pair order after the earlier blocks' (the same order on every run): each expert's rows,
   each pair's sorted row and the inverse.
2. ``launch.row_tiles`` (a few tensor ops on the device): row tiles that never cross an expert, a
   number fixed by the sizes (cdiv(pairs, BLOCK_M) + experts at most), so the grid needs no sync;
   an expert with no rows gets no tile, the tiles past the last exit at once.
3. ``gemm._gate_up_fwd_kernel``: the gated GEMM over the sorted rows (x's rows gathered by token),
   one pass over x with two accumulators, bias and act in the epilogue; gate and up saved for the
   backward.
4. ``gemm._expert_gemm_kernel``: the down projection, bias and the routing weight in its epilogue;
   on sm_90 h's and down_proj's tiles by TMA (``launch.tma_usable``: weights as transformers stores
   them).
5. ``routing._combine_kernel``: each token's top_k rows summed in k order in float32 (no atomics).

Backward: ``gemm._dh_bwd_kernel`` computes g = dy W_down,e by expert with the routing weight, act'
and the product rule in its epilogue (dgate, dup in gate_up_proj's row order; h recomputed for
dW_down; the routing weight's gradient Σ h g as per-column-tile float32 partials, summed in a fixed
order, plus dy · b_down); dx rows are ``_expert_gemm_kernel`` again (dpre W_gate_up,e; by TMA as the
down projection), combined as in the forward; the weight and bias gradients are
``gemm._weight_grad_kernel``, a program a tile of one expert's weight summing that expert's rows in
sorted order: repeatable bit for bit, no atomics.

The package, a module per concern: ``ops`` (the public function, its validation, the custom ops),
``launch`` (the launchers and their plans), ``configs`` (the GEMM table, data in configs.json, and the
rules of the sort and the combine), ``routing`` and ``gemm`` (the kernels).
"""

from horse.kernels.moe.configs import ACTIVATIONS, SUPPORTED_DTYPES
from horse.kernels.moe.ops import moe_mlp

__all__ = ["ACTIVATIONS", "SUPPORTED_DTYPES", "moe_mlp"]
