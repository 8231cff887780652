"""The host launchers, on inputs the public functions have validated: each picks its config, allocates,
launches the forward or backward kernels and runs the plain GEMMs (dx, dW, the down projection) on
cuBLAS. No autograd here: ops.py binds these.
"""

import torch
import triton

from horse.kernels import reference, runtime
from horse.kernels.mlp import configs
from horse.kernels.mlp.backward import _act_bwd_kernel, _dh_act_bwd_kernel
from horse.kernels.mlp.configs import ACT_BWD_CONFIG, SPLIT_K_EPILOGUE_WARPS, Epilogue, GemmConfig
from horse.kernels.mlp.forward import _fwd_kernel, _fwd_persistent_kernel, _split_k_epilogue_kernel
from horse.kernels.runtime import Plan, inline_ptx

# Operand tiles by TMA where tma_usable allows; False sends every GEMM down the pointer path (the
# bench's "ours-pointer" row measures the difference).
USE_TMA = True


def _grid(cfg: GemmConfig, M: int, N: int, splits: int = 1) -> tuple[int, ...]:
    tiles = configs.output_tiles(cfg, M, N)
    return (tiles,) if splits == 1 else (tiles, splits)


# Each GEMM's operands loaded by TMA, with their blocks' dims: m, n, k, and s, an epilogue subtile's
# columns (block_n // epilogue_split). The persistent forward also stores its outputs by TMA; the dh
# GEMM reads W_out as stored, (block_k, block_n) tiles, as a descriptor needs its unit stride last.
FWD_TILES = {"X": "mk", "W": "nk", "WU": "nk"}
PERSISTENT_TILES = FWD_TILES | {"Y": "ms", "PRE": "ms", "UP": "ms"}
DH_TILES = {"DY": "mk", "W": "kn"}


def _gemm_plan(kernel, grid, cfg: GemmConfig, epilogue: Epilogue, tiles: dict, **constexprs) -> Plan:
    """A GEMM kernel's plan with table entry cfg, the operands in tiles loaded by TMA (none: pointer
    loads). The epilogue split travels in the kernel's Epilogue."""
    blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m)
    dims = dict(m=cfg.block_m, n=cfg.block_n, k=cfg.block_k, s=cfg.block_n // cfg.epilogue_split)
    descriptors = {a: tuple(dims[d] for d in block) for a, block in tiles.items()}
    constexprs = dict(EPILOGUE=epilogue) | blocks | constexprs
    return Plan(kernel, grid, constexprs, cfg.num_warps, cfg.num_stages, descriptors=descriptors)


def fwd_plan(
    cfg: GemmConfig,
    M: int,
    N: int,
    epilogue: Epilogue,
    tma: bool,
    splits: int,
    persistent: bool,
    num_sms: int,
) -> Plan:
    """The forward GEMM's plan with table entry cfg for an (M, N) output, by TMA or pointer loads: its
    K loop split over splits programs a tile (float32 partials: :func:`split_k_epilogue_plan`), or
    persistent, one program an SM of num_sms (or one a tile if fewer) walking the tiles."""
    if persistent:
        programs = min(configs.output_tiles(cfg, M, N), num_sms)
        return _gemm_plan(_fwd_persistent_kernel, (programs,), cfg, epilogue, PERSISTENT_TILES)  # TMA only
    grid = _grid(cfg, M, N, splits)
    tiles = FWD_TILES if tma else {}
    return _gemm_plan(_fwd_kernel, grid, cfg, epilogue, tiles, SPLIT_K=splits > 1, TMA=tma)


def split_k_epilogue_plan(cfg: GemmConfig, M: int, N: int, epilogue: Epilogue) -> Plan:
    """The plan of the split-K forward's epilogue (the partials' sum, then the forward's epilogue,
    unsplit), in the GEMM's tiles."""
    constexprs = dict(EPILOGUE=epilogue._replace(split=1), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    grid = (triton.cdiv(N, cfg.block_n), triton.cdiv(M, cfg.block_m))
    return Plan(_split_k_epilogue_kernel, grid, constexprs, SPLIT_K_EPILOGUE_WARPS, num_stages=1)


def dh_plan(cfg: GemmConfig, M: int, N: int, epilogue: Epilogue, tma: bool) -> Plan:
    """The dh GEMM's plan (dh = dy W_out, act' in its epilogue) with table entry cfg for an (M, N) dh."""
    tiles = DH_TILES if tma else {}
    return _gemm_plan(_dh_act_bwd_kernel, _grid(cfg, M, N), cfg, epilogue, tiles, TMA=tma)


def act_bwd_plan(M: int, N: int, epilogue: Epilogue, num_sms: int) -> tuple[Plan, int]:
    """(plan, rows_per_program) of the elementwise backward of an (M, N) pre-activation: enough slabs of
    rows to fill num_sms SMs, a program per slab's column block, each summing its own rows of db
    (float32, fixed order)."""
    cfg = ACT_BWD_CONFIG
    column_blocks = triton.cdiv(N, cfg.block_n)
    slabs = max(1, 4 * num_sms // max(1, column_blocks))
    rows_per_program = triton.cdiv(triton.cdiv(max(M, 1), slabs), cfg.block_m) * cfg.block_m
    grid = (column_blocks, triton.cdiv(M, rows_per_program))
    constexprs = dict(EPILOGUE=epilogue, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    return Plan(_act_bwd_kernel, grid, constexprs, cfg.num_warps, num_stages=1), rows_per_program


def _persistent(cfg: GemmConfig, tma: bool, splits: int, y: torch.Tensor) -> bool:
    """Whether a forward runs its persistent kernel: the entry says so, the operands take TMA, the K
    loop is not split, and the outputs (y's shape, all contiguous) take TMA stores: rows of a
    multiple of 16 bytes."""
    return cfg.persistent and tma and splits == 1 and runtime.tma_compatible(y)


def _output_tiles(plan: Plan, *outputs: torch.Tensor) -> list:
    """Descriptors of the (M, N) outputs Y, PRE, UP for the persistent kernel's epilogue subtiles; an
    empty output (pre not saved) gets the first one's, which the kernel does not write."""
    named = zip(("Y", "PRE", "UP"), outputs, strict=True)
    tiles = [plan.operand(name, t) if t.numel() else None for name, t in named]
    return [t if t is not None else tiles[0] for t in tiles]


def tma_usable(cfg: GemmConfig, *operands: torch.Tensor) -> bool:
    """Whether a GEMM with cfg loads its operand tiles by TMA: ``USE_TMA`` and the table entry allow
    it and :func:`runtime.tma_compatible` holds for every operand as stored (K not a multiple of 8 in
    half precision, unaligned views and transposed weights take the pointer path)."""
    return USE_TMA and cfg.tma and runtime.tma_compatible(*operands)


def _stores_pre(activation: str, save_pre: bool) -> bool:
    # act' of "none" is 1: its backward needs no pre-activation.
    return save_pre and activation != "none"


def _fwd_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    w_up: torch.Tensor | None,
    bias: torch.Tensor | None,
    activation: str,
    store_pre: bool,
    entry: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """act(x Wᵀ + b), or with w_up (weight is then W_gate, no bias) act(x W_gateᵀ) ⊙ x W_upᵀ in one
    pass over x with two accumulators. Returns (y, pre, up), each (M, N) in x's dtype: pre = x Wᵀ + b
    (the gate), up = x W_upᵀ (pre again without w_up), both empty unless store_pre. entry: the config
    to launch with instead of the table's (bench.tune's candidates)."""
    M, K = x.shape
    N = weight.shape[0]
    gated = w_up is not None
    if gated and w_up.stride() != weight.stride():  # the pointer path walks both with one set of strides
        weight, w_up = weight.contiguous(), w_up.contiguous()
    y = runtime.empty((M, N), x.dtype, x.device)
    pre = runtime.empty((M, N) if store_pre else (0,), x.dtype, x.device)
    up = runtime.empty((M, N) if store_pre else (0,), x.dtype, x.device) if gated else pre
    if M == 0 or N == 0:
        return y, pre, up
    cfg = entry or configs.gemm_config("gated_fwd" if gated else "fwd", M, N, x.device)
    tma = tma_usable(cfg, x, weight, *([w_up] if gated else []))
    b = bias if bias is not None else x if gated else weight  # a dummy pointer without a bias
    epilogue = Epilogue(
        activation,
        gated,
        has_bias=bias is not None,
        store=store_pre,
        split=cfg.epilogue_split,
        inline_ptx=inline_ptx(x),
    )
    splits = configs.split_k(cfg, M, N, K, x.device)
    persistent = _persistent(cfg, tma, splits, y)
    # The persistent kernel takes one program an SM (runtime.num_sms: the interpreter's stand-in is 4).
    plan = fwd_plan(cfg, M, N, epilogue, tma, splits, persistent, runtime.num_sms(x.device))
    x_tiles, w_tiles = plan.operand("X", x), plan.operand("W", weight)
    wu_tiles = plan.operand("WU", w_up) if gated else w_tiles
    partial = runtime.empty(((1 + gated) * splits, M, N) if splits > 1 else (0,), torch.float32, x.device)
    with runtime.device_guard(x):
        if persistent:
            runtime.launch(
                plan.kernel, plan.grid,
                x_tiles, w_tiles, wu_tiles, b, *_output_tiles(plan, y, pre, up), M, N, K,
                **plan.options(), **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
        else:
            runtime.launch(
                plan.kernel, plan.grid,
                x_tiles, w_tiles, wu_tiles, b, y, pre, up, partial, M, N, K, x.stride(), weight.stride(),
                **plan.options(), **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
        if splits > 1:  # the epilogue, after the float32 partials' sum in split order, in the GEMM's tiles
            reduce = split_k_epilogue_plan(cfg, M, N, epilogue)
            runtime.launch(
                reduce.kernel, reduce.grid,
                partial, bias if bias is not None else y, y, pre, up, M, N, splits,
                **reduce.options(), **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
    return y, pre, up


def _db(partial: torch.Tensor, has_bias: bool, dtype: torch.dtype) -> torch.Tensor:
    # Stage two of the bias gradient: a fixed-order sum over the row tiles' float32 partials. Without
    # a bias, an empty tensor of the parameters' dtype all the same (the fake kernel's).
    return (partial.sum(0) if has_bias else partial).to(dtype)


def _pre_grads(M: int, N: int, gated: bool, like: torch.Tensor):
    """(dpre, dpre's rows, dup's rows, their row stride): where the backward kernels write the
    gradient of the pre-activation. Gated, dpre is one (M, 2N) buffer [dgate | dup] whose halves
    the kernels write, so that dW_gate and dW_up are one GEMM (:func:`_gated_input_grads`);
    otherwise (M, N), and dup's rows an empty tensor."""
    dpre = runtime.empty((M, 2 * N if gated else N), like.dtype, like.device)
    if not gated:
        return dpre, dpre, runtime.empty((0,), like.dtype, like.device), N
    return dpre, dpre[:, :N], dpre[:, N:], 2 * N


def _dh_act_bwd(
    dy: torch.Tensor,
    w_out: torch.Tensor,
    pre: torch.Tensor,
    up: torch.Tensor | None,
    activation: str,
    has_bias: bool,
    need_h: bool = True,
    entry: GemmConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dh = dy W_out in a GEMM whose epilogue applies act' (and the gate's product rule).

    Returns (dpre, h, db): dpre (M, N), or gated (up given) (M, 2N), [dgate | dup]; h, the hidden
    activation recomputed from pre (M, N), or pre itself for ``none`` (empty unless need_h: only
    the gradient of W_out uses it); db (N,) or empty. entry: the config to launch with instead of
    the table's (bench.tune's candidates).
    """
    M, N = pre.shape
    K = dy.shape[1]
    gated = up is not None
    store_h = need_h and (gated or activation != "none")
    dpre, dpre_rows, dup_rows, stride_dpre = _pre_grads(M, N, gated, pre)
    h = runtime.empty((M, N), pre.dtype, pre.device) if store_h else pre if need_h else pre[:0]
    cfg = entry or configs.gemm_config("gated_dh_bwd" if gated else "dh_bwd", M, N, pre.device)
    db_partial = runtime.empty(
        (triton.cdiv(M, cfg.block_m), N) if has_bias else (0,), torch.float32, pre.device
    )
    if M > 0 and N > 0:
        epilogue = Epilogue(
            activation,
            gated,
            has_bias=has_bias,
            store=store_h,
            split=cfg.epilogue_split,
            inline_ptx=inline_ptx(pre),
        )
        w = w_out.t()  # (N, K) view of the (K, N) weight: dh = dy (w_outᵀ)ᵀ, read in place
        tma = tma_usable(cfg, dy, w_out)
        plan = dh_plan(cfg, M, N, epilogue, tma)
        w_tiles = plan.operand("W", w_out) if tma else w
        with runtime.device_guard(pre):
            runtime.launch(
                plan.kernel, plan.grid,
                plan.operand("DY", dy), w_tiles, pre, up if gated else pre, dpre_rows, dup_rows, h,
                db_partial, M, N, K, dy.stride(), w.stride(), stride_dpre,
                **plan.options(), **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
    return dpre, h, _db(db_partial, has_bias, pre.dtype)


def _act_bwd(
    dh: torch.Tensor, pre: torch.Tensor, up: torch.Tensor | None, activation: str, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The elementwise backward of act (or of act(gate) ⊙ up): (dpre, db or empty), dpre as
    :func:`_pre_grads` lays it out."""
    M, N = pre.shape
    gated = up is not None
    epilogue = Epilogue(activation, gated, has_bias, store=False)
    plan, rows_per_program = act_bwd_plan(M, N, epilogue, runtime.num_sms(pre.device))
    dpre, dpre_rows, dup_rows, stride_dpre = _pre_grads(M, N, gated, pre)
    db_partial = runtime.empty((plan.grid[1], N) if has_bias else (0,), torch.float32, pre.device)
    if M > 0 and N > 0:
        with runtime.device_guard(pre):
            runtime.launch(
                plan.kernel, plan.grid,
                dh, pre, up if gated else pre, dpre_rows, dup_rows, db_partial, M, N, rows_per_program,
                dh.stride(), stride_dpre, **plan.options(), **runtime.COMPILE_OPTIONS,
            )  # fmt: skip
    return dpre, _db(db_partial, has_bias, pre.dtype)


def _input_grads(dpres, x: torch.Tensor | None, weights, needs: list[bool]) -> list[torch.Tensor]:
    """[dx = Σ dpre_i W_i, dW_i = dpre_iᵀ x ...] for the layers (dpre_i, W_i) that read x: plain GEMMs,
    cuBLAS's (nothing to fuse; torch.matmul reads any strides). needs[0] says whether dx is wanted,
    needs[1 + i] whether dW_i is: an input or a weight that needs no gradient (frozen weights,
    LoRA) gets an empty tensor and no GEMM, and x is saved (not None) only when some dW_i is wanted."""
    dx = dpres[0].new_empty((0,))  # a new empty tensor each: an op's outputs may not alias
    if needs[0]:
        for i, (dpre, weight) in enumerate(zip(dpres, weights, strict=True)):
            dx = torch.matmul(dpre, weight) if i == 0 else torch.addmm(dx, dpre, weight)
    pairs = zip(dpres, needs[1:], strict=True)
    return [dx, *(torch.matmul(dpre.t(), x) if need else dpre.new_empty((0,)) for dpre, need in pairs)]


def _gated_input_grads(dgate_up: torch.Tensor, x, w_gate, w_up, needs: list[bool]):
    """(dx, dW_gate|up) from dgate_up (M, 2N) = [dgate | dup]: dx = dgate W_gate + dup W_up, two
    cuBLAS GEMMs reading the halves in place; with both weights training, [dW_gate; dW_up] =
    [dgate | dup]ᵀ x in ONE GEMM of 2N rows, returned stacked (2N, K) (an op's outputs may not
    alias, so :func:`_split_gate_up` splits it outside the op); with one, that weight's (N, K); with
    neither, an empty tensor. One GEMM of 2N rows instead of two of N: half the launches and a
    single pass over x, the tiles of both halves in one grid."""
    N = w_gate.shape[0]
    dgate, dup = dgate_up[:, :N], dgate_up[:, N:]
    dx = _input_grads([dgate, dup], x, [w_gate, w_up], [needs[0], False, False])[0]
    rows = dgate_up if needs[1] and needs[2] else dgate if needs[1] else dup if needs[2] else None
    return dx, dgate_up.new_empty((0,)) if rows is None else torch.matmul(rows.t(), x)


def _split_gate_up(dw_gate_up: torch.Tensor, needs: list[bool]) -> tuple:
    """(dW_gate, dW_up) from :func:`_gated_input_grads`' result; None where needs says no gradient."""
    if needs[0] and needs[1]:
        return tuple(dw_gate_up.tensor_split(2))  # two empty halves when N = 0
    return (dw_gate_up, None) if needs[0] else (None, dw_gate_up if needs[1] else None)


def linear_act_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of :func:`linear_act` on validated (M, K) input: (y, pre or an empty tensor)."""
    y, pre, _ = _fwd_gemm(x, weight, None, bias, activation, _stores_pre(activation, save_pre))
    return y, pre


def linear_act_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    pre: torch.Tensor,
    has_bias: bool,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`linear_act_fwd`: (dx, dweight, dbias), each an empty tensor where not
    wanted (needs: dx, dweight; has_bias: dbias); x may then be None (see :func:`_input_grads`)."""
    if activation == "none":
        dpre = dy
        db = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_bias else dy.new_empty((0,))
    else:
        dpre, db = _act_bwd(dy, pre, None, activation, has_bias)
    return *_input_grads([dpre], x, [weight], needs), db


def gated_linear_fwd(
    x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, activation: str, save_pre: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`gated_linear` on validated (M, K) input: (y, gate, up), the last two empty
    unless save_pre."""
    return _fwd_gemm(x, w_gate, w_up, None, activation, save_pre)


def gated_linear_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_linear_fwd`: (dx, dw_gate|up) as :func:`_gated_input_grads` returns
    them, empty where needs (dx, dw_gate, dw_up) says not wanted."""
    dgate_up, _ = _act_bwd(dy, gate, up, activation, has_bias=False)
    return _gated_input_grads(dgate_up, x, w_gate, w_up, needs)


def _down_proj(h: torch.Tensor, w_out: torch.Tensor, b_out: torch.Tensor | None) -> torch.Tensor:
    # cuBLAS, with the bias in its epilogue: a plain GEMM has nothing for us to fuse.
    return torch.matmul(h, w_out.t()) if b_out is None else torch.addmm(b_out, h, w_out.t())


def _out_grads(dy: torch.Tensor, h: torch.Tensor, has_b_out: bool, need_dw: bool):
    """(dW_out = dyᵀ h or empty unless need_dw, db_out = Σ_rows dy or empty): cuBLAS, and one float32
    reduction over dy."""
    db_out = dy.sum(0, dtype=torch.float32).to(dy.dtype) if has_b_out else dy.new_empty((0,))
    return torch.matmul(dy.t(), h) if need_dw else dy.new_empty((0,)), db_out


def fused_mlp_fwd(
    x: torch.Tensor,
    w_in: torch.Tensor,
    b_in: torch.Tensor | None,
    w_out: torch.Tensor,
    b_out: torch.Tensor | None,
    activation: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward of :func:`fused_mlp` on validated (M, K) input: (y, pre).

    pre is what the backward needs: the pre-activation (for ``none``, h itself), or an empty tensor
    unless save_pre.
    """
    store_pre = _stores_pre(activation, save_pre)
    h, pre, _ = _fwd_gemm(x, w_in, None, b_in, activation, store_pre)
    if save_pre and not store_pre:
        pre = h  # "none": h is the pre-activation
    return _down_proj(h, w_out, b_out), pre


def fused_mlp_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    pre: torch.Tensor,
    has_b_in: bool,
    has_b_out: bool,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`fused_mlp_fwd`: (dx, dw_in, db_in, dw_out, db_out); what needs (dx, dw_in,
    dw_out) or has_b_in / has_b_out leave out is an empty tensor, and costs no GEMM."""
    if needs[0] or needs[1] or has_b_in:
        dpre, h, db_in = _dh_act_bwd(dy, w_out, pre, None, activation, has_b_in, need_h=needs[2])
        dx, dw_in = _input_grads([dpre], x, [w_in], needs[:2])
    else:  # only W_out and b_out train: no dh GEMM, h recomputed elementwise where dW_out needs it
        dx, dw_in, db_in = (dy.new_empty((0,)) for _ in range(3))  # outputs may not alias
        h = reference.apply_activation(pre.float(), activation).to(pre.dtype) if needs[2] else dx
    return dx, dw_in, db_in, *_out_grads(dy, h, has_b_out, needs[2])


def gated_mlp_fwd(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    activation: str,
    save_pre: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`fused_gated_mlp` on validated (M, K) input: (y, gate, up)."""
    h, gate, up = _fwd_gemm(x, w_gate, w_up, None, activation, save_pre)
    return _down_proj(h, w_down, None), gate, up


def gated_mlp_bwd(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`gated_mlp_fwd`: (dx, dw_gate|up as :func:`_gated_input_grads` returns it,
    dw_down), empty where needs (dx, dw_gate, dw_up, dw_down) says not wanted (no GEMM for it)."""
    if any(needs[:3]):
        dgate_up, h, _ = _dh_act_bwd(dy, w_down, gate, up, activation, has_bias=False, need_h=needs[3])
        grads = _gated_input_grads(dgate_up, x, w_gate, w_up, needs[:3])
    else:  # only W_down trains: no dh GEMM, h recomputed elementwise
        grads = [dy.new_empty((0,)) for _ in range(2)]  # outputs may not alias
        h = (reference.apply_activation(gate.float(), activation) * up.float()).to(gate.dtype)
        h = h if needs[3] else grads[0]
    return *grads, _out_grads(dy, h, has_b_out=False, need_dw=needs[3])[0]
