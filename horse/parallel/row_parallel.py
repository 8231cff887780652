"""The two modules that take the place of a layer under tensor parallelism, because the ranks' results
are combined inside them: a projection split by input columns (the bias is added after the sum) and
the token embedding split by vocabulary rows. Each holds the parameters of the module it replaces,
under the same names."""

import torch
import torch.nn.functional as F  # noqa: N812 (the name every PyTorch reader knows)
from torch import nn

from horse.parallel.collectives import reduce_from_tp, reduce_scatter_to_sequence
from horse.parallel.mesh import Parallel
from horse.parallel.vocab import vocab_parallel_embedding


class RowParallelLinear(nn.Module):
    """An nn.Linear split by input columns: x (B, T, in/tp) -> (B, T, out), or this rank's chunk
    (B, T/tp, out) under sequence parallelism. The ranks' partial products are summed, then the
    replicated bias is added once."""

    def __init__(self, linear: nn.Linear, parallel: Parallel):
        super().__init__()
        self.weight, self.bias, self.parallel = linear.weight, linear.bias, parallel
        self.out_features, self.in_features = linear.weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.parallel.sequence_parallel:
            y = reduce_scatter_to_sequence(y, self.parallel.tp_group)
        else:
            y = reduce_from_tp(y, self.parallel.tp_group)
        return y if self.bias is None else y + self.bias.to(y.dtype)  # in the compute dtype, as nn.Linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features} (of this rank), out_features={self.out_features}"


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding split by vocabulary rows (``vocab_parallel_embedding``). Still an nn.Embedding
    (a torch class), so that what treats embeddings apart (no weight decay) treats it so too."""

    def __init__(self, embedding: nn.Embedding, parallel: Parallel):
        super().__init__(*embedding.weight.shape, device="meta")  # nothing allocated: the weight is taken
        self.weight, self.parallel = embedding.weight, parallel

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_embedding(idx, self.weight, self.parallel)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings} (of this rank), {self.embedding_dim}"
