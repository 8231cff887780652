"""Tensor parallelism inside a node, data parallelism across nodes (Megatron-style, on torch.distributed).

A 2-D device mesh ``(dp, tp)``: the tp ranks of one dp index hold the shards of one model replica
and see the same batch; the dp ranks hold the same shard of different replicas and see different
batches. Launched with torchrun; NCCL on GPUs, gloo on the CPU (the tests).

How the GPT's parameters are split over tp ranks (``shard_spec``): the token embedding (also the LM
head) by vocabulary rows; attention by heads (c_attn's rows, in q, k and v parts; c_proj's
columns); the MLP's first projection by output rows, its second by input columns; norms, the
position table and the biases added after a row-parallel projection are replicated.
"""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from horse.model import GPTConfig


@dataclass(frozen=True)
class Parallel:
    """Where this process sits. Without torch.distributed (one process) every size is 1, groups None.

    tp_group / dp_group: the process groups of this rank's tensor- and data-parallel peers
    sequence_parallel: norms and residual adds run on sequence shards between the tp regions
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_from_env(tp: int = 1, sequence_parallel: bool = False, device_type: str | None = None) -> Parallel:
    """The process groups of a torchrun launch (WORLD_SIZE in the environment), or a single process.

    tp must divide the world size; dp = world size / tp. Ranks of one node are consecutive under
    torchrun, so tp ranks (consecutive in the mesh's last dimension) share a node's NVLink.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must be at least 1 and divide the world size {world}")
    if world == 1:
        return Parallel(sequence_parallel=sequence_parallel and tp > 1)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    mesh = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return Parallel(
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=tp,
        dp_rank=mesh.get_local_rank("dp"),
        dp_size=world // tp,
        tp_group=mesh.get_group("tp"),
        dp_group=mesh.get_group("dp"),
        sequence_parallel=sequence_parallel and tp > 1,
    )


# ----------------------------------------------------------------------------------------------
# How parameters are sharded, and resharding whole state dicts
# ----------------------------------------------------------------------------------------------


def check_divisible(config: GPTConfig, tp: int) -> None:
    """Raise, naming the field, unless every tensor-parallel dimension of config splits over tp."""
    sizes = {
        "n_head": config.n_head,
        "n_kv_heads": config.kv_heads,
        "vocab_size": config.vocab_size,
        "mlp_hidden": config.hidden,
    }
    bad = [f"{name} {size}" for name, size in sizes.items() if size % tp]
    if bad:
        raise ValueError(f"tensor parallel size {tp} must divide {', '.join(bad)}")


def shard_spec(name: str, config: GPTConfig) -> tuple[int, list[int]] | None:
    """How the parameter (or its optimizer state) ``name`` splits over tp ranks: (dim, parts), or
    None for replicated. parts are consecutive sections along dim that are split separately (each
    rank takes 1/tp of every part, in order): c_attn's q, k and v rows; one part otherwise."""
    leaf = name.removeprefix("module.")  # a DDP-wrapped model's names
    if leaf == "wte.weight":
        return 0, [config.vocab_size]
    if ".attn.c_attn." in leaf:
        q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
        return 0, [q, kv, kv]
    if leaf.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias", "gate_proj.weight", "up_proj.weight")):
        return 0, [config.hidden]
    if leaf.endswith(("attn.c_proj.weight",)):
        return 1, [config.d_model]
    if leaf.endswith(("mlp.c_proj.weight", "down_proj.weight")):
        return 1, [config.hidden]
    return None


def shard(full: torch.Tensor, spec: tuple[int, list[int]] | None, rank: int, size: int) -> torch.Tensor:
    """This rank's shard of a full tensor (a copy of it when replicated)."""
    if spec is None:
        return full.clone()
    dim, parts = spec
    pieces = full.split(parts, dim=dim)
    return torch.cat([p.chunk(size, dim=dim)[rank] for p in pieces], dim=dim).contiguous()


def unshard(shards: list[torch.Tensor], spec: tuple[int, list[int]] | None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the first when replicated)."""
    if spec is None:
        return shards[0].clone()
    dim, parts = spec
    size = len(shards)
    local = [p // size for p in parts]
    per_rank = [s.split(local, dim=dim) for s in shards]  # [rank][part]
    return torch.cat([torch.cat([r[i] for r in per_rank], dim=dim) for i in range(len(parts))], dim=dim)


def shard_state_dict(full: dict, config: GPTConfig, rank: int, size: int) -> dict:
    """Rank ``rank`` of ``size``'s shard of a whole model's state dict (parameter name -> tensor)."""
    check_divisible(config, size)
    return {name: shard(t, shard_spec(name, config), rank, size) for name, t in full.items()}


def gather_state_dicts(shards: list[dict], config: GPTConfig) -> dict:
    """The whole model's state dict from every tp rank's shard, in rank order."""
    return {name: unshard([s[name] for s in shards], shard_spec(name, config)) for name in shards[0]}
