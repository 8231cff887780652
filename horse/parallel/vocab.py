"""The vocabulary-parallel embedding and cross entropy: the token embedding (also the LM head) split by
vocabulary rows over the tp ranks, its lookup and its loss computed without gathering the rows or the
logits."""

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)

from horse import head_loss
from horse.kernels.cross_entropy import VocabShard
from horse.parallel.collectives import _size, column_parallel_input, reduce_from_tp
from horse.parallel.mesh import Parallel


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


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross entropy from logits split by vocabulary columns, in float32.

    loss = log Σ_v exp(z_v - m) - (z_target - m), m the row max: the max, the sum of exponentials
    and the target's logit are each reduced over tp ranks, so no rank sees the whole (N, V) logits.
    Backward: softmax - onehot(target), on this rank's columns.
    """

    @staticmethod
    def forward(ctx, logits, targets, rank, group):
        # logits (N, V/tp): this rank's vocabulary columns; targets (N,): ids in [0, V)
        columns = logits.shape[-1]
        row_max = logits.amax(dim=-1).float()  # (N,); the max is exact in any dtype
        if _size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits.float() - row_max[:, None]  # (N, V/tp), a new float32 tensor
        local = targets - rank * columns
        elsewhere = (local < 0) | (local >= columns)  # targets in another rank's columns
        local = local.masked_fill(elsewhere, 0)
        target_logit = shifted.gather(1, local[:, None]).squeeze(1).masked_fill(elsewhere, 0.0)
        probs = shifted.exp_()
        stats = torch.stack([probs.sum(dim=-1), target_logit])  # (2, N): one all-reduce for both
        if _size(group) > 1:
            dist.all_reduce(stats, group=group)
        sum_exp, target_logit = stats
        probs.div_(sum_exp[:, None])  # the softmax over the whole vocabulary, on this rank's columns
        ctx.save_for_backward(probs, local, elsewhere)
        ctx.logits_dtype = logits.dtype
        return sum_exp.log() - target_logit  # (N,)

    @staticmethod
    def backward(ctx, dloss):
        probs, local, elsewhere = ctx.saved_tensors
        onehot = (~elsewhere).to(probs.dtype)[:, None]  # (N, 1): 1 where the target is ours
        dlogits = probs.scatter_add(1, local[:, None], -onehot) * dloss[:, None]
        return dlogits.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, parallel: Parallel
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar, the same on every tp rank) of logits (N, V/tp), this
    rank's vocabulary columns, against targets (N,) in [0, V); equals ``F.cross_entropy`` of the
    gathered logits, without gathering them."""
    return _VocabParallelCrossEntropy.apply(logits, targets, parallel.tp_rank, parallel.tp_group).mean()


def _vocab_shard(start: int, vocab: int, group: dist.ProcessGroup | None) -> VocabShard:
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
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar, the same on every tp rank) of the LM head ``x @ W_wholeᵀ``
    against targets (B, T) in [0, vocab_used) (or ignore_index), without the logits: x (B, T, C), or
    this rank's chunk (B, T/tp, C) under sequence parallelism; weight (V/tp, C), this rank's rows
    [rank·V/tp, (rank+1)·V/tp) of the head. Rows from vocab_used on (padding) are left out.

    Fused (``horse.head_loss``): rows in chunks, each chunk's logits computed, turned into the
    loss and their gradient, and consumed, on the Triton kernels (use_triton) or their plain-PyTorch
    twins; at tp > 1 one all-reduce of each chunk's row max and one of its sums. At tp=1 on Triton it
    is ``horse.kernels.linear_cross_entropy``, a custom op that torch.compile traces whole.
    """
    rows = weight.shape[0]
    vocab = rows * parallel.tp_size if vocab_used is None else vocab_used
    start = parallel.tp_rank * rows
    weight = weight[: max(0, min(rows, vocab - start))]  # this rank's columns in use
    x = column_parallel_input(x, parallel).flatten(0, 1)  # (B·T, C): the whole sequence on every rank
    vocab_shard = _vocab_shard(start, vocab, parallel.tp_group) if parallel.tp_size > 1 else None
    return head_loss.linear_cross_entropy(
        x,
        weight,
        targets.flatten(),
        use_triton,
        shard=vocab_shard,
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        fn="vocab_parallel_linear_cross_entropy",
    )
