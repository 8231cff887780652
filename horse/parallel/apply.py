"""Applying parallelism to a model: ``parallelize`` makes a whole GPT this rank's tensor-parallel shard
by the plan, ``build_model`` builds that shard from one seed, and ``parallelize_gpt`` applies every
transform of a training run in one stated order (tensor parallelism, activation checkpointing,
compile, data parallelism), as torchtitan's ``parallelize_llama`` does."""

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import checkpoint

from horse.model import GPT, GPTConfig
from horse.parallel.data_parallel import data_parallel
from horse.parallel.mesh import Parallel
from horse.parallel.plan import Style, style_of
from horse.parallel.shard import check_divisible, shard, shard_spec
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
    Initialising whole then slicing (Megatron's way) makes tp=1 and tp=N start from the same weights
    for the same seed, at the cost of holding the whole model once, briefly (``build_model`` does it
    on the CPU).
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


def parallelize_gpt(
    model: GPT,
    parallel: Parallel,
    device: str | torch.device,
    activation_checkpointing: bool = False,
    compile: bool = False,
    compute_dtype: torch.dtype | None = None,
) -> Callable:
    """Make ``model``, a whole GPT (float32 on the CPU: initialised from one seed, pretrained weights
    loaded), this rank's part of a training run; returns what the training step calls. In this
    order, each step relying on the one before:

    1. tensor parallelism (:func:`parallelize`), then the shard moved to ``device``;
    2. activation checkpointing of each block (:func:`checkpoint_blocks`), on the model's own forwards;
    3. torch.compile (fullgraph at tp=1): under FSDP each block (:func:`compile_blocks`), for FSDP's
       hooks to go around; otherwise the loss (:func:`compile_loss`), the checkpointed blocks inside;
    4. data parallelism (``data_parallel``): FSDP2 over the dp_shard ranks (its parameters become
       DTensors, so nothing may reach into them after), or DDP, or nothing at dp=1.
    """
    model = parallelize(model, parallel).to(device)
    if activation_checkpointing:
        checkpoint_blocks(model)
    loss = model.loss
    if compile and parallel.fsdp:
        compile_blocks(model, fullgraph=parallel.tp_size == 1)
    elif compile:
        loss = compile_loss(model, fullgraph=parallel.tp_size == 1)
    return data_parallel(model, loss, parallel, compute_dtype)


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
