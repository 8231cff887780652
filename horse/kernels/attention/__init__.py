"""Exact attention with an online softmax (FlashAttention-style), forward and backward.

    out = softmax(q kᵀ · softmax_scale + mask) v,    lse = log Σ_j exp(q kᵀ · softmax_scale + mask)

q (batch, seqlen_q, heads, head_dim); k, v (batch, seqlen_k, kv_heads, head_dim) with heads a
multiple of kv_heads (grouped-query and multi-query attention); out like q; lse (batch, heads,
seqlen_q) float32. float16 or bfloat16, float32 accumulation, any strides with a unit stride in the
last dimension (nothing is copied). Head dims 1..512; those that are not powers of two are padded
to the next one inside the kernels and masked. The S×S score matrix never reaches memory.

Causal masking is aligned to the bottom-right corner: query i sees key j iff j <= i + seqlen_k -
seqlen_q, so a few new queries decode against a longer cache, and a query that sees no key (more
queries than keys) gets zeros and lse = -inf. A sliding window (local attention) ``(left, right)``
limits query i to keys i + seqlen_k - seqlen_q - left .. i + seqlen_k - seqlen_q + right, -1 leaving
a side unbounded; causal is the window's right side at 0. Windowed passes visit only the key (or
query) blocks inside the window.

Score modifications, in every pass and path: a softcap c turns the scaled scores s into c · tanh(s / c)
before the mask (``scores.py``; the backward's ds times 1 - tanh²), and sinks (heads,) add exp(sink)
to each row's softmax denominator: the forward starts its online softmax with the sink as a seen key
of value 0 (so lse includes it), the gradient passes need nothing more, and d sink = -Σ_rows exp(sink -
lse) · delta is summed by torch from the preprocess's delta; the decode pass adds the sinks in its
reduce. Off (softcap 0, sinks None), both are constexpr None and their code is not compiled.

Document masking (flash_attention's ``document_starts``, rows that pack several documents): query i
of a row sees keys first_key[i] .. i, first_key[i] its document's first column (a window's left edge
folded in by the launcher), in the dense passes' grid. first_key rises along a row, so a query tile's
keys take the sliding window's two-sided loops (``masks.py``): masked blocks from its first query's
first key, unmasked ones from its last query's first key to its first query's diagonal; the dk/dv
pass reads each key's last query instead (launch.document_last_queries, found on the device).

Packed batches (:func:`flash_attention_varlen`, flash-attn's varlen layout): q (total_q, heads,
head_dim) and k, v (total_k, kv_heads, head_dim) hold the sequences one after another, sequence b in
rows cu_seqlens[b]:cu_seqlens[b + 1]; the kernels address a sequence by its first row, with TMA by
descriptors of its rows alone that each pass builds on the device (pointers in the backward's
preprocess); the grid covers the longest sequence and tiles past a shorter one return at once.

Backward: a preprocess (delta = rowsum(dO·O) - dlse; lse in log2 units, the row statistics both
gradient passes read), a pass per key block that accumulates dk and dv over every query block and
query head of its group (under 2 programs per SM, GQA/MQA split a group's heads over programs,
float32 partials summed in a fixed order), a pass per query block for dq. No atomics: the gradients
are bit-identical run to run. Where holding dk and dv together spills (head dims 256 and 512 on sm_90), dv
and dk take a launch each of a kernel of their own (``split_outputs``), or a key block's head-dim columns
are shared among programs (``column_splits``: sm_80's at 256, every other family's at 512).

Tiles move by TMA on Hopper and newer (sm_90+): descriptors whose loads read out-of-bounds rows and
head-dim columns as zeros and whose stores drop them. Unaligned inputs (start or strides not
multiples of 16 bytes), other GPUs, ``launch.USE_TMA = False`` and table entries whose TMA tile spilled
take masked pointer loads (some at a tile of their own: ``AttnConfig.pointer``); one kernel serves
both.
Causal forward and dq passes run their longest query blocks first, so the tail is short ones.

Tiles, warps and stages come from a table per pass with an entry per GPU family (A100-class sm80,
the 99-KiB sm86 chips, Hopper sm90, datacenter Blackwell sm100, AMD's MI300 series gfx942:
``horse.kernels.runtime.ARCHS``), each compiled clean for its family's target in the compile report;
NVIDIA GPUs below compute capability 8.0 and other AMD GPUs raise.

Where each part lives, in the order a call takes them:

- ``api.py``: the public functions, their arguments validated, then the op or the reference.
- ``ops.py``: the custom ops (``torch.ops.horse.flash_attn_fwd``, ``flash_attn_bwd``) and autograd.
- ``launch.py``: the host launchers of every pass; ``launch.USE_TMA`` turns TMA off.
- ``configs.py``: :class:`~horse.kernels.attention.configs.AttnConfig` and the tables of tiles, read
  from ``configs.json`` beside it; why each entry stands: ``TUNING.md``.
- ``forward.py``, ``backward.py``, ``decode.py``: the kernels of each pass; ``masks.py`` and
  ``tiles.py``: the device helpers they share (which keys a query sees; where a tile lies);
  ``scores.py``: the softcapped scores.
"""

from horse.kernels.attention.api import (
    flash_attention,
    flash_attention_varlen,
    flash_attention_with_kvcache,
    normalize_mask,
)

__all__ = ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache", "normalize_mask"]
