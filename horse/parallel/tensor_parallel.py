"""The layers' tensor-parallel forms, which ``GPT_PLAN`` (``horse.parallel.plan``) assigns."""

import torch
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)
from torch import nn

from horse import kernels
from horse.model import GPT, MLP, KVCache, runs_half_kernels
from horse.parallel.collectives import (
    column_parallel_input,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    split_sequence,
)
from horse.parallel.mesh import Parallel
from horse.parallel.vocab import (
    vocab_parallel_cross_entropy,
    vocab_parallel_embedding,
    vocab_parallel_linear_cross_entropy,
)


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
