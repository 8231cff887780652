"""State dicts and gradients by the plan: cutting whole tensors into tp shards and gathering them
whole again (checkpoints, resharding on resume), and the gradient reductions that depend on which
parameters are sharded."""

from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from horse.model import GPTConfig
from horse.parallel.collectives import local
from horse.parallel.mesh import Parallel
from horse.parallel.plan import Style, style_of


def check_divisible(config: GPTConfig, tp: int) -> None:
    """Raise, naming the field, unless every tensor-parallel dimension of config splits over tp."""
    sizes = {
        "n_head": config.n_head,
        "n_kv_heads": config.kv_heads,
        "vocab_size": config.vocab_size,
        "mlp_hidden": config.hidden,
    }
    if config.moe_experts:
        sizes["moe_inter"] = config.expert_hidden
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tp]
    if bad:
        raise ValueError(f"tensor parallel size {tp} must divide {', '.join(bad)}")


class ShardSpec(NamedTuple):
    """How a tensor is cut over the tp ranks: along ``dim`` in tp equal slices, in rank order; with
    ``sections`` (consecutive sizes along dim), each section so, a rank's shard being its slice of
    every section, in order."""

    dim: int
    sections: list[int] | None = None


def _param_style(name: str) -> tuple[Style | None, str]:
    """(GPT_PLAN's row for the module of parameter ``name``, the parameter's own name)."""
    module_name, _, param = name.rpartition(".")
    return style_of(module_name), param


def is_sharded(name: str) -> bool:
    """Whether parameter ``name`` is split over tp ranks (each rank holds a different slice)."""
    style, param = _param_style(name)
    return style is not None and style.dim_of(param) is not None


def shard_spec(name: str, config: GPTConfig) -> ShardSpec | None:
    """How the parameter (or its optimizer state) ``name`` is cut over the tp ranks, by GPT_PLAN;
    None when it is replicated (whole on every rank). A wrapper's prefix on name is ignored."""
    style, param = _param_style(name)
    dim = None if style is None else style.dim_of(param)
    if dim is None:
        return None
    return ShardSpec(dim, style.sections_of(param, config))


def shard(full: torch.Tensor, spec: ShardSpec | None, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a full tensor (a copy of it when replicated)."""
    if spec is None:
        return full.clone()
    dim, sections = spec
    pieces = full.split(sections, dim=dim) if sections else [full]
    return torch.cat([piece.chunk(size, dim=dim)[rank] for piece in pieces], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], spec: ShardSpec | None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the first when replicated)."""
    if spec is None:
        return shards[0].clone()
    dim, sections = spec
    if not sections:
        return torch.cat(shards, dim=dim)
    local_sizes = [section // len(shards) for section in sections]
    per_rank = [s.split(local_sizes, dim=dim) for s in shards]  # [rank][section]
    whole_sections = [torch.cat([pieces[i] for pieces in per_rank], dim=dim) for i in range(len(sections))]
    return torch.cat(whole_sections, dim=dim)


def shard_state_dict(full: dict, config: GPTConfig, rank: int, size: int) -> dict:
    """Rank ``rank`` of ``size``'s shard of a whole model's state dict (parameter name -> tensor)."""
    check_divisible(config, size)
    return {name: shard(t, shard_spec(name, config), rank, size) for name, t in full.items()}


def gather_state_dicts(shards: list[dict], config: GPTConfig) -> dict:
    """The whole model's state dict from every tp rank's shard, in rank order."""
    return {name: unshard([s[name] for s in shards], shard_spec(name, config)) for name in shards[0]}


def allreduce_sequence_parallel_grads(model: nn.Module, parallel: Parallel) -> None:
    """Sum over tp ranks the gradients of the replicated parameters that run on sequence chunks.

    Under sequence parallelism each rank's norms and row-parallel biases see only its chunk of the
    sequence, so their gradients are partial sums; call this after the backward, before the grad
    norm and the step. The position table is added before the sequence is split, so its gradient
    is whole on every rank already. Under FSDP the tp ranks of one dp-shard index hold the same
    rows of these gradients: their local shards are summed. No-op without sequence parallelism.
    """
    if not parallel.sequence_parallel:
        return
    grads = [
        local(p.grad)
        for name, p in model.named_parameters()
        if p.grad is not None and not is_sharded(name) and not name.endswith("wpe.weight")
    ]
    if not grads:
        return
    flat = torch.cat([g.flatten() for g in grads])  # one all-reduce, not one per parameter
    dist.all_reduce(flat, group=parallel.tp_group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))


def global_grad_norm(named_params: Iterable[tuple[str, nn.Parameter]], parallel: Parallel) -> torch.Tensor:
    """The L2 norm (float32 scalar, the same on every rank) of the whole model's gradients, each
    parameter counted once: the squares of the tp-sharded ones summed over tp ranks, the
    tp-replicated ones (identical on every tp rank) taken from this rank; under FSDP each rank's
    rows of both summed over the dp-shard ranks first. Not reduced over the replicas: DDP or FSDP
    has averaged the gradients there already. named_params: ``model.named_parameters()``, of the
    model or its DDP wrapper; parameters without a gradient are skipped."""
    sharded, replicated = [], []
    for name, p in named_params:
        if p.grad is not None:
            (sharded if is_sharded(name) else replicated).append(local(p.grad))
    device = (sharded + replicated)[0].device

    def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
        # get_total_norm: one fused (foreach) norm over the list, as clip_grad_norm_ takes it
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads).float().square()

    sums = torch.stack([sum_of_squares(sharded), sum_of_squares(replicated)])
    if parallel.fsdp:  # each dp-shard rank holds its rows of every gradient
        dist.all_reduce(sums, group=parallel.dp_shard_group)
    sharded_sum, replicated_sum = sums
    if parallel.tp_size > 1:
        dist.all_reduce(sharded_sum, group=parallel.tp_group)
    return (sharded_sum + replicated_sum).sqrt()
