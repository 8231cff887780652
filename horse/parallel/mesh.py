"""Where a process sits: the 3-D device mesh (dp_replicate, dp_shard, tp) of a torchrun launch, as a
:class:`Parallel` that every other function of ``horse.parallel`` takes its process groups from."""

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True)
class Parallel:
    """Where this process sits. Without torch.distributed (one process) every size is 1, groups None.

    dp_rank / dp_size: this rank's data-parallel replica (its slice of each batch) among all of them:
        dp_size = dp_replicate x dp_shard, dp_rank = replicate index x dp_shard + shard index
    dp_shard_size: the data-parallel ranks that shard the parameters, gradients and optimizer state
        among them (FSDP2); 1: each replica holds them whole (DDP)
    tp_group / dp_group / dp_shard_group: the process groups of this rank's tensor-parallel,
        data-parallel and dp-shard peers (dp_shard_group is None without FSDP)
    fsdp_mesh: the mesh FSDP2 shards over: ("dp_shard",), or ("dp_replicate", "dp_shard") for HSDP;
        None without FSDP
    sequence_parallel: norms and residual adds run on sequence shards between the tp regions
    """

    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    tp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    sequence_parallel: bool = False
    dp_shard_size: int = 1
    dp_shard_group: dist.ProcessGroup | None = None
    fsdp_mesh: DeviceMesh | None = None

    @property
    def rank(self) -> int:
        return self.dp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 shards the parameters, gradients and optimizer state (dp_shard > 1)."""
        return self.dp_shard_size > 1

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard_size

    @property
    def dp_replicate_size(self) -> int:
        return self.dp_size // self.dp_shard_size

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard_size


def check_layout(world: int, tp: int, dp_shard: int = 1, dp_replicate: int | None = None) -> int:
    """dp_replicate (given, or the data-parallel ranks left over), after checking that
    dp_replicate x dp_shard x tp is the world size; a ValueError naming the values otherwise."""
    for name, value in (("--tp", tp), ("--dp-shard", dp_shard), ("--dp-replicate", dp_replicate)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if world % (tp * dp_shard):
        if dp_shard == 1:
            raise ValueError(f"--tp {tp} must divide the world size {world}")
        raise ValueError(
            f"--dp-shard {dp_shard} x --tp {tp} = {dp_shard * tp} must divide the world size {world}"
        )
    if dp_replicate is None:
        return world // (tp * dp_shard)
    if dp_replicate * dp_shard * tp != world:
        raise ValueError(
            f"--dp-replicate {dp_replicate} x --dp-shard {dp_shard} x --tp {tp} = "
            f"{dp_replicate * dp_shard * tp} is not the world size {world}"
        )
    return dp_replicate


def init_from_env(
    tp: int = 1,
    sequence_parallel: bool = False,
    device_type: str | None = None,
    dp_shard: int = 1,
    dp_replicate: int | None = None,
) -> Parallel:
    """The process groups of a torchrun launch (WORLD_SIZE in the environment), or a single process.

    A 3-D device mesh (dp_replicate, dp_shard, tp) whose sizes multiply to the world size
    (:func:`check_layout`; dp_replicate defaults to what is left over). Ranks of one node are
    consecutive under torchrun, so tp ranks (consecutive in the mesh's last dimension) share a
    node's NVLink, and the dp_shard ranks come next: at tp 1 a node's 8 GPUs shard among them.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dp_replicate = check_layout(world, tp, dp_shard, dp_replicate)
    if world == 1:
        return Parallel(sequence_parallel=sequence_parallel and tp > 1)
    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    device = None
    if device_type == "cuda":
        # Modulo the GPUs this process sees: one GPU per process (CUDA_VISIBLE_DEVICES set per rank
        # by a launcher) or a node that shows fewer GPUs than it runs ranks.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # device_id: NCCL binds the communicator to this GPU up front (no guess from the rank).
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", device_id=device)
    names = ("dp_replicate", "dp_shard", "tp")
    mesh = init_device_mesh(device_type, (dp_replicate, dp_shard, tp), mesh_dim_names=names)
    replicate_rank, shard_rank = mesh.get_local_rank("dp_replicate"), mesh.get_local_rank("dp_shard")
    if dp_shard == 1:
        dp_group = mesh.get_group("dp_replicate")
    elif dp_replicate == 1:
        dp_group = mesh.get_group("dp_shard")
    else:  # both: the one group of every data-parallel rank, for the loss's mean and evaluation
        dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()
    fsdp_mesh = None
    if dp_shard > 1:  # a 2-D mesh makes FSDP2 hybrid: sharded on dp_shard, replicated on dp_replicate
        fsdp_mesh = mesh["dp_shard"] if dp_replicate == 1 else mesh["dp_replicate", "dp_shard"]
    return Parallel(
        tp_rank=mesh.get_local_rank("tp"),
        tp_size=tp,
        dp_rank=replicate_rank * dp_shard + shard_rank,
        dp_size=dp_replicate * dp_shard,
        tp_group=mesh.get_group("tp"),
        dp_group=dp_group,
        sequence_parallel=sequence_parallel and tp > 1,
        dp_shard_size=dp_shard,
        dp_shard_group=mesh.get_group("dp_shard") if dp_shard > 1 else None,
        fsdp_mesh=fsdp_mesh,
    )
