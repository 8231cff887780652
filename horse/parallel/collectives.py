"""The collectives of tensor and data parallelism, and the conjugate autograd functions on them
(Megatron's: each collective's gradient is its conjugate), plus the small reductions the trainer's
optimizer and loss scaler need. Nothing here knows the model."""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from horse.parallel.mesh import Parallel

# ----------------------------------------------------------------------------------------------
# Collectives, and the conjugate autograd functions on them
# ----------------------------------------------------------------------------------------------

# Renamed in torch 2.13 (the old names warn there); torch 2.6 has only the old ones. Gloo (the CPU
# tests) has reduce-scattered since torch 2.3, as an all-reduce inside: one code path serves both.
_all_gather_tensor = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    # A copy: autograd may hand the same gradient tensor to several consumers.
    x = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(x, group=group)
    return x


def _all_gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T/tp, ...) from each rank -> (B, T, ...), the ranks' chunks in order along dim 1."""
    x = x.movedim(1, 0).contiguous()  # (T/tp, B, ...): the collectives concatenate along dim 0
    out = x.new_empty((_size(group) * x.shape[0], *x.shape[1:]))
    _all_gather_tensor(out, x, group=group)
    return out.movedim(0, 1).contiguous()


def _reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T, ...) partial sums on each rank -> this rank's (B, T/tp, ...) of their sum."""
    x = x.movedim(1, 0).contiguous()  # (T, B, ...)
    out = x.new_empty((x.shape[0] // _size(group), *x.shape[1:]))
    _reduce_scatter_tensor(out, x, group=group)
    return out.movedim(0, 1).contiguous()


def _chunk_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's chunk (B, T/tp, ...) of x (B, T, ...)."""
    return x.chunk(_size(group), dim=1)[dist.get_rank(group)].contiguous()


def _identity(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x


def _conjugate(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd function that runs forward(x, group), its gradient backward(dy, group): each
    collective's gradient is its conjugate (identity <-> all-reduce, all-gather <-> reduce-scatter)."""

    def fwd(ctx, x, group):
        ctx.group = group
        return forward(x, group)

    def bwd(ctx, dy):
        return backward(dy, ctx.group), None

    methods = {"forward": staticmethod(fwd), "backward": staticmethod(bwd)}
    return type(name, (torch.autograd.Function,), methods)


_CopyToTP = _conjugate("_CopyToTP", _identity, _all_reduce)
_ReduceFromTP = _conjugate("_ReduceFromTP", _all_reduce, _identity)
_GatherFromSequence = _conjugate("_GatherFromSequence", _all_gather_sequence, _reduce_scatter_sequence)
_ReduceScatterToSequence = _conjugate(
    "_ReduceScatterToSequence", _reduce_scatter_sequence, _all_gather_sequence
)
_ScatterToSequence = _conjugate("_ScatterToSequence", _chunk_sequence, _all_gather_sequence)


def copy_to_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """x, whose gradient is summed over the group: x feeds every rank's shard of the next layer."""
    return x if _size(group) == 1 else _CopyToTP.apply(x, group)


def reduce_from_tp(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of every rank's x (partial products); the gradient passes through unchanged."""
    return x if _size(group) == 1 else _ReduceFromTP.apply(x, group)


def gather_from_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, T/tp, ...) sequence chunks -> the whole (B, T, ...) on every rank; backward reduce-scatters."""
    return x if _size(group) == 1 else _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, T, ...) partial sums -> this rank's chunk (B, T/tp, ...) of their sum; backward all-gathers."""
    return x if _size(group) == 1 else _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """(B, T, ...), the same on every rank -> this rank's chunk (B, T/tp, ...); backward all-gathers."""
    return x if _size(group) == 1 else _ScatterToSequence.apply(x, group)


# ----------------------------------------------------------------------------------------------
# The tensor-parallel functions of the layers (identities, or the plain function, at tp=1)
# ----------------------------------------------------------------------------------------------


def split_sequence(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Under sequence parallelism this rank's chunk (B, T/tp, C) of x (B, T, C); x otherwise."""
    if not parallel.sequence_parallel:
        return x
    if x.shape[1] % parallel.tp_size:
        raise ValueError(
            f"sequence parallelism: tensor parallel size {parallel.tp_size} must divide the "
            f"sequence length {x.shape[1]}"
        )
    return scatter_to_sequence(x, parallel.tp_group)


def column_parallel_input(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """The input (B, T, C) of a projection split by output rows, whole on every tp rank: gathered
    from the sequence chunks (B, T/tp, C) under sequence parallelism; else x, its gradient summed."""
    if parallel.sequence_parallel:
        return gather_from_sequence(x, parallel.tp_group)
    return copy_to_tp(x, parallel.tp_group)


def dp_mean(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """The mean of x over the data-parallel replicas (each saw a different slice of the batch)."""
    if parallel.dp_size > 1:
        x = x.clone()
        dist.all_reduce(x, group=parallel.dp_group)
        x /= parallel.dp_size
    return x


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's piece of t: a DTensor's local shard (FSDP2's parameters, their gradients and
    optimizer state: rows of the tensor-parallel shard), t itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def found_nonfinite(flag: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Whether any rank of the world found an inf or NaN: flag (any dtype, nonzero where this rank
    did, e.g. a GradScaler's found_inf) reduced by max over every rank, so that all of them skip the
    step or all take it (under FSDP each rank checked only its own rows). Returns a bool scalar
    tensor."""
    flag = flag.detach().float().amax()  # a new tensor: the caller's flag is left alone
    if parallel.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    return flag > 0
