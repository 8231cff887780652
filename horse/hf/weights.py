"""The loaders of every source of weights: a Hugging Face folder (``horse.hf.convert`` maps its names
and layout), a horse checkpoint, or a training run's newest checkpoint; and the way out again, a
checkpoint written as a Hugging Face folder. ``python -m horse.checkpoint`` (:func:`main`) exports
and verifies checkpoints.

    from_pretrained(folder)          a GPT holding a Hugging Face folder's weights
    load_model(path)                 (GPT, tokenizer) of a Hugging Face folder, a checkpoint or a run
    pretrained_config(path)          the GPTConfig of any of the three
    load_pretrained(path, model)     their weights into a model, or into a tensor-parallel shard of it
    weight_source(path, config)      their weights read in parts, only those a rank holds (--init-from)
    export(ckpt, out)                a checkpoint (any layout) as a Hugging Face folder
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
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
    hf_parts,
    is_hf_folder,
    is_transposed,
    pad_vocab,
    to_hf,
)
from horse.layers import RotaryEmbedding
from horse.model import GPT, GPTConfig
from horse.parallel import Parallel, shard_state_dict
from horse.parallel.apply import WeightSource


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


# A .bin folder is unpickled whole (torch.load cannot read a part of a tensor), once per host: refused
# above this many bytes of files, about a 500M-parameter float32 model, 2 GiB of host memory.
BIN_LIMIT = 2 * 2**30


def weight_source(path: str | Path, config: GPTConfig) -> WeightSource:
    """The weights of path (a Hugging Face folder, a horse checkpoint or a run's directory; config:
    :func:`pretrained_config` of it) as a ``WeightSource`` for ``horse.parallel.materialize``.

    A safetensors folder (model.safetensors, or the shards model.safetensors.index.json names) is
    read in slices: each call reads only the rows and columns asked for, of each q/k/v part
    separately (GPT-2's transposed Conv1D by columns), the vocabulary's padding rows made as zeros,
    and casts them to float32, so a rank's host holds its part of one tensor at a time. A .bin
    folder is read whole once per host (:func:`_bin_as_safetensors`), and refused above BIN_LIMIT
    bytes with the command that converts it; a horse checkpoint reads only those rows of the pieces
    that hold them (``horse.checkpoint.Pieces.read``)."""
    path = Path(path)
    if not is_hf_folder(path):
        pieces = checkpoint.Pieces(checkpoint.resolve(path))
        return lambda name, rows, columns: pieces.read(name, None, rows, columns)
    if (path / SAFETENSORS).is_file() or (path / SAFETENSORS_INDEX).is_file():
        return SafetensorsSlices(path, config)
    files = list(path.glob("pytorch_model*.bin"))
    size = sum(f.stat().st_size for f in files)
    if size > BIN_LIMIT:
        raise ValueError(
            f"--init-from {path}: {size / 2**30:.1f} GiB of .bin weights, which each host would read "
            f"whole (at most {BIN_LIMIT / 2**30:.0f} GiB); convert the folder to safetensors, which "
            'each rank reads in slices: python -c "import transformers as t; '
            f"t.AutoModelForCausalLM.from_pretrained('{path}').save_pretrained('{path}')\""
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        return SafetensorsSlices(_bin_as_safetensors(path, files), config)
    hf_config, arch = config_from_hf(path)
    return _whole_source(from_hf_tensors(read_tensors(path), hf_config, arch, path))


def _bin_as_safetensors(path: Path, files: list[Path]) -> Path:
    """The .bin folder path as a safetensors folder in this host's temporary directory, written by
    the host's first rank (LOCAL_RANK 0) alone, the one process that unpickles the weights whole,
    while every other rank waits (a barrier over the world); each rank then reads its slices of the
    copy. The copy is named by the files' paths, sizes and times, so a restarted job reuses it."""
    stamp = repr([(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(files)])
    copy = Path(tempfile.gettempdir()) / f"horse-init-from-{hashlib.sha256(stamp.encode()).hexdigest()[:16]}"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (copy / SAFETENSORS).is_file():
        staging = Path(tempfile.mkdtemp(prefix=f"{copy.name}.", dir=copy.parent))
        shutil.copy(path / CONFIG, staging / CONFIG)
        stored = set()  # tensors that share storage (tied weights) are written apart: safetensors' rule
        tensors = {}
        for name, t in read_tensors(path).items():
            storage = t.untyped_storage().data_ptr()
            tensors[name] = t.clone() if storage in stored else t.contiguous()
            stored.add(storage)
        save_file(tensors, staging / SAFETENSORS)
        shutil.rmtree(copy, ignore_errors=True)
        staging.rename(copy)
    dist.barrier()
    return copy


def _whole_source(state: dict[str, torch.Tensor]) -> WeightSource:
    def read(name: str, rows: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
        part = state[name][rows]
        return part if columns is None else part.index_select(1, columns)

    return read


class SafetensorsSlices:
    """A Hugging Face safetensors folder as a ``WeightSource`` (:func:`weight_source`); its tensor
    names and shapes are checked against config at construction, reading no tensor."""

    def __init__(self, path: Path, config: GPTConfig):
        hf_config, self.arch = config_from_hf(path)
        index = path / SAFETENSORS_INDEX
        if (path / SAFETENSORS).is_file():
            with safe_open(path / SAFETENSORS, framework="pt") as f:
                self.file_of = dict.fromkeys(f.keys(), path / SAFETENSORS)
        else:
            self.file_of = {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        base = "transformer." if self.arch == "GPT2LMHeadModel" else "model."
        # saved from the bare GPT2Model / LlamaModel (as OpenAI's GPT-2 on the Hub is): no prefix
        self.strip = "" if any(k.startswith(base) for k in self.file_of) else base
        self.parts = hf_parts(hf_config, self.arch)
        missing = [n for parts in self.parts.values() for n in parts if self._key(n) not in self.file_of]
        if missing:
            raise ValueError(
                f"{path}: {len(missing)} tensor(s) missing for {self.arch} with {config.n_layer} layers: "
                + ", ".join(missing)
            )
        with torch.device("meta"):
            expected = GPT(config).state_dict()
        wrong = [
            f"{', '.join(parts)} (as {name}): {shape}, expected {list(expected[name].shape)}"
            for name, parts in self.parts.items()
            if (shape := self._shape(name)) != list(expected[name].shape)
        ]
        if wrong:
            raise ValueError(f"{path}: tensors of the wrong shape for its {CONFIG}: " + "; ".join(wrong))

    def _key(self, hf_name: str) -> str:
        return hf_name.removeprefix(self.strip)

    def _part_shapes(self, name: str) -> list[list[int]]:
        """The shapes of name's HF tensors, in horse's layout (untransposed), from the files' headers."""
        shapes = []
        for hf_name in self.parts[name]:
            with safe_open(self.file_of[self._key(hf_name)], framework="pt") as f:
                shape = f.get_slice(self._key(hf_name)).get_shape()
            shapes.append(shape[::-1] if is_transposed(self.arch, name) else shape)
        return shapes

    def _shape(self, name: str) -> list[int]:
        """The whole shape of horse parameter name: its parts stacked, the vocabulary padded."""
        shapes = self._part_shapes(name)
        rows = sum(shape[0] for shape in shapes)
        if name in ("wte.weight", "lm_head.weight"):
            rows = pad_vocab(rows)
        return [rows, *shapes[0][1:]]

    def __call__(self, name: str, rows: torch.Tensor, columns: torch.Tensor | None) -> torch.Tensor:
        transposed = is_transposed(self.arch, name)
        pieces, offset = [], 0
        for hf_name in self.parts[name]:
            key = self._key(hf_name)
            with safe_open(self.file_of[key], framework="pt") as f:  # unmapped again after each tensor
                part = f.get_slice(key)
                length = part.get_shape()[-1 if transposed else 0]
                own = rows[(rows >= offset) & (rows < offset + length)] - offset
                pieces += [
                    self._read(part, start, stop, columns, transposed)
                    for start, stop in checkpoint.index_runs(own)
                ]
                width = part.get_shape()[0 if transposed else -1]
            offset += length
        padding = int((rows >= offset).sum())  # the vocabulary's padding rows: zeros
        if padding:
            pieces.append(torch.zeros(padding, width if columns is None else len(columns)))
        return torch.cat(pieces)

    @staticmethod
    def _read(part, start: int, stop: int, columns: torch.Tensor | None, transposed: bool) -> torch.Tensor:
        """Rows start:stop (of horse's layout) of one HF tensor, the given columns, in float32."""
        if len(part.get_shape()) == 1:
            return part[start:stop].float()
        if transposed:  # HF's (in, out): horse's rows are its columns
            ranges = [(0, part.get_shape()[0])] if columns is None else checkpoint.index_runs(columns)
            return torch.cat([part[a:b, start:stop].float() for a, b in ranges]).t()
        if columns is None:
            return part[start:stop].float()
        return torch.cat([part[start:stop, a:b].float() for a, b in checkpoint.index_runs(columns)], dim=1)


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
