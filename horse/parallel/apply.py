"""Applying parallelism to a model: ``parallelize`` makes a whole GPT this rank's tensor-parallel shard
by the plan, ``build_model`` builds that shard from one seed, and ``parallelize_gpt`` applies every
transform of a training run in one stated order (tensor parallelism, activation checkpointing,
compile, data parallelism), as torchtitan's ``parallelize_llama`` does."""

import functools
from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils.checkpoint import checkpoint

from horse.layers import RotaryEmbedding
from horse.model import GPT, GPTConfig, initial_rows
from horse.parallel.collectives import local
from horse.parallel.data_parallel import data_parallel
from horse.parallel.mesh import Parallel
from horse.parallel.plan import Style, style_of
from horse.parallel.shard import ShardSpec, check_divisible, shard, shard_spec
from horse.parallel.tensor_parallel import row_parallel, vocab_parallel, vocab_parallel_head

# The modules the forms that replace or read a module take (the others hook any module).
FORM_TAKES = {row_parallel: nn.Linear, vocab_parallel: nn.Embedding, vocab_parallel_head: GPT}


def parallelize(model: GPT, mesh: Parallel | DeviceMesh) -> GPT:
    """Make ``model``, a whole GPT, this rank's tensor-parallel shard in place, by ``GPT_PLAN``, and
    return it; at tp=1 it is returned as it is. ``mesh``: where this rank sits, a :class:`Parallel`,
    or a torch ``DeviceMesh`` whose "tp" dimension (or only dimension) splits the layers (no
    sequence parallelism: a mesh does not say it).

    Every parameter the plan splits is replaced by this rank's slice under its own name, so tp=1
    state dicts load after ``shard_state_dict``; attention keeps n_head / tp query and
    n_kv_heads / tp key/value heads; every module with a form takes it (hooks on the module, or a
    module in its place holding the same parameters), so the model's own forwards run on the shards.
    On a model built on the meta device it cuts shapes only, allocating nothing (``build_model``).
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
        if style is None:
            continue
        shard_module = _apply_style(module, name, style, model.config, parallel)
        if shard_module is not module:  # a form that takes the module's place (the GPT's form never does)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, shard_module)
    return model


def _apply_style(
    module: nn.Module, name: str, style: Style, config: GPTConfig, parallel: Parallel
) -> nn.Module:
    """One module of a whole GPT, named ``name``, made this rank's shard of it: its parameters cut in
    place, then its form applied; returns the module to put in its place (the module itself, hooked, or
    the form's replacement, holding the same parameters)."""
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
    if style.form is None:
        return module
    takes = FORM_TAKES.get(style.form, nn.Module)
    if not isinstance(module, takes):
        raise TypeError(
            f"parallelize: {name or 'the model'} is a {type(module).__name__}; its plan's form "
            f"{style.form.__name__} takes a {takes.__name__}"
        )
    return style.form(module, parallel)


def build_model(
    config: GPTConfig, backend: str, parallel: Parallel, device: str | torch.device, seed: int
) -> GPT:
    """This rank's tensor-parallel shard of a GPT freshly initialised from ``seed``, on ``device``:
    for every tp size, the slices of the one model that tp=1 builds from that seed. Built on the
    meta device, cut by the plan there, then only this rank's shard allocated and drawn
    (:func:`materialize`): no rank ever holds the whole model."""
    with torch.device("meta"):
        model = parallelize(GPT(config, backend), parallel)
    materialize(model, parallel, device, seed)
    return model


class WeightSource(Protocol):
    """Whole tensors by parameter name, read in parts: ``source(name, rows, columns)`` is the float32
    tensor ``whole[rows][:, columns]`` (columns None: all of them), or ``whole[rows][:, :, columns]``
    for a tensor the plan cuts along dim 2 (the experts' down_proj); rows and columns are ascending
    indices of the whole tensor."""

    def __call__(self, name: str, rows: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor: ...


def materialize(
    model: GPT,
    parallel: Parallel,
    device: str | torch.device,
    seed: int | None,
    source: WeightSource | None = None,
) -> None:
    """Allocate on ``device`` the parameters and buffers of ``model``, built on the meta device and
    made this rank's part by ``parallelize`` (and by FSDP2's ``fully_shard`` or not), then draw from
    ``seed`` exactly the values this rank holds; seed None: leave the parameters uninitialised, for a
    checkpoint to fill (a resume builds no throw-away model); ``source``: read exactly those values
    from it instead (``--init-from``: ``horse.hf.weights.weight_source``, which reads only these slices).

    Every local tensor is a set of rows and columns of the whole tensor: the tp slices of its
    sections along the plan's dim (``shard`` of the indices), then FSDP's rows (dim 0) of that. Its
    rows come from ``initial_rows``, which draws them from per-row-block generators, so every layout
    gets the same values; a tensor cut by columns (the row-parallel projections) has its rows drawn
    whole, ROWS_AT_ONCE at a time, then sliced. A source is asked for the rows and columns at once.
    """
    model.to_empty(device=device)
    config = model.config
    if model.rotary is not None:  # a table derived from the config, not saved
        fresh = RotaryEmbedding(config.head_dim, config.block_size, config.rope_base, device=device)
        model.rotary.cos.copy_(fresh.cos)
        model.rotary.sin.copy_(fresh.sin)
    if seed is None and source is None:
        return
    with torch.no_grad():
        for name, param in model.named_parameters():
            _fill(name, param, config, parallel, seed, source)


# Rows drawn and copied at once: bounds the host memory of drawing a column-cut tensor's whole rows
# (4 MiB a row block of 4096-wide rows, 117 MiB of a 70B model's 28672-wide down projection).
ROWS_AT_ONCE = 1024


def _fill(
    name: str,
    param: torch.Tensor,
    config: GPTConfig,
    parallel: Parallel,
    seed: int | None,
    source: WeightSource | None,
) -> None:
    """Fill this rank's part of parameter ``name`` (a tensor, or a DTensor cut by FSDP) with the
    values the whole model holds there: read from source, or drawn from ``seed``."""
    local_part = local(param)
    if local_part.numel() == 0:  # FSDP's last ranks may hold no rows of a small tensor
        return
    spec = shard_spec(name, config) if parallel.tp_size > 1 else None
    whole_shape = list(param.shape)  # this rank's tp shard's shape (FSDP's global shape)
    if spec is not None:
        whole_shape[spec.dim] *= parallel.tp_size

    def tp_indices(dim: int) -> torch.Tensor:
        """The whole tensor's indices along dim that this rank's tp shard holds, in order."""
        indices = torch.arange(whole_shape[dim])
        if spec is None or spec.dim != dim:
            return indices
        return shard(indices, ShardSpec(0, spec.sections), parallel.tp_rank, parallel.tp_size)

    first_row = 0
    if isinstance(param, DTensor):  # FSDP's rows of the tp shard
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        first_row = offset[0]
    rows = tp_indices(0)[first_row : first_row + local_part.shape[0]]
    columns = tp_indices(spec.dim) if spec is not None and spec.dim > 0 else None  # along the cut dim
    if source is not None:
        local_part.copy_(source(name, rows, columns).view_as(local_part))
        return
    for start in range(0, len(rows), ROWS_AT_ONCE):
        values = initial_rows(name, torch.Size(whole_shape), rows[start : start + ROWS_AT_ONCE], config, seed)
        if columns is not None:
            values = values.index_select(spec.dim, columns)
        local_part[start : start + ROWS_AT_ONCE].copy_(values)


def parallelize_gpt(
    model: GPT,
    parallel: Parallel,
    device: str | torch.device,
    activation_checkpointing: bool = False,
    compile: bool = False,
    compute_dtype: torch.dtype | None = None,
    seed: int | None = None,
    source: WeightSource | None = None,
) -> Callable:
    """Make ``model``, a whole GPT, this rank's part of a training run; returns what the training step
    calls. ``model`` is either built on the meta device (``with torch.device("meta")``), and this
    rank's part of it is then allocated on ``device`` and drawn from ``seed``, or read from ``source``
    (:func:`materialize`; neither: left for a checkpoint to fill), or whole, float32 on the CPU, and
    then cut. In this order, each step relying on the one before:

    1. tensor parallelism (:func:`parallelize`), on the meta device or then moved to ``device``;
    2. activation checkpointing of each block (:func:`checkpoint_blocks`), on the model's own forwards;
    3. torch.compile (fullgraph at tp=1): under FSDP each block (:func:`compile_blocks`), for FSDP's
       hooks to go around; otherwise the loss (:func:`compile_loss`), the checkpointed blocks inside;
    4. data parallelism (``data_parallel``): FSDP2 over the dp_shard ranks (its parameters become
       DTensors, so nothing may reach into them after), or DDP, or nothing at dp=1. A deferred model
       is materialised after FSDP cuts it (each rank allocates its rows only), before DDP (which
       broadcasts rank 0's weights as it wraps).
    """
    deferred = model.wte.weight.is_meta
    model = parallelize(model, parallel)
    if not deferred:
        model.to(device)
    if activation_checkpointing:
        checkpoint_blocks(model)
    loss = model.loss
    if compile and parallel.fsdp:
        compile_blocks(model, fullgraph=parallel.tp_size == 1)
    elif compile:
        loss = compile_loss(model, fullgraph=parallel.tp_size == 1)
    if deferred and not parallel.fsdp:
        materialize(model, parallel, device, seed, source)
    loss = data_parallel(model, loss, parallel, compute_dtype)
    if deferred and parallel.fsdp:
        materialize(model, parallel, device, seed, source)
    return loss


def compile_loss(model, fullgraph: bool):
    """model.loss under torch.compile; fullgraph: a graph break is an error, not a silent split."""
    return torch.compile(model.loss, fullgraph=fullgraph)


def compile_blocks(model, fullgraph: bool) -> None:
    """Each of model's blocks under torch.compile, in place (its forward, after activation
    checkpointing wrapped it), for FSDP2 to wrap next: its hooks gather a block's parameters
    around the compiled forward, and the embeddings, the LM head and the loss run eagerly.
    Parameter names do not change (no ``_orig_mod.``), so checkpoints do not either."""
    for block in model.blocks:
        block.forward = torch.compile(block.forward, fullgraph=fullgraph)


def checkpoint_blocks(model) -> None:
    """Recompute each of model's blocks in the backward (non-reentrant torch.utils.checkpoint): the
    forward keeps a block's inputs only. Generation (a KV cache) and no-grad passes run as before.
    The parameters and their names are the model's own, so checkpoints do not change."""
    for block in model.blocks:
        block.forward = functools.partial(_recomputed, block.forward)


def _recomputed(forward, x, h, cache, layer, documents=None):
    if cache is not None or not torch.is_grad_enabled():
        return forward(x, h, cache, layer, documents)
    return checkpoint(forward, x, h, cache, layer, documents, use_reentrant=False)
