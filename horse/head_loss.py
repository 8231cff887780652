"""The LM head fused with its cross-entropy loss, for ``GPT.loss`` and its tensor-parallel form:
rows in chunks, each chunk's logits computed, turned into the loss and their gradient, and
consumed, so that the (tokens, vocabulary) logits never exist whole (``horse.kernels.cross_entropy``'s
chunk loop). On the Triton kernels, or on their plain-PyTorch twins (the reference backend).
"""

import torch

from horse.kernels import runtime
from horse.kernels.cross_entropy import (
    VocabShard,
    check_options,
    check_target,
    linear_cross_entropy_chunks,
    row_weight,
)
from horse.kernels.cross_entropy import linear_cross_entropy as kernels_linear_cross_entropy


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross entropy of x Wᵀ by the chunk loop of horse.kernels.cross_entropy
    (linear_cross_entropy_chunks). Its gradients (dx a partial sum over the ranks' columns when W is
    a vocabulary shard) are computed in the forward for a loss gradient of 1, then scaled by the real one."""

    @staticmethod
    def forward(ctx, x, weight, targets, shard, use_triton, ignore_index, label_smoothing, z_loss):
        # x (N, C); weight (V_local, C); targets (N,) ids in [0, V) or ignore_index
        dloss = row_weight(targets, ignore_index, "mean")
        wants_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        rows, dx, dweight, _ = linear_cross_entropy_chunks(
            x,
            weight,
            bias=None,
            target=targets,
            dloss=dloss if wants_grad else None,  # None: the chunk loop computes no gradients
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            use_triton=use_triton,
            shard=shard,
        )
        ctx.save_for_backward(dx, dweight)
        return rows.sum() * dloss

    @staticmethod
    def backward(ctx, dloss):
        dx, dweight = ctx.saved_tensors
        return (dx * dloss).to(dx.dtype), (dweight * dloss).to(dweight.dtype), *[None] * 6


def linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    use_triton: bool,
    shard: VocabShard | None = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    fn: str = "linear_cross_entropy",
) -> torch.Tensor:
    """Mean cross entropy (float32 scalar) of the head ``x @ weightᵀ`` against targets: x (N, C),
    weight (V, C), targets (N,) in [0, V) or ignore_index; with a shard, weight holds the rows
    [shard.start, shard.start + V_local) of a vocabulary of shard.vocab, and the shard's collectives
    combine the ranks' chunk statistics. On Triton (use_triton, and x where the kernels run) and no
    shard it is ``horse.kernels.linear_cross_entropy``, a custom op that torch.compile traces whole. fn
    names the caller in errors."""
    use_triton = use_triton and runtime.runs_triton(x)
    if shard is None and use_triton:
        options = {"ignore_index": ignore_index, "label_smoothing": label_smoothing, "z_loss": z_loss}
        return kernels_linear_cross_entropy(x, weight, targets, **options)
    check_options(fn, ignore_index, "mean", label_smoothing, z_loss)
    vocab = weight.shape[0] if shard is None else shard.vocab
    check_target(fn, targets, tuple(x.shape[:1]), vocab, ignore_index, x.device)
    (x,) = runtime.autocast(x)
    options = (ignore_index, label_smoothing, z_loss)
    return _LinearCrossEntropy.apply(x, weight, targets, shard, use_triton, *options)
