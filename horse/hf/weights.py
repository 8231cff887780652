"""The loaders of every source of weights: a Hugging Face folder (``horse.hf.convert`` maps its names
and layout), a horse checkpoint, or a training run's newest checkpoint; and the way out again, a
checkpoint written as a Hugging Face folder. ``python -m horse.checkpoint`` (:func:`main`) exports
and verifies checkpoints.

    from_pretrained(folder)          a GPT holding a Hugging Face folder's weights
    load_model(path)                 (GPT, tokenizer) of a Hugging Face folder, a checkpoint or a run
    pretrained_config(path)          the GPTConfig of any of the three
    load_pretrained(path, model)     their weights into a model, or into a tensor-parallel shard of it
    export(ckpt, out)                a checkpoint (any layout) as a Hugging Face folder
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from horse import checkpoint
from horse.data import BPETokenizer, load_tokenizer
from horse.hf.convert import (
    BIN,
    BIN_INDEX,
    CONFIG,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TOKENIZER,
    config_from_hf,
    from_hf_tensors,
    is_hf_folder,
    to_hf,
)
from horse.layers import RotaryEmbedding
from horse.model import GPT, GPTConfig
from horse.parallel import Parallel, shard_state_dict


def read_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder path's weights (on the CPU): model.safetensors, the shards named by
    model.safetensors.index.json, pytorch_model.bin (read with weights_only=True) or its shards."""
    path = Path(path)
    if (path / SAFETENSORS).is_file():
        return load_file(path / SAFETENSORS)
    if (path / SAFETENSORS_INDEX).is_file() or (path / BIN_INDEX).is_file():
        index = path / (SAFETENSORS_INDEX if (path / SAFETENSORS_INDEX).is_file() else BIN_INDEX)
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for name in files:
            tensors |= _read_file(path / name)
        return tensors
    if (path / BIN).is_file():
        return _read_file(path / BIN)
    raise FileNotFoundError(
        f"{path}: no weights: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, {BIN} or {BIN_INDEX}"
    )


def _read_file(file: Path) -> dict[str, torch.Tensor]:
    if file.suffix == ".safetensors":
        return load_file(file)
    return torch.load(file, map_location="cpu", weights_only=True)


def from_pretrained(path: str | Path, backend: str = "reference") -> GPT:
    """A GPT (float32, on the CPU) holding the weights of the Hugging Face folder path."""
    path = Path(path)
    config, arch = config_from_hf(path)
    state = from_hf_tensors(read_tensors(path), config, arch, path)
    with torch.device("meta"):  # no random initialisation to overwrite, no second copy of the weights
        model = GPT(config, backend)
    model.load_state_dict(state, assign=True)
    if model.rotary is not None:  # derived from the config, not saved: made on the meta device above
        tables = RotaryEmbedding(config.head_dim, config.block_size, config.rope_base)
        model.rotary.cos, model.rotary.sin = tables.cos, tables.sin
    return model


def pretrained_config(path: str | Path) -> GPTConfig:
    """The model config of path: a Hugging Face folder, a horse checkpoint or a run's directory."""
    if is_hf_folder(path):
        return config_from_hf(path)[0]
    return checkpoint.read_metadata(checkpoint.resolve(path))[0]


def load_pretrained(path: str | Path, model: GPT, parallel: Parallel | None = None) -> None:
    """Load the weights of path (as :func:`pretrained_config`) into model, this rank's shard of a
    GPT of pretrained_config(path)."""
    parallel = parallel or Parallel()
    if is_hf_folder(path):
        config, arch = config_from_hf(path)
        state = from_hf_tensors(read_tensors(path), config, arch, Path(path))
    else:
        config, state = model.config, checkpoint.full_weights(checkpoint.resolve(path))
    model.load_state_dict(shard_state_dict(state, config, parallel.tp_rank, parallel.tp_size))


def load_model(path: str | Path, backend: str = "reference") -> tuple[GPT, BPETokenizer | None]:
    """(model, tokenizer) of path: a Hugging Face folder (its tokenizer.json, or None without one),
    or a horse checkpoint or run directory (its tokenizer, by name)."""
    if is_hf_folder(path):
        return from_pretrained(path, backend), tokenizer_of(path)
    ckpt = checkpoint.resolve(path)
    config, name = checkpoint.read_metadata(ckpt)
    model = GPT(config, backend)
    checkpoint.load_weights(ckpt, model)
    return model, load_tokenizer(ckpt, name)


def tokenizer_of(path: str | Path) -> BPETokenizer | None:
    """The tokenizer.json of folder path (None if it has none), or an error naming the file."""
    file = Path(path) / TOKENIZER
    return BPETokenizer(file) if file.is_file() else None


def export(ckpt: str | Path, out: str | Path) -> Path:
    """Write the whole model of checkpoint ckpt (a checkpoint or run directory, any tp size) into
    folder out as a Hugging Face checkpoint: config.json, model.safetensors and, when the run had
    one, tokenizer.json. config.json is moved in last, so a folder without it is an unfinished
    export. Returns the checkpoint exported."""
    ckpt, out = checkpoint.resolve(ckpt), Path(out)
    config, tokenizer = checkpoint.read_metadata(ckpt)
    hf, tensors = to_hf(config, checkpoint.full_weights(ckpt))
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".export.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(tensors, tmp / SAFETENSORS, metadata={"format": "pt"})
    if tokenizer == TOKENIZER:
        shutil.copyfile((ckpt.parent if ckpt.is_file() else ckpt) / TOKENIZER, tmp / TOKENIZER)
    (tmp / CONFIG).write_text(json.dumps(hf, indent=2) + "\n")
    (out / CONFIG).unlink(missing_ok=True)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == CONFIG):
        os.replace(f, out / f.name)
    tmp.rmdir()
    return ckpt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m horse.checkpoint", description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export", help="the whole model in one safetensors file (from any layout)")
    p.add_argument("ckpt", metavar="CKPT_OR_RUN_DIR", help="a checkpoint, or a run's newest complete one")
    p.add_argument("--out", required=True, metavar="OUT", help="the .safetensors file (hf: a folder)")
    p.add_argument(
        "--format",
        choices=("safetensors", "hf"),
        default="safetensors",
        help="hf: a Hugging Face folder (config.json, model.safetensors, tokenizer.json) for transformers",
    )
    p = commands.add_parser("verify", help="check every checkpoint of a run against its manifest")
    p.add_argument("run", metavar="RUN_OR_CKPT_DIR", help="a run's output directory, or one checkpoint")
    args = parser.parse_args(argv)
    if args.command == "verify":
        sys.exit(checkpoint.verify_main(Path(args.run), parser))
    try:
        if args.format == "hf":
            ckpt = export(args.ckpt, args.out)
        else:
            ckpt = checkpoint.export(args.ckpt, args.out)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    tp, dp_shard = checkpoint.layout(ckpt)
    fsdp = f", dp_shard={dp_shard}" if dp_shard > 1 else ""
    print(f"wrote {args.out}: the whole model of {ckpt} (saved at tp={tp}{fsdp})")
