"""Where a tile lies: the device helpers every attention pass shares to address one (sequence, head)
of a padded (batch, seqlen, heads, head_dim) tensor or of a packed batch's (total, heads, head_dim)
one, and to load and store its tiles by TMA descriptors or by masked pointers.

A pass hands them a view of one sequence of a tensor, ``(X, seq, strides, seqlen)``: X the tensor's
pointer, or with TMA a descriptor of it; seq the sequence's index in X (the batch index; a packed
sequence's first row, the launcher passing the row stride as the batch stride; 0 in a descriptor of
the sequence alone, :func:`_sequence_view`); strides X's (batch, seqlen, heads) strides; seqlen the
rows of the sequence, past which loads read zeros and stores are dropped. A tile of the view is
addressed by its head, its first row and its first head-dim column.
"""

import triton
import triton.language as tl


@triton.jit
def _sequence(CU_SEQLENS, b, seqlen, VARLEN: tl.constexpr):
    """(seq, seqlen) of batch entry b. seq addresses its tiles: the batch index, or with VARLEN its
    first row in the packed tensor (cu_seqlens[b]; the launcher passes the row stride as the batch
    stride), seqlen then cu_seqlens[b + 1] - cu_seqlens[b]."""
    seq = b
    if VARLEN:
        seq = tl.load(CU_SEQLENS + b)
        seqlen = tl.load(CU_SEQLENS + b + 1) - seq
    return seq, seqlen


@triton.jit
def _load_tile(
    view,
    head,
    row,
    col,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    MASK_ROWS: tl.constexpr,
    TMA: tl.constexpr,
):
    """(BLOCK_S, BLOCK_C) tile of view's head: rows [row, + BLOCK_S) and head-dim columns [col, +
    BLOCK_C), zero past seqlen and HEAD_DIM. A descriptor (TMA) fills out-of-bounds elements with zeros;
    with pointers rows are masked only with MASK_ROWS (a block that may cross seqlen)."""
    X, seq, strides, seqlen = view
    if TMA:
        tile = X.load([seq, row, head, col]).reshape(BLOCK_S, BLOCK_C)
    else:
        offs_s = row + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = offs_c[None, :] < HEAD_DIM
        if MASK_ROWS:
            mask = mask & (offs_s[:, None] < seqlen)
        # 64-bit: batch * stride, and row * stride in a long sequence or a wide view, pass 2**31.
        base = X + seq.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tile = tl.load(base + rows + offs_c[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _store_tile(
    view,
    tile,
    head,
    row,
    col,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
    TMA: tl.constexpr,
):
    """Stores a (BLOCK_S, BLOCK_C) float32 tile where :func:`_load_tile` reads it, in X's dtype,
    dropping what lies past seqlen and HEAD_DIM."""
    X, seq, strides, seqlen = view
    if TMA:
        X.store([seq, row, head, col], tile.to(X.dtype).reshape(1, BLOCK_S, 1, BLOCK_C))
    else:
        offs_s = row + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = (offs_s[:, None] < seqlen) & (offs_c[None, :] < HEAD_DIM)
        base = X + seq.to(tl.int64) * strides[0] + head.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tl.store(base + rows + offs_c[None, :], tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _sequence_view(view, heads, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    """view, of a packed (total, heads, head_dim) tensor, over a TMA descriptor built on the device of
    its sequence alone: rows [seq, + seqlen) as a (1, seqlen, heads, HEAD_DIM) tensor, addressed as
    sequence 0. Bounded by the sequence, its loads past the end read zeros and its stores there are
    dropped, so a tile never touches the next sequence's rows (a descriptor of the whole packed tensor
    would). The launch needs Triton's allocator for the descriptors' global memory
    (runtime.launch_building_descriptors)."""
    X, first_row, strides, seqlen = view
    descriptor = tl.make_tensor_descriptor(
        X + first_row.to(tl.int64) * strides[1],
        shape=[1, seqlen, heads, HEAD_DIM],
        strides=[strides[0], strides[1], strides[2], 1],
        block_shape=[1, BLOCK_S, 1, BLOCK_C],
    )
    return descriptor, 0, strides, seqlen
