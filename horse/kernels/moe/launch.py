"""The host launchers, on inputs the public function has validated: the sort, the row tiles of the
grouped GEMMs, the GEMMs and the combine, forward and backward, each launched by its plan. No autograd
here: ops.py binds these.
"""

import torch
import triton

from horse.kernels import runtime
from horse.kernels.moe import configs
from horse.kernels.moe.configs import Epilogue, GemmConfig
from horse.kernels.moe.gemm import (
    _dh_bwd_kernel,
    _expert_gemm_kernel,
    _gate_up_fwd_kernel,
    _weight_grad_kernel,
)
from horse.kernels.moe.routing import _combine_kernel, _count_kernel, _place_kernel
from horse.kernels.runtime import Plan


def sort_plans(pairs: int, experts: int) -> tuple[Plan, Plan]:
    """The counting sort's plans, its count pass and its place pass: a program a block of pairs
    (:func:`configs.sort_blocks`)."""
    block_pairs, block_experts = configs.sort_blocks(experts)
    constexprs = dict(BLOCK_PAIRS=block_pairs, BLOCK_EXPERTS=block_experts)
    grid = (triton.cdiv(pairs, block_pairs),)
    return tuple(
        Plan(kernel, grid, constexprs, configs.SORT_WARPS, 1) for kernel in (_count_kernel, _place_kernel)
    )


def combine_plan(tokens: int, N: int) -> Plan:
    """The combine's plan for a (tokens, N) output: a program a token's column block."""
    grid = (tokens, triton.cdiv(N, configs.COMBINE_BLOCK_N))
    constexprs = dict(BLOCK_N=configs.COMBINE_BLOCK_N)
    return Plan(_combine_kernel, grid, constexprs, configs.COMBINE_WARPS, num_stages=1)


# The row-tiled GEMMs' tuple argument: the row tiles' map (:func:`row_tiles`) and the sort's offsets.
ROW_TILES = {"TILES": ("TILE_EXPERT", "TILE_ROW", "OFFSETS")}


def _gemm_plan(kernel, cfg: GemmConfig, row_tiles: int, N: int, tiles: dict, **constexprs) -> Plan:
    """A row-tiled GEMM's plan, the operands in tiles (name -> block dims: m, n, k, or 1 for one
    expert of a weight) loaded by TMA."""
    blocks = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    dims = {"m": cfg.block_m, "n": cfg.block_n, "k": cfg.block_k, "1": 1}
    descriptors = {name: tuple(dims[d] for d in block) for name, block in tiles.items()}
    grid = (row_tiles, triton.cdiv(N, cfg.block_n))
    return Plan(kernel, grid, constexprs | blocks, cfg.num_warps, cfg.num_stages, ROW_TILES, descriptors)


def gate_up_plan(cfg: GemmConfig, row_tiles: int, inter: int, epilogue: Epilogue) -> Plan:
    """The gated forward GEMM's plan: row_tiles row tiles of (pairs, inter) outputs h, gate and up."""
    return _gemm_plan(_gate_up_fwd_kernel, cfg, row_tiles, inter, {}, EPILOGUE=epilogue)


def expert_gemm_plan(
    cfg: GemmConfig, row_tiles: int, N: int, has_bias: bool, scale_rows: bool, tma: str | None
) -> Plan:
    """The plain grouped GEMM's plan (the down projection, the backward's dx rows), (pairs, N) out;
    with tma, both operands' tiles by TMA (:func:`tma_usable`), the weight stored as tma says: "nk",
    (experts, N, K) (down_proj, for the down projection), or "kn", (experts, K, N) (gate_up_proj,
    for dx)."""
    tiles = {"A": "mk", "W": f"1{tma}"} if tma else {}
    return _gemm_plan(
        _expert_gemm_kernel, cfg, row_tiles, N, tiles, HAS_BIAS=has_bias, SCALE_ROWS=scale_rows, TMA=tma
    )


def dh_plan(cfg: GemmConfig, row_tiles: int, inter: int, epilogue: Epilogue) -> Plan:
    """The backward's dh GEMM's plan: (pairs, inter) outputs, act' and the product rule in its epilogue."""
    return _gemm_plan(_dh_bwd_kernel, cfg, row_tiles, inter, {}, EPILOGUE=epilogue)


def weight_grad_plan(cfg: GemmConfig, experts: int, N1: int, N2: int, **flags) -> Plan:
    """The weight gradients' plan: a program a (block_m, block_n) tile of an expert's (N1, N2) dW,
    block_k rows a step; flags: GATHER_A, GATHER_B, SCALE_ROWS, HAS_BIAS."""
    blocks = dict(BLOCK_N1=cfg.block_m, BLOCK_N2=cfg.block_n, BLOCK_R=cfg.block_k)
    grid = (triton.cdiv(N1, cfg.block_m) * triton.cdiv(N2, cfg.block_n), experts)
    sizes = {"sizes": ("N1", "N2", "top_k")}
    return Plan(_weight_grad_kernel, grid, flags | blocks, cfg.num_warps, cfg.num_stages, sizes)


# The plain grouped GEMM's tiles (down, dx) by TMA where tma_usable allows; False: pointer loads.
USE_TMA = True


def tma_usable(cfg: GemmConfig, rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the plain grouped GEMM loads its tiles by TMA: ``USE_TMA`` and the table entry allow it
    and :func:`runtime.tma_compatible` holds for its sorted rows and its weight as stored
    (transformers' layout; gpt-oss's transposed weights, unit stride elsewhere, take pointers)."""
    return USE_TMA and cfg.tma and runtime.tma_compatible(rows, weight)


def _launch(plan: Plan, *args):
    runtime.launch(plan.kernel, plan.grid, *args, **plan.options(), **runtime.COMPILE_OPTIONS)


def count_sort(expert_ids: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs, pair_rows, offsets) of the (tokens, top_k) expert_ids, sorted stably by expert on
    the device (no host sync): pair p = token * top_k + k sits at sorted row pair_rows[p] (-1: an id
    outside [0, experts), dropped), sorted_pairs is the inverse, and expert e's rows are offsets[e] ..
    offsets[e + 1]."""
    ids = expert_ids.reshape(-1)
    pairs = ids.numel()
    # Index buffers take no NaN poison (runtime.empty): every element the GEMMs read is written.
    sorted_pairs = torch.empty((pairs,), dtype=torch.int32, device=ids.device)
    pair_rows = torch.empty((pairs,), dtype=torch.int32, device=ids.device)
    count_plan, place_plan = sort_plans(pairs, experts)
    counts = torch.empty((count_plan.grid[0], experts), dtype=torch.int32, device=ids.device)
    with runtime.device_guard(ids):
        if pairs:
            _launch(count_plan, ids, counts, pairs, experts)
        # Expert e's rows start after every earlier expert's; block b's after the earlier blocks' (integer
        # prefix sums: exact, the same on every run).
        ends = counts.sum(0).cumsum(0)
        offsets = torch.cat([ends.new_zeros(1), ends]).to(torch.int32)
        block_rows = (counts.cumsum(0) - counts + offsets[:-1]).to(torch.int32)
        if pairs:
            _launch(place_plan, ids, block_rows, sorted_pairs, pair_rows, pairs, experts)
    return sorted_pairs, pair_rows, offsets


def row_tiles(offsets: torch.Tensor, block_m: int, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tile_expert, tile_row): each row tile's expert and first sorted row, for tiles of block_m rows
    that never cross an expert, computed on the device. Their number is fixed by the sizes alone,
    cdiv(pairs, block_m) + min(experts, pairs) (each expert's last tile may be partial); tiles past
    the last expert's get the expert id ``experts`` and exit at once."""
    experts = offsets.numel() - 1
    counts = (offsets[1:] - offsets[:-1]).long()
    tiles = (counts + block_m - 1) // block_m
    ends = tiles.cumsum(0)
    index = torch.arange(triton.cdiv(pairs, block_m) + min(experts, pairs), device=offsets.device)
    tile_expert = torch.searchsorted(ends, index, right=True)
    expert = tile_expert.clamp(max=experts - 1)
    tile_row = offsets[expert].long() + (index - (ends - tiles)[expert]) * block_m
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def _combine(rows: torch.Tensor, pair_rows: torch.Tensor, tokens: int) -> torch.Tensor:
    out = runtime.empty((tokens, rows.shape[1]), rows.dtype, rows.device)
    if out.numel():
        top_k = pair_rows.numel() // tokens
        with runtime.device_guard(rows):
            _launch(combine_plan(tokens, rows.shape[1]), rows, pair_rows, out, rows.shape[1], top_k)
    return out


def _strides_2d(t: torch.Tensor | None) -> tuple[int, int]:
    return (0, 0) if t is None else tuple(t.stride())


def moe_fwd(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    activation: str,
    limit: float | None,
    interleaved: bool,
    save: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward of :func:`horse.kernels.moe_mlp` on validated input: (y, gate, up, sorted_pairs,
    pair_rows, offsets), gate and up (pairs, inter) in sorted order (empty unless save). The rows past
    offsets[experts] (as many as dropped pairs: ids outside the experts) of gate, up and sorted_pairs
    are left unwritten; nothing reads them."""
    tokens, hidden = x.shape
    experts, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    pairs = expert_ids.numel()
    sorted_pairs, pair_rows, offsets = count_sort(expert_ids, experts)
    h = runtime.empty((pairs, inter), x.dtype, x.device)
    gate = runtime.empty((pairs, inter) if save else (0,), x.dtype, x.device)
    up = runtime.empty((pairs, inter) if save else (0,), x.dtype, x.device)
    y_rows = runtime.empty((pairs, hidden), x.dtype, x.device)
    if pairs:
        epilogue = Epilogue(activation, limit, interleaved, has_bias=gate_up_bias is not None, store=save)
        cfg = configs.gemm_config("gate_up", x.device)
        tile_expert, tile_row = row_tiles(offsets, cfg.block_m, pairs)
        plan = gate_up_plan(cfg, tile_expert.numel(), inter, epilogue)
        b = gate_up_bias if gate_up_bias is not None else x
        with runtime.device_guard(x):
            _launch(
                plan,
                x, gate_up_proj, b, sorted_pairs, (tile_expert, tile_row, offsets), h, gate, up,
                inter, hidden, experts, expert_ids.shape[1],
                x.stride(), gate_up_proj.stride(), _strides_2d(gate_up_bias),
            )  # fmt: skip
        cfg = configs.gemm_config("down", x.device)
        tile_expert, tile_row = row_tiles(offsets, cfg.block_m, pairs)
        tma = "nk" if tma_usable(cfg, h, down_proj) else None
        plan = expert_gemm_plan(cfg, tile_expert.numel(), hidden, down_bias is not None, True, tma=tma)
        with runtime.device_guard(x):
            _launch(
                plan,
                plan.operand("A", h), plan.operand("W", down_proj), down_bias if down_bias is not None else x,
                expert_weights.reshape(-1), sorted_pairs, (tile_expert, tile_row, offsets), y_rows,
                hidden, inter, experts,
                h.stride(), down_proj.stride(), _strides_2d(down_bias),
            )  # fmt: skip
    return _combine(y_rows, pair_rows, tokens), gate, up, sorted_pairs, pair_rows, offsets


def _weight_grad(a, b, weights, sorted_pairs, offsets, dw, db, top_k, gather_a, gather_b, scale_rows):
    """dw[e] = Σ over expert e's rows of (s a)ᵀ b, and db[e] = Σ s a when db is given, by expert."""
    experts, N1, N2 = dw.shape
    cfg = configs.gemm_config("weight_grad", dw.device)
    plan = weight_grad_plan(
        cfg,
        experts,
        N1,
        N2,
        GATHER_A=gather_a,
        GATHER_B=gather_b,
        SCALE_ROWS=scale_rows,
        HAS_BIAS=db is not None,
    )
    with runtime.device_guard(dw):
        _launch(
            plan,
            a, b, weights, sorted_pairs, offsets, dw, db if db is not None else dw, (N1, N2, top_k),
            a.stride(), b.stride(), dw.stride(), _strides_2d(db),
        )  # fmt: skip


def grad_buffers(x, expert_weights, gate_up_proj, down_proj, needs: list[bool]) -> list[torch.Tensor]:
    """The backward's outputs as it allocates them, in :func:`moe_bwd`'s order (the fake's too): the
    weights' gradients with their weights' strides (a transposed weight's too), the others contiguous;
    an empty tensor where needs says no gradient."""
    experts, two_inter, hidden = gate_up_proj.shape
    shapes = [x.shape, expert_weights.shape, None, None, (experts, two_inter), (experts, hidden)]
    likes = [x, expert_weights, gate_up_proj, down_proj, x, x]
    return [
        (t.new_empty(shape) if shape is not None else torch.empty_like(t)) if need else t.new_empty((0,))
        for t, shape, need in zip(likes, shapes, needs, strict=True)
    ]


def moe_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    gate: torch.Tensor,
    up: torch.Tensor,
    sorted_pairs: torch.Tensor,
    pair_rows: torch.Tensor,
    offsets: torch.Tensor,
    activation: str,
    limit: float | None,
    interleaved: bool,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`moe_fwd`: (dx, d_expert_weights, d_gate_up_proj, d_down_proj, d_gate_up_bias,
    d_down_bias), each an empty tensor where needs (one flag each, in that order) says no gradient."""
    tokens, hidden = x.shape
    experts, two_inter, _ = gate_up_proj.shape
    inter = two_inter // 2
    pairs = expert_ids.numel()
    top_k = expert_ids.shape[1]
    weights = expert_weights.reshape(-1)
    dpre = runtime.empty((pairs, two_inter), x.dtype, x.device)  # [dgate, dup] in gate_up_proj's row order
    h = runtime.empty((pairs, inter), x.dtype, x.device)
    cfg = configs.gemm_config("dh", x.device)
    tiles_n = triton.cdiv(inter, cfg.block_n)
    dscale_partial = runtime.empty((pairs, tiles_n), torch.float32, x.device)
    grads = grad_buffers(x, expert_weights, gate_up_proj, down_proj, needs)
    dx, dweights, dgate_up_proj, ddown_proj, dgate_up_bias, ddown_bias = grads
    if pairs:
        tile_expert, tile_row = row_tiles(offsets, cfg.block_m, pairs)
        plan = dh_plan(
            cfg,
            tile_expert.numel(),
            inter,
            Epilogue(activation, limit, interleaved, has_bias=False, store=False),
        )
        with runtime.device_guard(x):
            _launch(
                plan,
                dy, down_proj, weights, gate, up, sorted_pairs, (tile_expert, tile_row, offsets), dpre, h,
                dscale_partial, inter, hidden, experts, top_k,
                dy.stride(), down_proj.transpose(1, 2).stride(),
            )  # fmt: skip
        if needs[0]:
            cfg = configs.gemm_config("down", x.device)
            tile_expert, tile_row = row_tiles(offsets, cfg.block_m, pairs)
            tma = "kn" if tma_usable(cfg, dpre, gate_up_proj) else None
            plan = expert_gemm_plan(cfg, tile_expert.numel(), hidden, False, False, tma=tma)
            dx_rows = runtime.empty((pairs, hidden), x.dtype, x.device)
            with runtime.device_guard(x):
                _launch(
                    plan,
                    plan.operand("A", dpre), plan.operand("W", gate_up_proj), x, weights, sorted_pairs,
                    (tile_expert, tile_row, offsets), dx_rows, hidden, two_inter, experts, dpre.stride(),
                    gate_up_proj.transpose(1, 2).stride(), (0, 0),
                )  # fmt: skip
            dx = _combine(dx_rows, pair_rows, tokens)
        if needs[2] or needs[4]:
            dw = dgate_up_proj if needs[2] else torch.empty_like(gate_up_proj)
            db = dgate_up_bias if needs[4] else None
            _weight_grad(dpre, x, weights, sorted_pairs, offsets, dw, db, top_k, False, True, False)
        if needs[3] or needs[5]:
            dw = ddown_proj if needs[3] else torch.empty_like(down_proj)
            db = ddown_bias if needs[5] else None
            _weight_grad(dy, h, weights, sorted_pairs, offsets, dw, db, top_k, True, False, True)
    else:  # no tokens: every weight's gradient is zeros
        for grad in grads:
            grad.zero_()
    if needs[1]:
        routed = pair_rows >= 0
        rows = pair_rows.clamp(min=0).long()
        dscale = dscale_partial.sum(1)[rows]  # each pair's column tiles, added in a fixed order
        if down_bias is not None:  # d weight_k also takes dy · b_down of its expert
            by_expert = dy.float() @ down_bias.float().t()  # (tokens, experts)
            dscale = dscale + by_expert.gather(1, expert_ids.long().clamp(0, experts - 1)).reshape(-1)
        dweights = torch.where(routed, dscale, 0.0).reshape(expert_weights.shape).to(expert_weights.dtype)
    return dx, dweights, dgate_up_proj, ddown_proj, dgate_up_bias, ddown_bias
