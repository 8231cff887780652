"""Tensor parallelism inside a node, data parallelism across nodes (Megatron-style, on torch.distributed).

A 3-D device mesh ``(dp_replicate, dp_shard, tp)``: the tp ranks of one data-parallel index hold
the shards of one model replica and see the same batch; the data-parallel ranks (dp_replicate x
dp_shard of them) hold the same tp shard of different replicas and see different batches. With
dp_shard 1 they each hold all of it and average their gradients with DDP; with dp_shard > 1, FSDP2
shards the parameters, gradients and optimizer state over the dp_shard ranks and replicates that
over dp_replicate (HSDP; ``fully_shard_gpt``). Launched with torchrun; NCCL on GPUs, gloo on the
CPU (the tests).

The model (``horse.model.GPT``) is dense; one table, ``GPT_PLAN``, says per module how it splits
over the tp ranks (by rows, by columns, by heads, or not at all, and which tensor-parallel form
it takes), Megatron's way: the token embedding (also the LM head) by vocabulary rows; attention by
heads, its c_attn column-parallel (rows, in q, k and v sections) and its c_proj row-parallel
(columns); the MLP by hidden units, its input taken whole once for its up projections (rows) and
its down projection row-parallel (columns); norms, the position table and the biases added after
a row-parallel projection stay whole on every rank. ``parallelize(model, mesh)`` applies the table
to a model, making it this rank's shard; ``shard_spec`` reads the same table to cut whole state
dicts into shards and gather them again (checkpoints, resharding on resume). A rank's shard is cut
from the whole model initialised from one seed (``build_model``), so every tp size starts from
the same weights.

The whole input goes to every rank (``column_parallel_input``), each rank computes its heads and
its slice of the MLP's hidden units, and the row-parallel projection that closes the branch sums
the ranks' partial outputs (``RowParallelLinear``): one all-reduce per branch forward, one per
branch backward. The conjugate pairs that do it, after Megatron:

    copy_to_tp                   identity            | all-reduce         (column-parallel input)
    reduce_from_tp               all-reduce          | identity           (row-parallel output)
    gather_from_sequence         all-gather, dim 1   | reduce-scatter     (sequence parallelism)
    reduce_scatter_to_sequence   reduce-scatter      | all-gather
    scatter_to_sequence          this rank's chunk   | all-gather

Sequence parallelism swaps the all-reduces for a reduce-scatter and an all-gather (the same
bytes) and keeps the residual stream, the norms and the adds on (B, T / tp, C) between the
branches, so they cost 1/tp of the time and activation memory. The LM head and the loss run fused
on each rank's vocabulary rows (``vocab_parallel_linear_cross_entropy``): in row chunks, with an
all-reduce of each chunk's row max and one of its sums, never materialising or gathering the logits
(``vocab_parallel_cross_entropy`` is the unfused form, on logits split by vocabulary). Every
function takes its process group from the ``Parallel`` it is given; nothing is global.
"""

import functools
import itertools
import os
import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from horse import kernels
from horse.kernels.cross_entropy import VocabShard, head_loss
from horse.model import GPT, MLP, GPTConfig, KVCache, runs_half_kernels


@dataclass(frozen=True)
class Parallel:
    """Where this process sits. Without torch.distributed (one process) every size is 1, groups None.

    dp_rank / dp_size: this rank's data-parallel replica (its slice of each batch) among all of them:
        dp_size = dp_replicate x dp_shard, dp_rank = replicate index x dp_shard + shard index
    dp_shard_size: the data-parallel ranks that shard the parameters, gradients and optimizer state
        among them (FSDP2); 1: each replica holds them whole (DDP)
    tp_group / dp_group / dp_shard_group: the process groups of this rank's tensor-parallel,
        data-parallel and dp-shard peers (dp_shard_group is None without FSDP)
    fsdp_mesh: the mesh FSDP2 shards over: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP;
        None without FSDP
    sequence_parallel: norms and residual adds run on sequence shards between the tp regions
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    dp_shard_size: int = 1
    dp_shard_group: dist.ProcessGroup | None = None
    fsdp_mesh: DeviceMesh | None = None

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the parameters, gradients and optimizer state (dp_shard > 1)."""
        return self.dp_shard_size > 1

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard_size

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size // self.dp_shard_size

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard_size


def check_layout(world: int, tp: int, dp_shard: int = 1, dp_replicate: int | None = None) -> int:
    """dp_replicate (given, or the data-parallel ranks left over), after checking that
    dp_replicate x dp_shard x tp is the world size; a ValueError naming the values otherwise."""
    for name, value in (("--tp", tp), ("--dp-shard", dp_shard), ("--dp-replicate", dp_replicate)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if world % (tp * dp_shard):
        if dp_shard == 1:
            raise ValueError(f"--tp {tp} must divide the world size {world}")
        raise ValueError(
            f"--dp-shard {dp_shard} x --tp {tp} = {dp_shard * tp} must divide the world size {world}"
        )
    if dp_replicate is None:
        return world // (tp * dp_shard)
    if dp_replicate * dp_shard * tp != world:
        raise ValueError(
            f"--dp-replicate {dp_replicate} x --dp-shard {dp_shard} x --tp {tp} = "
            f"{dp_replicate * dp_shard * tp} is not the world size {world}"
        )
    return dp_replicate


def init_from_env(
    tp: int = 1,
    sequence_parallel: bool = False,
    device_type: str | None = None,
    dp_shard: int = 1,
    dp_replicate: int | None = None,
) -> Parallel:
    """The process groups of a torchrun launch (WORLD_SIZE in the environment), or a single process.

    A 3-D device mesh (dp_replicate, dp_shard, tp) whose sizes multiply to the world size
    (:func:`check_layout`; dp_replicate defaults to what is left over). Ranks of one node are
    consecutive under torchrun, so tp ranks (consecutive in the mesh's last dimension) share a
    node's NVLink, and the dp_shard ranks come next: at tp 1 a node's 8 GPUs shard among them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp_replicate = check_layout(world, tp, dp_shard, dp_replicate)
    if world == 1:
        return Parallel(sequence_parallel=sequence_parallel and tp > 1)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = None
    if device_type == "cuda":
        # Modulo the GPUs this process sees: one GPU per process (CUDA_VISIBLE_DEVICES set per rank
        # by a launcher) or a node that shows fewer GPUs than it runs ranks.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # device_id: NCCL binds the communicator to this GPU up front (no guess from the rank).
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", device_id=device)
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh(device_type, (dp_replicate, dp_shard, tp), mesh_dim_names=names)
    replicate_rank, shard_rank = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")
    if dp_shard == 1:
        dp_group = mesh.get_group("dp_replicate")
    elif dp_replicate == 1:
        dp_group = mesh.get_group("dp_shard")
    else:  # both: the one group of every data-parallel rank, for the loss's mean and evaluation
        dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    fsdp_mesh = None
    if dp_shard > 1:  # a 2-D mesh makes FSDP2 hybrid: sharded on dp_shard, replicated on dp_replicate
        fsdp_mesh = mesh["dp_shard"] if dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    return Parallel(
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=tp,
        dp_rank=replicate_rank * dp_shard + shard_rank,
        dp_size=dp_replicate * dp_shard,
        tp_group=mesh.get_group("tp"),
        dp_group=dp_group,
        sequence_parallel=sequence_parallel and tp > 1,
        dp_shard_size=dp_shard,
        dp_shard_group=mesh.get_group("dp_shard") if dp_shard > 1 else None,
        fsdp_mesh=fsdp_mesh,
    )


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


def vocab_parallel_embedding(idx: torch.Tensor, weight: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """``F.embedding(idx, whole_weight)`` from this rank's rows: weight (V/tp, C) holds ids
    [rank·V/tp, (rank+1)·V/tp). idx (B, T) -> (B, T, C): each rank looks up its own ids (zeros
    elsewhere) and the ranks' lookups are summed."""
    if parallel.tp_size == 1:
        return F.embedding(idx, weight)
    rows = weight.shape[0]
    local = idx - parallel.tp_rank * rows
    elsewhere = (local < 0) | (local >= rows)  # (B, T): ids another rank holds
    x = F.embedding(local.masked_fill(elsewhere, 0), weight).masked_fill(elsewhere[..., None], 0.0)
    return reduce_from_tp(x, parallel.tp_group)


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, parallel: Parallel, softcap: float | None = None
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar, the same on every tp rank) of logits (N, V/tp), this
    rank's vocabulary columns, against targets (N,) in [0, V) (or -100, ignored); equals
    ``F.cross_entropy`` of the gathered logits, without gathering them (``head_loss`` of the logits, on
    plain PyTorch as F.cross_entropy). softcap (None, or c > 0): of c·tanh(logits / c)."""
    columns = logits.shape[1]
    shard = _vocab_shard(parallel.tp_rank * columns, columns * parallel.tp_size, parallel)
    fn = "vocab_parallel_cross_entropy"
    return head_loss(logits, None, targets, use_triton=False, shard=shard, softcap=softcap, fn=fn)


def _vocab_shard(start: int, vocab: int, parallel: Parallel) -> VocabShard | None:
    """Columns [start, ...) of a vocabulary of vocab, with the tp group's collectives; None at tp 1."""
    if parallel.tp_size == 1:
        return None
    group = parallel.tp_group
    if _size(group) == 1:  # one process standing for a rank (bench.scaling): the collectives are identities
        return VocabShard(start, vocab, all_reduce_max=lambda t: None, all_reduce_sum=lambda t: None)
    return VocabShard(
        start,
        vocab,
        all_reduce_max=lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group),
        all_reduce_sum=lambda t: dist.all_reduce(t, group=group),
    )


def vocab_parallel_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    parallel: Parallel,
    use_triton: bool,
    vocab_used: int | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar, the same on every tp rank) of the LM head ``x @ W_wholeᵀ``
    against targets (B, T) in [0, vocab_used) (or ignore_index), without the logits: x (B, T, C), or
    this rank's chunk (B, T/tp, C) under sequence parallelism; weight (V/tp, C), this rank's rows
    [rank·V/tp, (rank+1)·V/tp) of the head. Rows from vocab_used on (padding) are left out. softcap
    (None, or c > 0): the logits are c·tanh(logits / c) (Gemma 2's final-logit softcapping).

    Fused (``horse.kernels.cross_entropy.head_loss``): rows in chunks, each chunk's logits computed,
    turned into the loss and their gradient, and consumed, on the Triton kernels (use_triton) or their
    plain-PyTorch twins; at tp > 1 one all-reduce of each chunk's row max and one of its sums. At tp=1
    it is a custom op that torch.compile traces whole.
    """
    rows = weight.shape[0]
    vocab = rows * parallel.tp_size if vocab_used is None else vocab_used
    start = parallel.tp_rank * rows
    weight = weight[: max(0, min(rows, vocab - start))]  # this rank's columns in use
    x = column_parallel_input(x, parallel).flatten(0, 1)  # (B·T, C): the whole sequence on every rank
    return head_loss(
        x,
        weight,
        targets.flatten(),
        use_triton=use_triton,
        shard=_vocab_shard(start, vocab, parallel),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        fn="vocab_parallel_linear_cross_entropy",
    )


# ----------------------------------------------------------------------------------------------
# The layers' tensor-parallel forms (GPT_PLAN, below, says which module takes which)
# ----------------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Linear):
    """nn.Linear split by output rows: this rank's rows of the output, from the whole input on every
    rank (``column_parallel_input``: gathered from the sequence chunks under sequence parallelism)."""

    parallel: Parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(column_parallel_input(x, self.parallel), self.weight, self.bias)


class RowParallelLinear(nn.Linear):
    """nn.Linear split by input columns: x (B, T, in/tp) -> (B, T, out), or this rank's chunk
    (B, T/tp, out) under sequence parallelism. The ranks' partial products are summed, then the
    replicated bias is added once."""

    parallel: Parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.parallel.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.parallel.tp_group)
        else:
            y = reduce_from_tp(y, self.parallel.tp_group)
        return y if self.bias is None else y + self.bias.to(y.dtype)  # in the compute dtype, as nn.Linear


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding split by vocabulary rows (``vocab_parallel_embedding``)."""

    parallel: Parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(idx, self.weight, self.parallel)


class TensorParallelMLP(MLP):
    """The MLP split by hidden units: the up projection (its activation fused, on the kernels in
    half precision) on this rank's units of the whole input, then the row-parallel down projection.
    Two calls where tp=1 runs the MLP as one: the ranks' partial sums are added before the bias."""

    parallel: Parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = column_parallel_input(x, self.parallel)  # (B, T, C): the whole sequence on every tp rank
        if not runs_half_kernels(self.backend, x):
            return super().forward(x)  # on torch: the projections, as the plan cut them
        if self.swiglu:  # (B, T, hidden / tp) inside
            h = kernels.gated_linear(x, self.gate_proj.weight, self.up_proj.weight, activation="silu")
            return self.down_proj(h)
        return self.c_proj(kernels.linear_act(x, self.c_fc.weight, self.c_fc.bias, activation="gelu_tanh"))


class TensorParallelGPT(GPT):
    """A GPT that ``parallelize`` has made one tensor-parallel rank's shard: its logits are this
    rank's vocabulary columns (B, T, vocab_size / tp), its loss the whole model's on every rank
    (computed on the vocabulary shards, never gathered); under sequence parallelism the residual
    stream and the norms run on (B, T / tp, C) chunks between the branches."""

    parallel: Parallel

    def embed(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        return split_sequence(super().embed(idx, start), self.parallel)  # (B, T / tp, C) under SP

    def features(self, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        if cache is not None:
            raise ValueError(
                "GPT: the KV cache (generation) runs at tp=1 only; gather the shards into a whole "
                "model first (horse.parallel.gather_state_dicts)"
            )
        return super().features(idx)

    def logits(self, y: torch.Tensor) -> torch.Tensor:
        head = self.head_weight  # (vocab_size / tp, C): this rank's ids [rank · rows, (rank + 1) · rows)
        logits = F.linear(column_parallel_input(y, self.parallel), head)  # (B, T, vocab_size / tp)
        used = self.config.vocab_used
        if used is not None and used < self.config.vocab_size:
            ids = torch.arange(head.shape[0], device=y.device) + self.parallel.tp_rank * head.shape[0]
            logits = logits.masked_fill(ids >= used, float("-inf"))  # the padding rows
        return logits

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not self.fused_loss:
            return vocab_parallel_cross_entropy(self(idx).flatten(0, 1), targets.flatten(), self.parallel)
        y = self.features(idx)  # (B, T, C), or this rank's chunk (B, T / tp, C) under SP
        use_triton = self.backend == "triton"
        vocab_used = self.config.vocab_used
        return vocab_parallel_linear_cross_entropy(
            y, self.head_weight, targets, self.parallel, use_triton=use_triton, vocab_used=vocab_used
        )


# ----------------------------------------------------------------------------------------------
# The plan: one table that says, per module of the GPT, how it splits over the tp ranks
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Style:
    """One row of a tensor-parallel plan: how a module splits over the tp ranks.

    split: what of the module is cut. "rows": its weight and bias, by output rows (dim 0);
        "columns": its weight, by input columns (dim 1), while its bias (added once, after the
        ranks' partial outputs are summed) stays whole on every rank; "heads": its head counts
        (n_heads, n_kv_heads), divided by tp; None: nothing (its parameters whole on every rank)
    sections: the consecutive sections of the cut dim that are cut separately, from the model's
        config: each rank takes its 1/tp of every section, in order (c_attn's q, k and v rows);
        None: the dim is cut as one
    form: the module's tensor-parallel class, a subclass of its own class whose methods run the
        collectives; None: the module runs as it is, its parent handing it what it needs
    """

    split: Literal["rows", "columns", "heads"] | None = None
    sections: Callable[[GPTConfig], list[int]] | None = None
    form: type[nn.Module] | None = None

    def dim_of(self, param: str) -> int | None:
        """The dim along which the module's parameter ``param`` ("weight", "bias") is cut; None: whole."""
        if self.split == "rows" and param in ("weight", "bias"):
            return 0
        if self.split == "columns" and param == "weight":
            return 1
        return None


def qkv_sections(config: GPTConfig) -> list[int]:
    """c_attn's output rows, in order: the query heads', the key heads', the value heads'."""
    q_rows = config.n_head * config.head_dim
    kv_rows = config.kv_heads * config.head_dim
    return [q_rows, kv_rows, kv_rows]


# The GPT's plan, Megatron's. Attention is split by heads and the MLP by hidden units; each branch
# opens column-parallel (the whole input on every rank, each computing its own output rows) and
# closes row-parallel (the ranks' partial outputs summed: one all-reduce per branch forward, one
# per backward). The token embedding, which is also the LM head, is split by vocabulary rows.
# Keys are module names as ``named_modules`` gives them ("" the GPT itself; "*" one component of a
# name: a block's index). A module not listed keeps its parameters whole on every rank (the norms,
# the position table). ``parallelize`` applies the plan to a model; ``shard_spec`` reads it to cut
# and gather state dicts and checkpoints.
GPT_PLAN: dict[str, Style] = {
    "": Style(form=TensorParallelGPT),  # the LM head and the loss on vocabulary shards
    "wte": Style("rows", form=VocabParallelEmbedding),
    "lm_head": Style("rows"),  # LLaMA's own head: never called, read by TensorParallelGPT's head and loss
    "blocks.*.attn": Style("heads"),
    "blocks.*.attn.c_attn": Style("rows", sections=qkv_sections, form=ColumnParallelLinear),
    "blocks.*.attn.c_proj": Style("columns", form=RowParallelLinear),
    "blocks.*.mlp": Style(form=TensorParallelMLP),  # takes its input whole once, for the up projections
    "blocks.*.mlp.c_fc": Style("rows"),
    "blocks.*.mlp.gate_proj": Style("rows"),
    "blocks.*.mlp.up_proj": Style("rows"),
    "blocks.*.mlp.c_proj": Style("columns", form=RowParallelLinear),
    "blocks.*.mlp.down_proj": Style("columns", form=RowParallelLinear),
}


@functools.cache
def _name_pattern(key: str) -> re.Pattern:
    """A plan key as a regular expression: "*" matches one component of a name, and any prefix that
    ends in "." is allowed, so that a wrapper's (DDP's "module.", torch.compile's "_orig_mod.")
    does not hide the name."""
    components = ["[^.]+" if part == "*" else re.escape(part) for part in key.split(".")]
    return re.compile(r"(?:.*\.)?" + r"\.".join(components))


def style_of(module_name: str) -> Style | None:
    """GPT_PLAN's row for the module ``module_name``; None: the module is not split."""
    for key, style in GPT_PLAN.items():
        if _name_pattern(key).fullmatch(module_name):
            return style
    return None


def parallelize(model: GPT, mesh: Parallel | DeviceMesh) -> GPT:
    """Make ``model``, a whole GPT, this rank's tensor-parallel shard in place, by ``GPT_PLAN``, and
    return it; at tp=1 it is returned as it is. ``mesh``: where this rank sits, a :class:`Parallel`,
    or a torch ``DeviceMesh`` whose "tp" dimension (or only dimension) splits the layers (no
    sequence parallelism: a mesh does not say it).

    Every parameter the plan splits is replaced by this rank's slice under its own name, so tp=1
    state dicts load after ``shard_state_dict``; attention keeps n_head / tp query and
    n_kv_heads / tp key/value heads; every module with a form becomes it. Initialising whole then
    slicing (Megatron's way) makes tp=1 and tp=N start from the same weights for the same seed, at
    the cost of holding the whole model once, briefly (``build_model`` does it on the CPU).
    """
    parallel = mesh
    if isinstance(mesh, DeviceMesh):
        tp_mesh = mesh["tp"] if mesh.ndim > 1 else mesh
        parallel = Parallel(tp_mesh.get_local_rank(), tp_mesh.size(), tp_group=tp_mesh.get_group())
    if parallel.tp_size == 1:
        return model
    check_divisible(model.config, parallel.tp_size)
    for name, module in list(model.named_modules()):
        style = style_of(name)
        if style is not None:
            _apply_style(module, name, style, model.config, parallel)
    return model


def _apply_style(module: nn.Module, name: str, style: Style, config: GPTConfig, parallel: Parallel) -> None:
    """Make one module of a whole GPT, named ``name``, this rank's shard of it, in place."""
    tp = parallel.tp_size
    for param_name, param in list(module.named_parameters(recurse=False)):
        spec = shard_spec(f"{name}.{param_name}", config)
        if spec is not None:
            setattr(module, param_name, nn.Parameter(shard(param.detach(), spec, parallel.tp_rank, tp)))
    if isinstance(module, nn.Linear):  # keep the modules' printed sizes true
        module.out_features, module.in_features = module.weight.shape
    elif isinstance(module, nn.Embedding):
        module.num_embeddings = module.weight.shape[0]
    if style.split == "heads":
        module.n_heads, module.n_kv_heads = module.n_heads // tp, module.n_kv_heads // tp
    if style.form is not None:
        if not issubclass(style.form, type(module)):
            raise TypeError(
                f"parallelize: {name or 'the model'} is a {type(module).__name__}; its plan's form "
                f"{style.form.__name__} is not a subclass of it"
            )
        # The module changes class in place, as torch's fully_shard does, rather than being rebuilt:
        # it keeps its parameters (and so its state-dict names), children, buffers, hooks and
        # attributes, and the GPT stays the caller's object; only its methods become the form's.
        module.__class__ = style.form
        module.parallel = parallel


def build_model(
    config: GPTConfig, backend: str, parallel: Parallel, device: str | torch.device, seed: int
) -> GPT:
    """This rank's shard of a GPT freshly initialised from ``seed``, on ``device``: for every tp
    size, the slices of the one model that tp=1 builds from that seed.

    The whole model is initialised in float32 on the CPU after ``torch.manual_seed(seed)`` (so the
    weights depend on neither the device nor its RNG), sliced (``parallelize``) and then
    moved. The cost: every rank holds the whole model once, briefly, in host memory (4 bytes a
    parameter: 6 GB for GPT-2 1.5B, per rank, so 8 tp ranks of a node need 48 GB together).
    """
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = parallelize(GPT(config, backend), parallel)
    return model.to(device)


# ----------------------------------------------------------------------------------------------
# State dicts by the plan: cutting whole ones into shards, and gathering shards whole
# ----------------------------------------------------------------------------------------------


def check_divisible(config: GPTConfig, tp: int) -> None:
    """Raise, naming the field, unless every tensor-parallel dimension of config splits over tp."""
    sizes = {
        "n_head": config.n_head,
        "n_kv_heads": config.kv_heads,
        "vocab_size": config.vocab_size,
        "mlp_hidden": config.hidden,
    }
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
    return ShardSpec(dim, style.sections(config) if style.sections else None)


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


# ----------------------------------------------------------------------------------------------
# For the trainer: data parallelism, and gradients after the backward
# ----------------------------------------------------------------------------------------------


class _LossOf(nn.Module):
    """model.loss (or loss, its compiled form) as a module's forward: DDP hooks the forward of the
    module it wraps."""

    def __init__(self, model: GPT, loss: Callable):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(idx, targets)


def data_parallel(
    model: GPT, loss: Callable, parallel: Parallel, compute_dtype: torch.dtype | None = None
) -> Callable:
    """Data parallelism over parallel's data-parallel ranks, applied after tensor parallelism and
    before the optimizer is built; returns what the training step calls. The trainer's one place
    for it:

    * dp_shard 1 (DDP): loss (model.loss or its compiled form) under DDP over the data-parallel
      group: the replicas' gradients are averaged in buckets during the backward (``no_sync()``
      skips that); at dp=1, loss itself.
    * dp_shard > 1 (FSDP2, :func:`fully_shard_gpt`): the model's parameters, gradients and
      optimizer state sharded over the dp_shard ranks (and replicated over dp_replicate, HSDP);
      loss must be model.loss (its blocks may be compiled), and model.loss is returned, now
      gathering the parameters it needs.
    """
    if parallel.fsdp:
        if loss != model.loss:
            raise ValueError("data_parallel: under FSDP the loss is model.loss (compile its blocks instead)")
        return fully_shard_gpt(model, parallel, compute_dtype)
    if parallel.dp_size == 1:
        return loss
    device_ids = [torch.cuda.current_device()] if next(model.parameters()).is_cuda else None
    return DistributedDataParallel(_LossOf(model, loss), device_ids, process_group=parallel.dp_group)


def fully_shard_gpt(model: GPT, parallel: Parallel, compute_dtype: torch.dtype | None = None) -> Callable:
    """Shard model (this rank's tensor-parallel shard of a GPT, on its device) over the dp_shard
    ranks with FSDP2, torchtitan's way; returns model.loss, which gathers what it needs.

    One ``fully_shard`` per block and one at the root (the embeddings, the final norm, the LM
    head): each parameter becomes a DTensor cut by rows (dim 0) over parallel.fsdp_mesh (a
    tensor-parallel shard is cut again, as an ordinary tensor: FSDP's groups hold the ranks of
    one tp index). A block's parameters are all-gathered before its forward and again before its
    backward, the next block's gather issued early (prefetched) so that it overlaps this block's
    compute; its gradients are reduce-scattered (averaged over every data-parallel rank, all-reduced
    over dp_replicate) as soon as its backward ends. The last block keeps its parameters gathered
    from its forward to its backward, which comes next. Mixed precision (compute_dtype float16 or
    bfloat16): FSDP2's MixedPrecisionPolicy gathers the parameters in that dtype (half the bytes)
    and reduces the gradients in float32 into the float32 sharded master weights and their float32
    gradients; the optimizer steps on those shards.
    """
    # A block returns its MLP's output, a view when nn.Linear flattens (B, T, C); FSDP warns that an
    # in-place op on it would skip its hooks. The blocks' outputs are only ever added out of place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        last = i == len(blocks) - 1
        fully_shard(block, mesh=parallel.fsdp_mesh, reshard_after_forward=not last, mp_policy=policy)
    fully_shard(model, mesh=parallel.fsdp_mesh, mp_policy=policy)
    for previous, block in itertools.pairwise(blocks):
        previous.set_modules_to_forward_prefetch([block])
        block.set_modules_to_backward_prefetch([previous])
    # GPT.loss is not forward: FSDP's root hooks (gather the embeddings and the head, and start
    # the backward's bookkeeping) must run around it too.
    register_fsdp_forward_method(model, "loss")
    return model.loss


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


def found_nonfinite(flag: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Whether any rank of the world found an inf or NaN: flag (any dtype, nonzero where this rank
    did, e.g. a GradScaler's found_inf) reduced by max over every rank, so that all of them skip the
    step or all take it (under FSDP each rank checked only its own rows). Returns a bool scalar
    tensor."""
    flag = flag.detach().float().amax()  # a new tensor: the caller's flag is left alone
    if parallel.distributed:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
    return flag > 0


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of the model's parameters, their gradients (those present) and the
    optimizer's state, counted from the tensors (a DTensor's local shard only)."""

    def total(tensors: Iterable[torch.Tensor]) -> int:
        return sum(local(t).numel() * t.element_size() for t in tensors)

    params = list(model.parameters())
    moments = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return {
        "parameters": total(params),
        "gradients": total(p.grad for p in params if p.grad is not None),
        "optimizer": total(moments),
    }
