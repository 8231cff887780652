"""Score modifications the attention passes share: logit softcapping (Gemma 2's), applied to the raw
scores q kᵀ before the mask, so that every pass (forward, both gradients, decode) computes the same
softcapped scores.

With softmax_scale s and softcap c the scaled scores become c · tanh(q kᵀ · s / c); in raw units (the
kernels scale after the row max) that is cap · tanh(q kᵀ / cap) with cap = c / s, whose derivative is
1 - tanh². Triton's core language has no tanh: tanh(u) = 2 sigmoid(2u) - 1 on every backend and in
the interpreter, as the fused loss's softcap computes it.
"""

import triton
import triton.language as tl


@triton.jit
def _softcapped_scores(qk, qk_scale, SOFTCAP: tl.constexpr):
    """(scores, tanh) of the raw scores qk (float32) under softcap SOFTCAP (> 0): cap · tanh(qk / cap),
    cap = SOFTCAP / softmax_scale, still in raw units, and the tanh whose 1 - tanh² the backward's
    ds takes. qk_scale is softmax_scale · log2(e), as every pass holds it."""
    cap = SOFTCAP * 1.4426950408889634 / qk_scale
    tanh = 2.0 * tl.sigmoid(qk * (2.0 / cap)) - 1.0
    return cap * tanh, tanh
