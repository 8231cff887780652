"""The transformer MLP: GEMMs with the bias and activation fused into their epilogues, forward and backward.

    linear_act:      y = act(x Wᵀ + b)
    gated_linear:    y = act(x W_gateᵀ) ⊙ (x W_upᵀ)                  (SwiGLU with silu, GeGLU with gelu)
    fused_mlp:       y = act(x W_inᵀ + b_in) W_outᵀ + b_out           (GPT-2: c_fc → GELU → c_proj)
    fused_gated_mlp: y = (act(x W_gateᵀ) ⊙ (x W_upᵀ)) W_downᵀ        (LLaMA: gate_proj, up_proj, down_proj)

act is one of ``none``, ``relu``, ``relu2`` (relu squared), ``gelu`` (erf), ``gelu_tanh`` and ``silu``,
always named by the caller (``activation=``, keyword-only, no default: no function picks one silently).
x is (..., K) with its leading dims flattened to M rows; weights are nn.Linear's (out_features,
in_features). Any M, N, K (ragged edges are masked; zero sizes allowed) and any strides: the kernels
take every stride, so transposed or expanded operands are read in place (only gate and up weights
with different strides from each other are copied). float16 or bfloat16
(every tensor of a call in one dtype), float32 accumulation, outputs in the input dtype.
float32 inputs raise on the Triton path: tl.dot would run them as TF32 behind the caller's back.
On CPU tensors without the interpreter, every function runs the float32 reference of
``horse.kernels.reference`` instead (float32 allowed there), cast to the input's dtype.

Forward: one tiled GEMM per projection with act in the epilogue. Tiles go in grouped order
(GROUP_M row tiles share each weight column tile while it is in L2). The gated kernel makes one
pass over x with two accumulators, so x W_gateᵀ and x W_upᵀ reach memory only when the backward
needs them. Decode-sized M (at most 64 rows) with fewer output tiles than SMs splits the K loop
over programs (``configs.split_k``: at least one program an SM) and a second kernel adds the float32
partials in a fixed order and runs the same epilogue (repeatable: no atomics). gelu_tanh in these
epilogues is tanh.approx on NVIDIA GPUs (one MUFU an element; see ``forward._act_fwd``). The
down projection is a bare ``torch.matmul`` (cuBLAS, bias in its epilogue): it has nothing to fuse.

Backward: dpre = dh ⊙ act'(pre); dx = dpre W; dW = dpreᵀ x; db = Σ_rows dpre. In the MLPs the
GEMM that produces dh = dy W_out (K = out_features) is ours, with dpre computed in its epilogue
(for the gated form the product rule: dgate = dh ⊙ up ⊙ act'(gate), dup = dh ⊙ act(gate)) and db
summed there as per-row-tile float32 partials (no atomics: bit-identical run to run). In
linear_act / gated_linear, dh arrives from outside, so an elementwise kernel computes dpre and the
db partials. dx and dW are ``torch.matmul``: a plain GEMM with nothing to fuse, where cuBLAS is
the fastest there is. Gated, dgate and dup are the halves of one (M, 2N) buffer, so dW_gate and
dW_up are ONE GEMM of 2N rows, [dgate | dup]ᵀ x, when both train (the custom ops return it
stacked; the autograd binding splits it).

Saved, not recomputed: the forward's epilogue writes the pre-activation (gate and up for the gated
form) in the input dtype, and the backward reads it. Cost: M·N elements kept per layer (2·M·N
gated) and one extra M·N write in the forward; no extra FLOPs. Recomputing it instead would save
that memory but cost the forward GEMM again, 2·M·N·K FLOPs (+1/6 of a GPT-2 MLP's forward+backward
GEMM FLOPs, +2/9 gated).
The MLPs keep only the pre-activation, not the hidden activation h = act(pre) that dW_out needs:
the backward's epilogue recomputes h from pre (about ten FLOPs per element, on CUDA cores) and
writes it, one M·N write. So an MLP keeps M·H elements for its backward (2·M·H gated), where eager
PyTorch keeps pre and h (2·M·H; gated 4·M·H: gate, act(gate), up and h). ``bench.mlp`` measures
both costs: the forward with and without saving, and the bytes each implementation keeps.
No grad needed (``torch.no_grad()`` or no input requiring one): nothing is saved or written.

float16 overflow: a pre-activation (gate, up) past ±65,504 that feeds an activation is clamped to
it, and both the output and the backward's act' are computed from the clamped value (a
straight-through clamp), so they agree: stored as ±inf it gave a finite output (silu(-inf) = 0) and
NaN gradients (act'(-inf) = inf x 0). With activation ``none`` the output is left as a matmul gives it.

Operand tiles move by TMA on Hopper and newer (sm_90+): x and weight tiles (dy and W_out in the backward's)
come through tensor descriptors, whose loads read out-of-bounds elements as zeros (no masks in the K loop);
W_out is read as stored, in (K, N) tiles (a descriptor needs its unit stride last). Operands whose start or
row stride is not a multiple of 16 bytes, transposed weights, other GPUs and ``launch.USE_TMA = False``
take pointer loads (one kernel serves both: the ``TMA`` constexpr). sm_90's large and medium forwards run
persistent (``configs.GemmConfig.persistent``): one program an SM walks the tiles in grouped order and the
epilogue subtiles leave by TMA stores while the next tile's loads are in flight; other epilogues store by
pointers. The GEMM tiles come from a table with an entry per GPU family (``horse.kernels.runtime.ARCHS``),
clean in the compile report. Every kernel takes what its epilogue computes as one constexpr group,
``configs.Epilogue`` (activation, gated, bias, what it stores, its column subtiles, inline PTX).

The package, a module per concern, in the order a call takes them: ``ops`` (the public functions,
their validation and the custom ops), ``launch`` (the host launchers; ``launch.USE_TMA``),
``configs`` (the rules that pick a GEMM table entry; the tables are data, ``configs.json``, and
TUNING.md beside them says why each entry is what it is), ``forward`` and ``backward`` (the kernels),
``gemm`` (the device helpers both share).
"""

from horse.kernels.mlp.configs import SUPPORTED_DTYPES
from horse.kernels.mlp.ops import (
    ACTIVATIONS,
    fused_gated_mlp,
    fused_mlp,
    gated_linear,
    linear_act,
)

__all__ = ["ACTIVATIONS", "SUPPORTED_DTYPES", "fused_gated_mlp", "fused_mlp", "gated_linear", "linear_act"]
