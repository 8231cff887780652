"""Tensor parallelism inside a node, data parallelism across nodes (Megatron-style, on torch.distributed).

A 3-D device mesh ``(dp_replicate, dp_shard, tp)``: the tp ranks of one data-parallel index hold
the shards of one model replica and see the same batch; the data-parallel ranks (dp_replicate x
dp_shard of them) hold the same tp shard of different replicas and see different batches. With
dp_shard 1 they each hold all of it and average their gradients with DDP; with dp_shard > 1, FSDP2
shards the parameters, gradients and optimizer state over the dp_shard ranks and replicates that
over dp_replicate (HSDP; ``fully_shard_gpt``). Launched with torchrun; NCCL on GPUs, gloo on the
CPU (the tests).

The model (``horse.model.GPT``) is dense; one table, ``GPT_PLAN``, says per module how it splits
over the tp ranks (by rows, by columns, by heads, or not at all, and which tensor-parallel form it
takes), Megatron's way: the token embedding (also the LM head) by vocabulary rows; attention by
heads, its c_attn column-parallel (rows, in q, k and v sections) and its c_proj row-parallel
(columns); the MLP by hidden units, its input taken whole once for its up projections (rows) and its
down projection row-parallel (columns); a mixture of experts in the MLP's place likewise, by each
expert's hidden units, its router whole on every rank; norms, the position table and the biases
added after a row-parallel projection stay whole on every rank. ``parallelize(model, mesh)`` applies
the table to a model, making it this rank's shard; ``shard_spec`` reads the same table to cut whole
state dicts into shards and gather them again (checkpoints, resharding on resume). A model is built
on the meta device, cut there, and each rank allocates and draws from the seed only the rows and
columns it holds (``build_model``, ``materialize``): every tp size and FSDP layout starts from the
same weights, and no rank holds the whole model.

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
on each rank's vocabulary rows, in the model's own ``GPT.loss``, given the vocabulary shard by the
plan's head form (``vocab_parallel_head``): in row chunks, with an all-reduce of each chunk's row
max and one of its sums, never materialising or gathering the logits (``vocab_parallel_cross_entropy``
is the unfused form, on logits split by vocabulary). The forms hook the collectives onto the
model's modules or put a module holding the same parameters in a layer's place; the model's
forwards are its own at every tp. Every function takes its process group from the ``Parallel`` it
is given; nothing is global.

The package, each module importing only those above it in this list:

    mesh             Parallel, init_from_env: where this process sits
    collectives      the conjugate collectives, and the small reductions of the optimizer and loss scaler
    vocab            the vocabulary-parallel embedding and cross entropy
    row_parallel     the modules that take a layer's place: RowParallelLinear, VocabParallelEmbedding
    tensor_parallel  the layers' tensor-parallel forms, around the model's own forwards
    plan             GPT_PLAN, the table
    shard            state dicts and gradients by the table
    data_parallel    DDP and FSDP2 for the trainer
    apply            parallelize, build_model, materialize, and parallelize_gpt: every transform of a run,
                     in order
"""

from horse.parallel.apply import (
    build_model,
    checkpoint_blocks,
    compile_blocks,
    compile_loss,
    materialize,
    parallelize,
    parallelize_gpt,
)
from horse.parallel.collectives import (
    column_parallel_input,
    copy_to_tp,
    dp_mean,
    found_nonfinite,
    gather_from_sequence,
    local,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    split_sequence,
)
from horse.parallel.data_parallel import (
    data_parallel,
    fully_shard_gpt,
    state_bytes,
)
from horse.parallel.mesh import (
    Parallel,
    check_layout,
    init_from_env,
)
from horse.parallel.plan import (
    GPT_PLAN,
    Style,
    qkv_sections,
    style_of,
)
from horse.parallel.row_parallel import RowParallelLinear, VocabParallelEmbedding
from horse.parallel.shard import (
    ShardSpec,
    allreduce_sequence_parallel_grads,
    check_divisible,
    gather_state_dicts,
    global_grad_norm,
    is_sharded,
    shard,
    shard_spec,
    shard_state_dict,
    unshard,
)
from horse.parallel.tensor_parallel import (
    column_parallel,
    experts_inter_parallel,
    row_parallel,
    vocab_parallel,
    vocab_parallel_head,
)
from horse.parallel.vocab import (
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_parallel_linear_cross_entropy,
)

__all__ = [
    "GPT_PLAN",
    "Parallel",
    "RowParallelLinear",
    "ShardSpec",
    "Style",
    "VocabParallelEmbedding",
    "allreduce_sequence_parallel_grads",
    "build_model",
    "checkpoint_blocks",
    "column_parallel",
    "compile_blocks",
    "compile_loss",
    "check_divisible",
    "check_layout",
    "column_parallel_input",
    "copy_to_tp",
    "data_parallel",
    "dp_mean",
    "experts_inter_parallel",
    "found_nonfinite",
    "fully_shard_gpt",
    "gather_from_sequence",
    "gather_state_dicts",
    "global_grad_norm",
    "init_from_env",
    "is_sharded",
    "local",
    "materialize",
    "parallelize",
    "parallelize_gpt",
    "qkv_sections",
    "reduce_from_tp",
    "reduce_scatter_to_sequence",
    "row_parallel",
    "scatter_to_sequence",
    "shard",
    "shard_spec",
    "shard_state_dict",
    "split_sequence",
    "state_bytes",
    "style_of",
    "unshard",
    "vocab_parallel",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_embedding",
    "vocab_parallel_head",
    "vocab_parallel_linear_cross_entropy",
]
