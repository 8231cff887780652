"""Checkpoints: one directory per step, written whole or not at all.

    OUT/ckpt_0001000/model.safetensors   the float32 master weights; the model config and the
                                         tokenizer's name in the metadata, so the file stands alone
    OUT/ckpt_0001000/state.pt            optimizer, loss scaler, RNG states, data positions, step and
                                         train config: plain tensors and containers, so that
                                         torch.load(weights_only=True) reads it
    OUT/ckpt_0001000/tokenizer.json      the BPE tokenizer, when the data had one

Each is written under a temporary name and renamed into place once every file is on disk, so a
run killed mid-write leaves no directory that :func:`latest` would pick up.
"""

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from horse.model import GPTConfig

WEIGHTS, STATE = "model.safetensors", "state.pt"
_NAME = re.compile(r"ckpt_(\d{7,})")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    out_dir: str | Path,
    step: int,
    model: nn.Module,
    state: dict,
    tokenizer: str,
    tokenizer_file: Path | None = None,
    keep_last: int = 3,
) -> Path:
    """Write checkpoint ``step`` of model (a horse GPT) and state into out_dir; keep the newest keep_last."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    final = out_dir / f"ckpt_{step:07d}"
    tmp = out_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed mid-write
    tmp.mkdir()
    weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    metadata = {"config": json.dumps(dataclasses.asdict(model.config)), "tokenizer": tokenizer}
    save_file(weights, tmp / WEIGHTS, metadata=metadata)
    torch.save(state, tmp / STATE)
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, tmp / tokenizer_file.name)
    for f in tmp.iterdir():
        _fsync(f)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(out_dir)
    for old in complete(out_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old)
    return final


def complete(out_dir: str | Path) -> list[Path]:
    """The complete checkpoints in out_dir, oldest first."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [
        p
        for p in out_dir.iterdir()
        if _NAME.fullmatch(p.name) and (p / WEIGHTS).is_file() and (p / STATE).is_file()
    ]
    return sorted(found, key=lambda p: int(_NAME.fullmatch(p.name).group(1)))


def latest(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in out_dir, or None."""
    found = complete(out_dir)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint directory, or the newest complete one in a run's output directory."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    newest = latest(path)
    if newest is None:
        raise FileNotFoundError(
            f"{path}: neither a checkpoint ({WEIGHTS} inside) nor a directory holding one"
        )
    return newest


def read_metadata(ckpt: str | Path) -> tuple[GPTConfig, str]:
    """(model config, tokenizer name) that checkpoint ckpt was saved with."""
    with safe_open(Path(ckpt) / WEIGHTS, framework="pt") as f:
        metadata = f.metadata() or {}
    if "config" not in metadata:
        raise ValueError(f"{ckpt}/{WEIGHTS}: no model config in its metadata: not a horse checkpoint")
    return GPTConfig(**json.loads(metadata["config"])), metadata.get("tokenizer", "bytes")


def check_config(ckpt: str | Path, config: GPTConfig) -> None:
    """Raise, naming the differing fields, unless ckpt was saved from a model of this config."""
    saved, _ = read_metadata(ckpt)
    if saved != config:
        diff = ", ".join(
            f"{f.name} {getattr(saved, f.name)!r} (this run: {getattr(config, f.name)!r})"
            for f in dataclasses.fields(GPTConfig)
            if getattr(saved, f.name) != getattr(config, f.name)
        )
        raise ValueError(f"checkpoint {ckpt} holds a different model: {diff}")


def load_weights(ckpt: str | Path, model: nn.Module) -> None:
    """Load ckpt's weights into model, or raise naming every tensor that does not fit."""
    device = next(model.parameters()).device
    weights = load_file(Path(ckpt) / WEIGHTS, device=str(device))
    expected = model.state_dict()
    problems = [f"missing {k}" for k in expected.keys() - weights.keys()]
    problems += [f"unexpected {k}" for k in weights.keys() - expected.keys()]
    problems += [
        f"{k} is {list(weights[k].shape)}, the model's is {list(v.shape)}"
        for k, v in expected.items()
        if k in weights and weights[k].shape != v.shape
    ]
    if problems:
        raise ValueError(f"checkpoint {ckpt} does not fit this model: {'; '.join(sorted(problems))}")
    model.load_state_dict(weights)


def load_state(ckpt: str | Path) -> dict:
    return torch.load(Path(ckpt) / STATE, map_location="cpu", weights_only=True)
