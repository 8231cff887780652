"""Which keys a query sees, in blocks: the device helpers every attention pass shares to walk the
key (or query) blocks of a tile and to mask the scores of the blocks that cross the causal
diagonal, a sliding window's edges or the end of the sequence.

The passes hand them the sequence lengths as ``seqlens``, (seqlen_q, seqlen_k), and the window as
``window``, (left, right): query i sees keys i + seqlen_k - seqlen_q - left to i + seqlen_k -
seqlen_q + right (the launchers make an unbounded side reach past every key).

Document masking (causal, seqlen_q = seqlen_k): query i sees keys first_key[i] to i, first_key[i] its
document's first column (the launcher folds a window's left edge in); first_key never decreases along
a row, so a query tile's keys run from its first query's first key to its last query's diagonal,
and the keys from its last query's first key to its first query's diagonal are seen by all of it:
the sliding window's two-sided structure, its left edge per query.
"""

import triton
import triton.language as tl


@triton.jit
def _key_range(
    start_m,
    seqlens,
    window,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    LOCAL: tl.constexpr,
    first_keys=None,
):
    """Keys a query block [start_m, start_m + BLOCK_M) attends to, in key blocks from start:
    [unmasked_start, unmasked_end) are visible to every query of the block; [start, unmasked_start)
    (only with LOCAL or documents: the window's left edge, see :func:`_local_masked_blocks`) and
    [unmasked_end, end) (the causal diagonal or the window's right edge, and the ragged last key
    block) need the mask. first_keys (None: no documents) is the first key of the block's first
    query and of its last (the module's document masking), whose keys are then a causal block's with
    a left edge: the loops take them as LOCAL's."""
    seqlen_q, seqlen_k = seqlens
    window_left, window_right = window
    causal_offset = seqlen_k - seqlen_q
    start = 0
    unmasked_start = 0
    if first_keys is not None:
        first_key_of_first, first_key_of_last = first_keys
        start = first_key_of_first // BLOCK_N * BLOCK_N
        end = tl.minimum(seqlen_k, start_m + BLOCK_M)
        unmasked_start = tl.maximum(tl.cdiv(first_key_of_last, BLOCK_N) * BLOCK_N, start)
        unmasked_end = tl.maximum(tl.minimum(start_m + 1, end) // BLOCK_N * BLOCK_N, unmasked_start)
    elif LOCAL:
        start = tl.maximum(start_m + causal_offset - window_left, 0) // BLOCK_N * BLOCK_N
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset + window_right)
        # Keys from the last query's left edge to the first query's right edge are seen by all.
        first_seen_by_all = tl.maximum(start_m + BLOCK_M - 1 + causal_offset - window_left, 0)
        unmasked_start = tl.maximum(tl.cdiv(first_seen_by_all, BLOCK_N) * BLOCK_N, start)
        last_seen_by_all = tl.minimum(start_m + causal_offset + window_right + 1, seqlen_k)
        unmasked_end = tl.maximum(tl.maximum(last_seen_by_all, 0) // BLOCK_N * BLOCK_N, unmasked_start)
    elif CAUSAL:
        end = tl.minimum(seqlen_k, start_m + BLOCK_M + causal_offset)
        # Keys up to start_m + causal_offset are visible to every query of the block.
        unmasked_end = tl.maximum(tl.minimum(start_m + causal_offset + 1, end), 0) // BLOCK_N * BLOCK_N
    else:
        end = seqlen_k
        unmasked_end = seqlen_k // BLOCK_N * BLOCK_N
    return start, unmasked_start, unmasked_end, end


@triton.jit
def _local_masked_blocks(start, unmasked_start, unmasked_end, end, BLOCK_N: tl.constexpr):
    """With LOCAL, the key blocks that need the mask lie on both sides of the unmasked ones: how
    many there are, and how many of them come before (from start). One loop takes both sides, as
    :func:`_masked_key_block` numbers them: a third loop spilled registers on sm_90."""
    before = tl.cdiv(tl.maximum(tl.minimum(unmasked_start, end) - start, 0), BLOCK_N)
    return before + tl.cdiv(tl.maximum(end - unmasked_end, 0), BLOCK_N), before


@triton.jit
def _masked_key_block(i, blocks, BLOCK_N: tl.constexpr):
    """Start of the i-th masked key block of :func:`_local_masked_blocks`; blocks is
    :func:`_key_loop`'s (start, before, unmasked_end)."""
    start, before, unmasked_end = blocks
    return tl.where(i < before, start + i * BLOCK_N, unmasked_end + (i - before) * BLOCK_N)


@triton.jit
def _key_loop(keys, masked: tl.constexpr, BLOCK_N: tl.constexpr, LOCAL: tl.constexpr):
    """(lo, hi, step, blocks) of a query block's loop over its unmasked key blocks (masked 0) or its
    masked ones (1) of :func:`_key_range`'s keys: key block starts, or with LOCAL and masked the
    masked blocks' numbers, which :func:`_masked_key_block` turns into starts. A pass calls it once
    per loop (``tl.static_range(2)``: two compiled loops), the masked count after the unmasked loop,
    so it is not live through it; and _key_range once, before both (called in here it took more
    registers: TUNING.md)."""
    start, unmasked_start, unmasked_end, end = keys
    lo, hi, step, before = unmasked_start, unmasked_end, BLOCK_N, 0
    if masked:
        lo, hi = unmasked_end, end
    if masked and LOCAL:
        lo, step = 0, 1
        hi, before = _local_masked_blocks(start, unmasked_start, unmasked_end, end, BLOCK_N=BLOCK_N)
    return lo, hi, step, (start, before, unmasked_end)


@triton.jit
def _in_window(q_pos, k_pos, causal_offset, window, LOCAL: tl.constexpr):
    """Whether query q_pos sees key k_pos (broadcast shapes) under the causal mask, or with LOCAL
    the sliding window; keys past seqlen_k are the caller's to mask."""
    window_left, window_right = window
    diagonal = q_pos + causal_offset
    if LOCAL:
        visible = (k_pos >= diagonal - window_left) & (k_pos <= diagonal + window_right)
    else:
        visible = k_pos <= diagonal
    return visible


@triton.jit
def _visible(offs_m, offs_n, seqlen_k, causal_offset, window, CAUSAL: tl.constexpr, LOCAL: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask of the scores query offs_m may give key offs_n."""
    visible = offs_n[None, :] < seqlen_k
    if CAUSAL or LOCAL:
        in_window = _in_window(
            q_pos=offs_m[:, None],
            k_pos=offs_n[None, :],
            causal_offset=causal_offset,
            window=window,
            LOCAL=LOCAL,
        )
        visible = visible & in_window
    return visible


@triton.jit
def _causal_scores(
    qk, offs, start, causal_offset, BLOCK: tl.constexpr, TRANSPOSED: tl.constexpr, INLINE_PTX: tl.constexpr
):
    """qk (queries offs x keys start + j) with -inf where the key lies past the query's diagonal; with
    TRANSPOSED, qk (keys offs x queries start + j) with -inf where the query comes before the key's
    first visible one. Keys past seqlen_k need no test: a query before seqlen_q sees none (j <= i +
    seqlen_k - seqlen_q) and the rows past seqlen_q are never stored. The column is the tile's index,
    the row's limit one subtraction: one compare and one select per score. LLVM's SLP vectorizer
    packs the compares into bit vectors (tens of extra instructions an iteration); INLINE_PTX
    (NVIDIA) writes each pair as PTX it cannot pack (TUNING.md)."""
    cols = tl.arange(0, BLOCK)[None, :]
    if TRANSPOSED:
        limit = (offs - (causal_offset + start))[:, None]  # the key's first visible query
    else:
        limit = (offs + (causal_offset - start))[:, None]  # the query's last visible key
    if INLINE_PTX:
        qk = tl.inline_asm_elementwise(
            "{ .reg .pred hidden; setp." + ("lt" if TRANSPOSED else "gt") + ".s32 hidden, $2, $3; "
            "selp.f32 $0, 0fFF800000, $1, hidden; }",
            "=r,r,r,r",
            [qk, cols, limit],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        qk = tl.where((cols >= limit) if TRANSPOSED else (cols <= limit), qk, float("-inf"))
    return qk


@triton.jit
def _document_first_keys(FIRST_KEYS, b, start_m, offs_m, seqlen_q, BLOCK_M: tl.constexpr):
    """Document masking's first keys of a query tile (row b of FIRST_KEYS, (batch, seqlen_q) int32):
    its queries offs_m's, for the block's mask, and (its first query's, its last query's), for
    :func:`_key_range`."""
    row_first_keys = FIRST_KEYS + b.to(tl.int64) * seqlen_q
    first_keys = tl.load(row_first_keys + offs_m, mask=offs_m < seqlen_q, other=0)
    last_m = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    return first_keys, (tl.load(row_first_keys + start_m), tl.load(row_first_keys + last_m))


@triton.jit
def _document_scores(qk, offs_m, offs_n, first_keys, fill):
    """qk (queries offs_m x keys offs_n) with fill where the key lies outside the query's document's
    keys up to its own, first_keys (BLOCK_M,) to offs_m (document masking)."""
    visible = (offs_n[None, :] <= offs_m[:, None]) & (offs_n[None, :] >= first_keys[:, None])
    return tl.where(visible, qk, fill)


@triton.jit
def _document_scores_transposed(qk_t, offs_n, offs_m, last_queries, fill):
    """qk_t (keys offs_n x queries offs_m) with fill where the query lies outside the queries that see
    the key: from the key to last_queries (BLOCK_N,), its document's last query (document masking)."""
    visible = (offs_m[None, :] >= offs_n[:, None]) & (offs_m[None, :] <= last_queries[:, None])
    return tl.where(visible, qk_t, fill)
