"""Where a tile lies: the device helpers every attention pass shares to address one (sequence, head)
of a padded (batch, seqlen, heads, head_dim) tensor or of a packed batch's (total, heads, head_dim)
one, and to load and store its tiles by TMA descriptors or by masked pointers.
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
    X, b, h, start, col, strides, seqlen, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr, MASK: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """(BLOCK_S, BLOCK_C) tile of one (sequence b, head h): rows [start, + BLOCK_S) and head-dim
    columns [col, + BLOCK_C), zero past seqlen and HEAD_DIM. With TMA, X is a descriptor of the
    whole (batch, seqlen, heads, head_dim) tensor, whose loads fill out-of-bounds elements with
    zeros; otherwise X is the tensor's pointer and strides its (batch, seqlen, heads) strides, and
    rows are masked only with MASK (a block that may cross seqlen)."""
    if TMA:
        tile = X.load([b, start, h, col]).reshape(BLOCK_S, BLOCK_C)
    else:
        offs_s = start + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = offs_c[None, :] < HEAD_DIM
        if MASK:
            mask = mask & (offs_s[:, None] < seqlen)
        # 64-bit: batch * stride, and row * stride in a long sequence or a wide view, pass 2**31.
        base = X + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tile = tl.load(base + rows + offs_c[None, :], mask=mask, other=0.0)
    return tile


@triton.jit
def _store_tile(
    X, tile, b, h, start, col, strides, seqlen, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr, TMA: tl.constexpr,
):  # fmt: skip
    """Stores a (BLOCK_S, BLOCK_C) float32 tile where :func:`_load_tile` reads it, in X's dtype,
    dropping what lies past seqlen and HEAD_DIM."""
    if TMA:
        X.store([b, start, h, col], tile.to(X.dtype).reshape(1, BLOCK_S, 1, BLOCK_C))
    else:
        offs_s = start + tl.arange(0, BLOCK_S)
        offs_c = col + tl.arange(0, BLOCK_C)
        mask = (offs_s[:, None] < seqlen) & (offs_c[None, :] < HEAD_DIM)
        base = X + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[2]
        rows = offs_s.to(tl.int64)[:, None] * strides[1]
        tl.store(base + rows + offs_c[None, :], tile.to(X.dtype.element_ty), mask=mask)


@triton.jit
def _sequence_descriptor(
    X, first_row, seqlen, heads, strides, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """A TMA descriptor, built on the device, of one sequence of a packed (total, heads, head_dim)
    tensor: its rows [first_row, + seqlen) as a (1, seqlen, heads, HEAD_DIM) tensor that
    :func:`_load_tile` and :func:`_store_tile` address as sequence 0. Bounded by the sequence, its
    loads past the end read zeros and its stores there are dropped, so a tile never touches the next
    sequence's rows (a descriptor of the whole packed tensor would). strides are X's (row, row,
    head) strides, as :func:`_strides` gives a packed tensor's; the launch needs Triton's allocator
    for the descriptors' global memory (runtime.launch_building_descriptors)."""
    return tl.make_tensor_descriptor(
        X + first_row.to(tl.int64) * strides[1],
        shape=[1, seqlen, heads, HEAD_DIM],
        strides=[strides[0], strides[1], strides[2], 1],
        block_shape=[1, BLOCK_S, 1, BLOCK_C],
    )
