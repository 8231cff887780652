"""The grouped GEMMs over the sorted rows, forward and backward, and the device helpers they share.

A row tile belongs to one expert (horse.kernels.moe.launch.row_tiles maps program to expert and first
row); a program whose tile lies past the last expert's rows returns at once, so an expert with no
rows gets no tile. Every operand is read through its strides (transposed weights in place). Rows
past an expert's last read its first row (loads need no row mask) and are not stored.
"""

import triton
import triton.language as tl

# gpt-oss's clamped SwiGLU: (clamp(up, ±limit) + 1) · g · sigmoid(ALPHA g), g = min(gate, limit)
# (transformers' GptOssExperts; its config's swiglu_alpha).
GPT_OSS_ALPHA = tl.constexpr(1.702)
GELU_TANH_2C = tl.constexpr(
    1.5957691216057308
)  # 2 sqrt(2 / pi): gelu_tanh(z) = z sigmoid(2c (z + 0.044715 z^3))


@triton.jit
def _glu_fwd(gate, up, EPILOGUE: tl.constexpr):
    """act(gate) · up for float32 tiles: SwiGLU (silu), GeGLU (gelu_tanh), or with EPILOGUE.limit
    gpt-oss's clamped SwiGLU."""
    if EPILOGUE.limit is not None:
        g = tl.minimum(gate, EPILOGUE.limit)
        u = tl.clamp(up, -EPILOGUE.limit, EPILOGUE.limit)
        h = g * tl.sigmoid(GPT_OSS_ALPHA * g) * (u + 1.0)
    elif EPILOGUE.activation == "silu":
        h = gate * tl.sigmoid(gate) * up
    else:  # gelu_tanh
        h = gate * tl.sigmoid(GELU_TANH_2C * (gate + 0.044715 * gate * gate * gate)) * up
    return h


@triton.jit
def _glu_bwd(gate, up, dh, EPILOGUE: tl.constexpr):
    """(dgate, dup, h) of h = act(gate) · up (:func:`_glu_fwd`) for the gradient dh, float32 tiles. The
    clamps pass the gradient where the value is inside them, as torch.clamp does (bounds included)."""
    if EPILOGUE.limit is not None:
        g = tl.minimum(gate, EPILOGUE.limit)
        u = tl.clamp(up, -EPILOGUE.limit, EPILOGUE.limit)
        s = tl.sigmoid(GPT_OSS_ALPHA * g)
        glu = g * s
        dglu = s + GPT_OSS_ALPHA * g * s * (1.0 - s)
        dgate = tl.where(gate <= EPILOGUE.limit, dh * (u + 1.0) * dglu, 0.0)
        dup = tl.where((up >= -EPILOGUE.limit) & (up <= EPILOGUE.limit), dh * glu, 0.0)
        h = glu * (u + 1.0)
    else:
        if EPILOGUE.activation == "silu":
            s = tl.sigmoid(gate)
            dact = s + gate * s * (1.0 - s)
        else:  # gelu_tanh
            s = tl.sigmoid(GELU_TANH_2C * (gate + 0.044715 * gate * gate * gate))
            dact = s + gate * s * (1.0 - s) * GELU_TANH_2C * (1.0 + 3 * 0.044715 * gate * gate)
        act = gate * s
        dgate = dh * up * dact
        dup = dh * act
        h = act * up
    return dgate, dup, h


@triton.jit
def _gate_up_columns(cols, N, EPILOGUE: tl.constexpr):
    """The rows of gate_up_proj (columns of dpre) of gate j and up j for j in cols: j and N + j, or
    EPILOGUE.interleaved 2j and 2j + 1 (gpt-oss)."""
    if EPILOGUE.interleaved:
        return 2 * cols, 2 * cols + 1
    return cols, N + cols


@triton.jit
def _tile_rows(tile, TILES, expert, BLOCK_M: tl.constexpr):
    """(rows, row_mask) of row tile `tile` of expert: its BLOCK_M sorted rows, those past the expert's
    last replaced by its first (loads need no mask), and which of them are the expert's."""
    _, TILE_ROW, OFFSETS = TILES
    row_start = tl.load(TILE_ROW + tile)
    row_end = tl.load(OFFSETS + expert + 1)
    offs_m = row_start + tl.arange(0, BLOCK_M)
    row_mask = offs_m < row_end
    return tl.where(row_mask, offs_m, row_start), row_mask


@triton.jit
def _expert_matmul(
    A,
    W,
    a_rows,
    w_cols,
    w_cols_up,
    K,
    a_strides,
    w_strides,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
):
    """The float32 (BLOCK_M, BLOCK_N) tiles A[a_rows] W[w_cols]ᵀ and, GATED, A[a_rows] W[w_cols_up]ᵀ
    (one pass over A, two accumulators; otherwise the second is zeros), summed over K. A is (rows, K)
    by a_strides; W is one expert's (N, K) matrix by w_strides (n, k), w_cols its rows in bounds."""
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)  # index * stride passes 2**31 (a transposed weight's column)
    a_ptrs = A + a_rows.to(tl.int64)[:, None] * a_strides[0] + offs_k[None, :] * a_strides[1]
    w_ptrs = W + w_cols.to(tl.int64)[None, :] * w_strides[0] + offs_k[:, None] * w_strides[1]
    wu_ptrs = W + w_cols_up.to(tl.int64)[None, :] * w_strides[0] + offs_k[:, None] * w_strides[1]
    a_step = tl.cast(a_strides[1], tl.int64) * BLOCK_K
    w_step = tl.cast(w_strides[1], tl.int64) * BLOCK_K
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_mask = offs_k < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_mask[None, :], other=0.0)
        acc = tl.dot(a, tl.load(w_ptrs, mask=k_mask[:, None], other=0.0), acc)
        if GATED:
            acc_up = tl.dot(a, tl.load(wu_ptrs, mask=k_mask[:, None], other=0.0), acc_up)
            wu_ptrs += w_step
        a_ptrs += a_step
        w_ptrs += w_step
    return acc, acc_up


@triton.jit
def _expert_matmul_tma(
    A,
    W,
    row_start,
    expert,
    start_n,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_LAYOUT: tl.constexpr,
):
    """The float32 (BLOCK_M, BLOCK_N) tile A[rows] W_eᵀ[:, columns] summed over K, both operands by
    TMA from the tile's first row row_start and column start_n of expert e = expert. A is a descriptor
    of (rows, K), (BLOCK_M, BLOCK_K) blocks; W one of every expert's weight as stored: W_LAYOUT "nk",
    (experts, N, K) in (1, BLOCK_N, BLOCK_K) blocks, or "kn", (experts, K, N) in (1, BLOCK_K, BLOCK_N)
    blocks. A descriptor reads what lies past a dimension's end as zeros, so the K edge needs no mask
    (an expert's K edge too: its own dimension)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = A.load([row_start, k * BLOCK_K])
        if W_LAYOUT == "kn":
            w = tl.reshape(W.load([expert, k * BLOCK_K, start_n]), (BLOCK_K, BLOCK_N))
        else:
            w = tl.trans(tl.reshape(W.load([expert, start_n, k * BLOCK_K]), (BLOCK_N, BLOCK_K)))
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit
def _gate_up_fwd_kernel(
    X,  # (tokens, K = hidden) by x_strides
    W,  # (experts, 2 N, K) gate_up_proj by w_strides (expert, row, column), gate and up rows as
    # _gate_up_columns gives them
    B,  # (experts, 2 N) gate_up_bias by b_strides, rows as W's; read when EPILOGUE.has_bias
    SORTED_PAIRS,  # (pairs,) int32: the pair (token * top_k + k) at each sorted row
    TILES,  # (TILE_EXPERT, TILE_ROW, OFFSETS) int32, launch.row_tiles' map and the sort's offsets:
    # (tiles,) each row tile's expert (experts for a tile past the last), (tiles,) its first sorted
    # row, (experts + 1,) expert e's rows are OFFSETS[e] .. OFFSETS[e + 1]
    H,  # (pairs, N = inter) contiguous, sorted rows: act(gate) · up
    GATE,  # (pairs, N) contiguous: x W_gateᵀ + b_gate; written when EPILOGUE.store
    UP,  # (pairs, N) contiguous: x W_upᵀ + b_up; written when EPILOGUE.store
    N,
    K,
    experts,
    top_k,
    x_strides,
    w_strides,
    b_strides,
    EPILOGUE: tl.constexpr,  # horse.kernels.moe.configs.Epilogue
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid = (row tiles, cdiv(N, BLOCK_N)): x's rows gathered by token, one pass for gate and up
    tile = tl.program_id(0)
    expert = tl.load(TILES[0] + tile)  # TILE_EXPERT
    if expert >= experts:
        return
    rows, row_mask = _tile_rows(tile, TILES, expert, BLOCK_M=BLOCK_M)
    tokens = tl.load(SORTED_PAIRS + rows) // top_k
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N  # columns past the edge wrap (in bounds) and are not stored
    gate_rows, up_rows = _gate_up_columns(cols, N, EPILOGUE=EPILOGUE)
    W_e = W + expert.to(tl.int64) * w_strides[0]
    gate, up = _expert_matmul(
        X,
        W_e,
        tokens,
        gate_rows,
        up_rows,
        K,
        x_strides,
        (w_strides[1], w_strides[2]),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        GATED=True,
    )
    if EPILOGUE.has_bias:
        B_e = B + expert.to(tl.int64) * b_strides[0]
        gate += tl.load(B_e + gate_rows * b_strides[1]).to(tl.float32)[None, :]
        up += tl.load(B_e + up_rows * b_strides[1]).to(tl.float32)[None, :]
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    out = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    if EPILOGUE.store:
        tl.store(GATE + out, gate.to(GATE.dtype.element_ty), mask=mask)
        tl.store(UP + out, up.to(UP.dtype.element_ty), mask=mask)
    tl.store(H + out, _glu_fwd(gate, up, EPILOGUE=EPILOGUE).to(H.dtype.element_ty), mask=mask)


@triton.jit
def _expert_gemm_kernel(
    A,  # (pairs, K) by a_strides, sorted rows; with TMA a descriptor, (BLOCK_M, BLOCK_K) blocks
    W,  # (experts, N, K) by w_strides (expert, n, k): each expert's matrix, read in place; with TMA a
    # descriptor of the weight as stored (_expert_matmul_tma's W)
    B,  # (experts, N) by b_strides; read when HAS_BIAS
    SCALE,  # (tokens * top_k,) the routing weights by pair; read when SCALE_ROWS
    SORTED_PAIRS,  # (pairs,) int32
    TILES,  # (TILE_EXPERT, TILE_ROW, OFFSETS) int32, as _gate_up_fwd_kernel's
    OUT,  # (pairs, N) contiguous, sorted rows: (A W_eᵀ + b_e) · its pair's routing weight
    N,
    K,
    experts,
    a_strides,
    w_strides,
    b_strides,
    HAS_BIAS: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TMA: tl.constexpr,  # None: pointer loads; "nk" or "kn": A and W by TMA, W stored as TMA says
):
    # grid = (row tiles, cdiv(N, BLOCK_N)): the down projection (routing weight and bias in the
    # epilogue), and the backward's dx rows (dpre W_gate_up, neither)
    tile = tl.program_id(0)
    expert = tl.load(TILES[0] + tile)  # TILE_EXPERT
    if expert >= experts:
        return
    rows, row_mask = _tile_rows(tile, TILES, expert, BLOCK_M=BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    if TMA is None:
        acc, _ = _expert_matmul(
            A,
            W + expert.to(tl.int64) * w_strides[0],
            rows,
            cols,
            cols,
            K,
            a_strides,
            (w_strides[1], w_strides[2]),
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            GATED=False,
        )
    else:  # rows past the expert's last (the next expert's, zeros past the tensor) are not stored
        row_start = tl.load(TILES[1] + tile)  # TILE_ROW
        start_n = tl.program_id(1) * BLOCK_N
        acc = _expert_matmul_tma(
            A,
            W,
            row_start,
            expert,
            start_n,
            K,
            BLOCK_M=BLOCK_M,
            BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K,
            W_LAYOUT=TMA,
        )
    if HAS_BIAS:
        acc += tl.load(B + expert.to(tl.int64) * b_strides[0] + cols * b_strides[1]).to(tl.float32)[None, :]
    if SCALE_ROWS:
        acc *= tl.load(SCALE + tl.load(SORTED_PAIRS + rows)).to(tl.float32)[:, None]
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    tl.store(OUT + rows.to(tl.int64)[:, None] * N + offs_n[None, :], acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _dh_bwd_kernel(
    DY,  # (tokens, K = hidden) by dy_strides, gathered by token
    W,  # (experts, N = inter, K): down_proj read as each expert's (N, K) by w_strides
    SCALE,  # (tokens * top_k,) the routing weights by pair
    GATE,  # (pairs, N) contiguous, sorted rows: the forward's saved pre-activations
    UP,  # (pairs, N) contiguous
    SORTED_PAIRS,  # (pairs,) int32
    TILES,  # (TILE_EXPERT, TILE_ROW, OFFSETS) int32, as _gate_up_fwd_kernel's
    DPRE,  # (pairs, 2 N) contiguous: dgate and dup in gate_up_proj's row order (_gate_up_columns)
    H,  # (pairs, N) contiguous: act(gate) · up, recomputed for dW_down
    DSCALE_PARTIAL,  # (pairs, cdiv(N, BLOCK_N)) float32: Σ h g over each column tile
    N,
    K,
    experts,
    top_k,
    dy_strides,
    w_strides,
    EPILOGUE: tl.constexpr,  # horse.kernels.moe.configs.Epilogue (store: unused)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # grid = (row tiles, cdiv(N, BLOCK_N)): g = dy[token] W_down,e; dh = weight · g; the product
    # rule and act' in the epilogue; the routing weight's gradient Σ_n h g (+ dy · b_down outside)
    # as one float32 partial per column tile, summed in a fixed order by the launcher.
    tile = tl.program_id(0)
    expert = tl.load(TILES[0] + tile)  # TILE_EXPERT
    if expert >= experts:
        return
    rows, row_mask = _tile_rows(tile, TILES, expert, BLOCK_M=BLOCK_M)
    pairs = tl.load(SORTED_PAIRS + rows)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % N
    g, _ = _expert_matmul(
        DY,
        W + expert.to(tl.int64) * w_strides[0],
        pairs // top_k,
        cols,
        cols,
        K,
        dy_strides,
        (w_strides[1], w_strides[2]),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        GATED=False,
    )
    mask = row_mask[:, None] & (offs_n < N)[None, :]
    saved = rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    gate = tl.load(GATE + saved, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(UP + saved, mask=mask, other=0.0).to(tl.float32)
    weight = tl.load(SCALE + pairs).to(tl.float32)
    dgate, dup, h = _glu_bwd(gate, up, weight[:, None] * g, EPILOGUE=EPILOGUE)
    h = h.to(H.dtype.element_ty)
    tl.store(H + saved, h, mask=mask)
    dpre = DPRE + rows.to(tl.int64)[:, None] * (2 * N)
    gate_cols, up_cols = _gate_up_columns(offs_n, N, EPILOGUE=EPILOGUE)
    tl.store(dpre + gate_cols[None, :], dgate.to(DPRE.dtype.element_ty), mask=mask)
    tl.store(dpre + up_cols[None, :], dup.to(DPRE.dtype.element_ty), mask=mask)
    dscale = tl.sum(tl.where(mask, h.to(tl.float32) * g, 0.0), axis=1)
    tiles_n = tl.num_programs(1)
    tl.store(DSCALE_PARTIAL + rows.to(tl.int64) * tiles_n + tl.program_id(1), dscale, mask=row_mask)


@triton.jit
def _weight_grad_kernel(
    A,  # (pairs or tokens, N1) by a_strides: sorted rows, or with GATHER_A each row's token
    B,  # (pairs or tokens, N2) by b_strides: sorted rows, or with GATHER_B each row's token
    SCALE,  # (tokens * top_k,) routing weights by pair, multiplying A's rows; read when SCALE_ROWS
    SORTED_PAIRS,  # (pairs,) int32
    OFFSETS,  # (experts + 1,) int32
    DW,  # (experts, N1, N2) by dw_strides: Σ over the expert's rows of (s A)ᵀ B
    DB,  # (experts, N1) by db_strides: Σ over the expert's rows of s A; written when HAS_BIAS
    sizes,  # (N1, N2, top_k)
    a_strides,
    b_strides,
    dw_strides,
    db_strides,
    GATHER_A: tl.constexpr,
    GATHER_B: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N1: tl.constexpr,
    BLOCK_N2: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    # grid = (cdiv(N1, BLOCK_N1) * cdiv(N2, BLOCK_N2), experts): each program sums its expert's rows in
    # sorted order into one output tile, the same sum on every run (no atomics); an expert with no
    # rows writes zeros.
    N1, N2, top_k = sizes
    expert = tl.program_id(1)
    tiles_n2 = tl.cdiv(N2, BLOCK_N2)
    pid_n1 = tl.program_id(0) // tiles_n2
    pid_n2 = tl.program_id(0) % tiles_n2
    offs_n1 = pid_n1 * BLOCK_N1 + tl.arange(0, BLOCK_N1)
    offs_n2 = pid_n2 * BLOCK_N2 + tl.arange(0, BLOCK_N2)
    cols_a = (offs_n1 % N1).to(tl.int64)
    cols_b = (offs_n2 % N2).to(tl.int64)
    row_start = tl.load(OFFSETS + expert)
    row_end = tl.load(OFFSETS + expert + 1)
    acc = tl.zeros((BLOCK_N1, BLOCK_N2), dtype=tl.float32)
    acc_bias = tl.zeros((BLOCK_N1,), dtype=tl.float32)
    for start in range(row_start, row_end, BLOCK_R):
        offs_r = start + tl.arange(0, BLOCK_R)
        row_mask = offs_r < row_end
        rows = tl.where(row_mask, offs_r, row_start)
        pairs = tl.load(SORTED_PAIRS + rows)
        a_rows = (pairs // top_k if GATHER_A else rows).to(tl.int64)
        b_rows = (pairs // top_k if GATHER_B else rows).to(tl.int64)
        a = tl.load(
            A + a_rows[:, None] * a_strides[0] + cols_a[None, :] * a_strides[1],
            mask=row_mask[:, None],
            other=0.0,
        )
        if SCALE_ROWS:
            a = (a.to(tl.float32) * tl.load(SCALE + pairs).to(tl.float32)[:, None]).to(A.dtype.element_ty)
        b = tl.load(B + b_rows[:, None] * b_strides[0] + cols_b[None, :] * b_strides[1])
        acc = tl.dot(tl.trans(a), b, acc)
        if HAS_BIAS:
            acc_bias += tl.sum(a.to(tl.float32), axis=0)
    expert_64 = expert.to(tl.int64)
    mask = (offs_n1 < N1)[:, None] & (offs_n2 < N2)[None, :]
    dw = DW + expert_64 * dw_strides[0] + cols_a[:, None] * dw_strides[1] + cols_b[None, :] * dw_strides[2]
    tl.store(dw, acc.to(DW.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        db = DB + expert_64 * db_strides[0] + cols_a * db_strides[1]
        tl.store(db, acc_bias.to(DB.dtype.element_ty), mask=(offs_n1 < N1) & (pid_n2 == 0))
