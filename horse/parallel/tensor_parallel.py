"""The tensor-parallel forms that ``GPT_PLAN`` (``horse.parallel.plan``) gives a GPT's modules, around
the model's own forwards: hooks that hand a module its input whole from the ranks, and for the
modules whose weight is cut by input columns or vocabulary rows, a module in their place that runs
the same function on this rank's shard and combines the ranks' results. Each form is a function
``form(module, parallel) -> module``: the module to put in the model (the same one, hooked, or its
replacement, holding the same parameters under the same names)."""

from torch import nn

from horse.parallel.collectives import column_parallel_input, copy_to_tp, reduce_from_tp, split_sequence
from horse.parallel.mesh import Parallel
from horse.parallel.row_parallel import RowParallelLinear, VocabParallelEmbedding
from horse.parallel.vocab import _vocab_shard


def column_parallel(module: nn.Module, parallel: Parallel) -> nn.Module:
    """module's first input whole on every tp rank (``column_parallel_input``: gathered from the
    sequence chunks under sequence parallelism; else its gradient summed over the ranks), by a forward
    pre-hook: for a projection split by output rows, or a branch whose projections all are (the MLP,
    which then gathers its input once for its up projections)."""

    def gather_input(module, args, kwargs):
        return (column_parallel_input(args[0], parallel), *args[1:]), kwargs

    module.register_forward_pre_hook(gather_input, with_kwargs=True)
    return module


def row_parallel(module: nn.Module, parallel: Parallel) -> nn.Module:
    """An nn.Linear split by input columns, replaced by a :class:`RowParallelLinear` of its parameters."""
    return RowParallelLinear(module, parallel)


def experts_inter_parallel(module: nn.Module, parallel: Parallel) -> nn.Module:
    """The experts of a mixture of experts (``horse.layers.MoEExperts``: forward(x, ids, weights)), each
    split by its hidden units as the dense MLP is: their inputs, the tokens x and their routing weights,
    whole on every rank with their gradients summed over the ranks (``copy_to_tp``), each rank computing
    its rows of every expert's gate and up projections and its columns of its down projection, and the
    ranks' partial outputs summed (``reduce_from_tp``): one all-reduce forward; backward, one of x's
    gradient and one of the routing weights' (tokens x top_k). The router before them runs whole on
    every rank on the same input, so every rank routes each token alike, and its gradient (complete on
    every rank, the routing weights' being summed) reaches the block's input once, not tp times.
    Not under sequence parallelism, where each rank's router would see only its chunk of the tokens."""
    if parallel.sequence_parallel:
        raise ValueError(
            "parallelize: sequence parallelism does not take a mixture of experts (moe_experts): each "
            "rank's router would see only its chunk of the sequence; use tensor parallelism without it"
        )
    group = parallel.tp_group

    def inputs_whole(module, args):
        x, ids, weights = args
        return copy_to_tp(x, group), ids, copy_to_tp(weights, group)

    def sum_outputs(module, args, y):
        return reduce_from_tp(y, group)

    module.register_forward_pre_hook(inputs_whole)
    module.register_forward_hook(sum_outputs)
    return module


def vocab_parallel(module: nn.Module, parallel: Parallel) -> nn.Module:
    """An nn.Embedding split by vocabulary rows, replaced by a :class:`VocabParallelEmbedding`."""
    return VocabParallelEmbedding(module, parallel)


def vocab_parallel_head(model: nn.Module, parallel: Parallel) -> nn.Module:
    """The GPT's LM head and loss on this rank's vocabulary rows, and under sequence parallelism its
    residual stream on (B, T / tp, C) chunks between the branches:

    * the head's input whole on every rank (``column_parallel`` on ``model.head_input``), and the
      model's vocabulary shard (``model.vocab_shard``: this rank's first id, and the all-reduces that
      combine the ranks' loss statistics), so that its logits are this rank's columns and its loss the
      whole model's on every rank, never gathered;
    * a forward pre-hook on the first block that cuts the stream into this rank's sequence chunk
      (sequence parallelism) and refuses a KV cache (generation runs on a whole model).
    """
    config = model.config
    start = parallel.tp_rank * config.vocab_size // parallel.tp_size  # this rank's first row's id
    model.vocab_shard = _vocab_shard(start, config.vocab_used or config.vocab_size, parallel)
    column_parallel(model.head_input, parallel)

    def enter_stream(block, args, kwargs):
        x, cache = args[0], args[2] if len(args) > 2 else kwargs.get("cache")
        if cache is not None:
            raise ValueError(
                "GPT: the KV cache (generation) runs at tp=1 only; gather the shards into a whole "
                "model first (horse.parallel.gather_state_dicts)"
            )
        return (split_sequence(x, parallel), *args[1:]), kwargs  # (B, T / tp, C) under SP

    model.blocks[0].register_forward_pre_hook(enter_stream, with_kwargs=True)
    return model
