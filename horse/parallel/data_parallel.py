"""Data parallelism for the trainer: DDP, or FSDP2 over the dp_shard ranks (HSDP with dp_replicate),
applied after tensor parallelism; and the bytes of state a rank holds."""

import itertools
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.nn.parallel import DistributedDataParallel

from horse.model import GPT
from horse.parallel.collectives import local
from horse.parallel.mesh import Parallel


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
