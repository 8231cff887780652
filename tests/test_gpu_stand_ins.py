"""The trainer's paths that only a GPU machine takes, run on the CPU with stand-ins for torch.cuda
and torch.distributed: the local GPU of a rank and the process group's device, the CUDA RNG a
checkpoint keeps and restores, and the NVTX ranges without the nvtx package."""

import contextlib
import dataclasses
import types

import pytest
import torch
from torch.overrides import TorchFunctionMode

from horse import checkpoint, device, train
from horse.kernels import runtime
from horse.loss_scale import LossScaler
from horse.parallel import Parallel
from horse.parallel import mesh as horse_mesh


class StandInCUDA:
    """torch.cuda on a machine with ``count`` GPUs, the current one ``current``, each with its own
    RNG state (a tensor naming the device)."""

    def __init__(self, monkeypatch, count: int, current: int = 0):
        self.count, self.current, self.restored = count, current, []
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "current_device": lambda: self.current,
            "set_device": self.set_device,
            "get_rng_state": self.get_rng_state,
            "get_rng_state_all": lambda: [self.state_of(i) for i in range(self.count)],
            "set_rng_state": self.set_rng_state,
            "set_rng_state_all": lambda states: [self.set_rng_state(s, i) for i, s in enumerate(states)],
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)

    @staticmethod
    def state_of(device: int) -> torch.Tensor:
        return torch.full((16,), device, dtype=torch.uint8)

    def set_device(self, device) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.current = index

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.state_of(self.current)

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        index = self.current if device == "cuda" else torch.device("cuda", device).index
        self.set_device(index)  # invalid device ordinal past the GPUs this machine shows
        self.restored.append((index, int(state[0])))


def test_a_rank_resumes_its_own_rng_on_a_node_with_fewer_gpus(monkeypatch):
    # Saved by the rank on GPU 1 of a 2-GPU node; resumed on a node that shows one GPU.
    cuda = StandInCUDA(monkeypatch, count=2, current=1)
    saved = {}
    monkeypatch.setattr(checkpoint, "save", lambda *args: saved.setdefault("state", args[4]))
    loader = types.SimpleNamespace(state_dict=dict, load_state_dict=lambda state: None)
    tokenizer = types.SimpleNamespace(name="bytes")
    scaler = LossScaler(enabled=False)
    checkpoint.save_run("out", 3, None, None, scaler, loader, train.TrainConfig(), tokenizer, 1, Parallel())
    cuda.count, cuda.current = 1, 0
    monkeypatch.setattr(checkpoint, "load", lambda *args: saved["state"])
    assert checkpoint.restore_run("ckpt", None, None, scaler, loader, Parallel()) == 3
    assert cuda.restored == [(0, 1)]  # the saving rank's state, on this rank's (only) GPU


def test_a_checkpoint_with_every_devices_rng_restores_this_ranks(monkeypatch):
    cuda = StandInCUDA(monkeypatch, count=2, current=1)
    rng = {"torch": torch.get_rng_state(), "cuda": [StandInCUDA.state_of(0), StandInCUDA.state_of(1)]}
    # The scaler's clean steps under torch.amp.GradScaler's name, as checkpoints before LossScaler had them.
    state = {"step": 7, "scaler": {"scale": 8.0, "_growth_tracker": 3}, "loader": {}, "rng": rng}
    # checkpoint.load's state, upgraded to today's format as it reads it (Pieces.state)
    monkeypatch.setattr(checkpoint, "load", lambda *args: checkpoint._upgraded_state(state, None))
    loader = types.SimpleNamespace(load_state_dict=lambda state: None)
    scaler = LossScaler()
    assert checkpoint.restore_run("ckpt", None, None, scaler, loader, Parallel()) == 7
    assert cuda.restored == [(1, 1)] and (scaler.scale_factor, scaler.clean_steps) == (8.0, 3)


@pytest.mark.parametrize("local_rank, count, device", [(5, 4, 1), (3, 8, 3), (2, 1, 0)])
def test_the_local_gpu_is_local_rank_modulo_the_visible_gpus_and_the_group_knows_it(
    local_rank, count, device, monkeypatch
):
    cuda = StandInCUDA(monkeypatch, count)
    calls = {}
    monkeypatch.setattr(horse_mesh.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(
        horse_mesh.dist,
        "init_process_group",
        lambda backend, **kwargs: calls.update(backend=backend, **kwargs),
    )
    mesh = types.SimpleNamespace(get_local_rank=lambda name: 0, get_group=lambda name: None)
    monkeypatch.setattr(horse_mesh, "init_device_mesh", lambda *args, **kwargs: mesh)
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    parallel = horse_mesh.init_from_env(tp=8, device_type="cuda")
    assert cuda.current == device and parallel.tp_size == 8
    assert calls == {"backend": "nccl", "device_id": torch.device("cuda", device)}


def test_nvtx_ranges_fall_back_to_torchs_without_the_nvtx_package(monkeypatch):
    opened = []
    monkeypatch.setattr(device, "nvtx", None)  # the package is not installed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda name: contextlib.nullcontext(opened.append(name)))
    with device.nvtx_range("forward"):
        pass
    assert opened == ["forward"]


class CUDAOnTheCPU(TorchFunctionMode):
    """A fake device layer: every torch call that names a CUDA device gets the CPU instead, and
    pinning memory is a no-op, so code written for a GPU runs on CPU tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.device:  # the code's own devices stay CUDA ones
            return func(*args, **(kwargs or {}))
        args = tuple(self.cpu(a) for a in args)
        kwargs = {k: self.cpu(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)

    @staticmethod
    def cpu(x):
        if isinstance(x, torch.device) and x.type == "cuda":
            return torch.device("cpu")
        return "cpu" if isinstance(x, str) and x.startswith("cuda") else x


def test_the_trainers_gpu_branches_run_and_resume_on_a_stand_in_gpu(monkeypatch, tmp_path, capsys):
    # train() on "cuda": fp16 by default, pinned batches, fused AdamW, NVTX ranges through torch's
    # binding (no nvtx package), MFU from the GPU's name, the CUDA RNG in the checkpoint and back.
    cuda = StandInCUDA(monkeypatch, count=1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *device: "NVIDIA H200")
    monkeypatch.setattr(runtime, "arch", lambda device: runtime.SM90)
    ranges = []
    monkeypatch.setattr(device, "nvtx", None)
    monkeypatch.setattr(torch.cuda.nvtx, "range", lambda name: contextlib.nullcontext(ranges.append(name)))
    small = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16}
    cfg = train.TrainConfig(preset="tiny", backend="reference", batch_size=2, max_steps=2, eval_interval=2,
                            eval_tokens=32, sample_tokens=0, out_dir=str(tmp_path / "run"))  # fmt: skip
    with CUDAOnTheCPU():
        records = train.train(cfg, small)
        resumed = train.train(dataclasses.replace(cfg, max_steps=3, resume=True), small)
    out = capsys.readouterr().out
    assert "horse.train on NVIDIA H200 | backend reference | precision fp16" in out
    assert [r["loss_scale"] for r in records] == [2.0**16] * 2 and all(r["mfu"] > 0 for r in records)
    assert [r["step"] for r in resumed] == [3]
    assert {"data", "forward", "backward", "optimizer"} <= set(ranges)
    assert cuda.restored == [(0, 0)]  # device 0's state, from the checkpoint of step 2
