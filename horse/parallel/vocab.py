"""The vocabulary-parallel embedding and cross entropy: the token embedding (also the LM head) split by
vocabulary rows over the tp ranks, its lookup and its loss computed without gathering the rows or the
logits."""

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)

from horse.kernels.cross_entropy import VocabShard, head_loss
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
