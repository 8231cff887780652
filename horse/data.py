"""Token data: the built-in corpus, the tokenizers, binary token shards and the batch loader.

    python -m horse.data prepare INPUT... --out DIR [--tokenizer tokenizer.json] [--val-fraction 0.1]

``prepare`` tokenises text files (bytes by default; a BPE ``tokenizer.json`` when the ``tokenizers``
package is installed), holds out the last ``val-fraction`` of each file's tokens for validation,
and writes DIR/train_000.bin ..., DIR/val_000.bin ... and DIR/meta.json (the tokenizer, the
vocabulary size, every shard with its token count; a BPE tokenizer.json is copied beside them).

A shard is a 32-byte little-endian header, then its tokens:

    magic b"HORSETOK" | version u32 | bytes per token u32 (2: uint16, 4: uint32 for vocabularies
    above 65,535) | token count u64 | vocabulary size u32 | reserved u32

Shards are memory-mapped when loaded, after the header has been checked against the file's size
and meta.json, so a truncated, foreign or mismatched file is an error, never garbage tokens.
"""

import argparse
import importlib.resources
import json
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"HORSETOK"
VERSION = 1
HEADER = struct.Struct("<8sIIQII")
SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard
CORPUS = "tinyshakespeare.txt"


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download or train."""

    name = "bytes"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")  # a sample may end mid-character


class BPETokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a local tokenizer.json (no downloads)."""

    name = "tokenizer.json"

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(
                f"a BPE tokenizer ({path}) needs the tokenizers package: pip install tokenizers"
            ) from e
        if not Path(path).is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist")
        self.path = Path(path)
        self._tokenizer = Tokenizer.from_file(str(path))
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)


def load_tokenizer(directory: str | Path, name: str) -> ByteTokenizer | BPETokenizer:
    """The tokenizer ``name`` ("bytes" or "tokenizer.json") recorded for data or a checkpoint in
    directory (or for a file in it: an exported model.safetensors)."""
    directory = Path(directory)
    if directory.is_file():
        directory = directory.parent
    if name == ByteTokenizer.name:
        return ByteTokenizer()
    if name == BPETokenizer.name:
        return BPETokenizer(Path(directory) / name)
    raise ValueError(f"{directory}: unknown tokenizer {name!r} (expected 'bytes' or 'tokenizer.json')")


# ----------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def write_shard(path: str | Path, tokens: np.ndarray, vocab_size: int) -> None:
    dtype = token_dtype(vocab_size)
    with open(path, "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, dtype.itemsize, len(tokens), vocab_size, 0))
        f.write(np.ascontiguousarray(tokens, dtype=dtype.newbyteorder("<")).tobytes())


def read_shard(path: str | Path) -> tuple[np.ndarray, int]:
    """Memory-map a shard after checking its header; returns (tokens, vocabulary size)."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER.size:
        raise ValueError(f"{path}: {size} bytes, shorter than the {HEADER.size}-byte shard header: truncated")
    with open(path, "rb") as f:
        magic, version, itemsize, count, vocab_size, _ = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise ValueError(
            f"{path}: not a Little Horse token shard (starts with {magic!r}, expected {MAGIC!r})"
        )
    if version != VERSION:
        raise ValueError(f"{path}: shard format version {version}; this version of horse reads {VERSION}")
    if itemsize != token_dtype(vocab_size).itemsize:
        raise ValueError(
            f"{path}: corrupt header: {itemsize} bytes per token for a vocabulary of {vocab_size} "
            f"(expected {token_dtype(vocab_size).itemsize})"
        )
    expected = HEADER.size + count * itemsize
    if size != expected:
        raise ValueError(
            f"{path}: the header promises {count:,} tokens ({expected:,} bytes) but the file has {size:,} "
            "bytes: truncated or corrupt"
        )
    dtype = token_dtype(vocab_size).newbyteorder("<")
    if count == 0:
        return np.empty(0, dtype=dtype), vocab_size
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER.size, shape=(count,)), vocab_size


def prepare(
    inputs: list[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    val_fraction: float = 0.1,
    shard_tokens: int = SHARD_TOKENS,
) -> dict:
    """Tokenise text files into train/val shards in out_dir (see the module docstring); returns meta."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be at least 1, got {shard_tokens}")
    tok = ByteTokenizer() if tokenizer is None else BPETokenizer(tokenizer)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"version": VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "train": [], "val": []}
    pending = {"train": [], "val": []}

    def flush(split: str, final: bool) -> None:
        tokens = np.concatenate(pending[split]) if pending[split] else np.empty(0, dtype=np.int64)
        while len(tokens) >= shard_tokens or (final and len(tokens)):
            name = f"{split}_{len(meta[split]):03d}.bin"
            write_shard(out_dir / name, tokens[:shard_tokens], tok.vocab_size)
            meta[split].append({"file": name, "tokens": int(min(len(tokens), shard_tokens))})
            tokens = tokens[shard_tokens:]
        pending[split] = [tokens]

    for path in inputs:
        tokens = np.asarray(tok.encode(Path(path).read_text(encoding="utf-8")), dtype=np.int64)
        n_val = int(len(tokens) * val_fraction)
        pending["train"].append(tokens[: len(tokens) - n_val])
        pending["val"].append(tokens[len(tokens) - n_val :])
        for split in pending:
            flush(split, final=False)
    for split in pending:
        flush(split, final=True)
        if not meta[split]:
            raise ValueError(
                f"prepare: no {split} tokens from {[str(p) for p in inputs]}: the inputs are too short"
            )
    if isinstance(tok, BPETokenizer):
        shutil.copyfile(tok.path, out_dir / BPETokenizer.name)
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


# ----------------------------------------------------------------------------------------------
# Data sets
# ----------------------------------------------------------------------------------------------


@dataclass
class Split:
    """One split of a data set: token arrays (memory-mapped shards, or the corpus in memory)."""

    name: str  # for error messages: where the tokens came from
    shards: list[np.ndarray]
    vocab_size: int


def builtin_text() -> str:
    """The built-in corpus, tiny Shakespeare (1.1 MB), shipped inside the package."""
    return (importlib.resources.files("horse") / "corpus" / CORPUS).read_text(encoding="utf-8")


def load_dataset(data: str | Path | None = None) -> tuple[Split, Split, ByteTokenizer | BPETokenizer]:
    """(train, val, tokenizer) of a directory made by :func:`prepare`; None or "": the built-in
    corpus as bytes, its last 10 % for validation."""
    if not data:
        tokens = np.frombuffer(builtin_text().encode("utf-8"), dtype=np.uint8)
        n_val = len(tokens) // 10
        name = f"built-in {CORPUS}"
        return (
            Split(f"{name} (train)", [tokens[:-n_val]], 256),
            Split(f"{name} (val)", [tokens[-n_val:]], 256),
            ByteTokenizer(),
        )
    data = Path(data)
    if not (data / "meta.json").is_file():
        raise FileNotFoundError(
            f"data {data}: no meta.json there; make it with `python -m horse.data prepare`"
        )
    meta = json.loads((data / "meta.json").read_text())
    if meta.get("version") != VERSION:
        raise ValueError(
            f"data {data}: meta.json version {meta.get('version')}; this version of horse reads {VERSION}"
        )
    tokenizer = load_tokenizer(data, meta["tokenizer"])
    splits = []
    for split in ("train", "val"):
        shards = []
        for entry in meta[split]:
            tokens, vocab_size = read_shard(data / entry["file"])
            if vocab_size != meta["vocab_size"] or len(tokens) != entry["tokens"]:
                raise ValueError(
                    f"{data / entry['file']}: {len(tokens):,} tokens of a {vocab_size}-token vocabulary, but "
                    f"meta.json lists {entry['tokens']:,} of {meta['vocab_size']}: the shard is from another "
                    "data set"
                )
            shards.append(tokens)
        splits.append(Split(f"{data} ({split})", shards, meta["vocab_size"]))
    if tokenizer.vocab_size != meta["vocab_size"]:
        raise ValueError(
            f"data {data}: meta.json says vocabulary {meta['vocab_size']} but {meta['tokenizer']} has "
            f"{tokenizer.vocab_size}"
        )
    return splits[0], splits[1], tokenizer


class Loader:
    """Batches of (input, target) windows, (batch_size, seq_len) int64 each, target shifted by one.

    Batch number ``position`` is a pure function of (seed, position): windows start at uniformly
    random offsets drawn from a generator seeded with both, never crossing a shard's end. So a
    seed fixes the whole order, and a loader set back to a saved position continues exactly. On a
    GPU the batch goes through pinned memory with a non-blocking copy.

    Data parallel: the global batch is dp_size · batch_size windows, and data-parallel rank
    dp_rank reads its own consecutive batch_size of them. So dp ranks see different data, every
    rank keeps the same position, and one process with batch_size · dp_size reads the same windows.
    """

    def __init__(
        self,
        split: Split,
        batch_size: int,
        seq_len: int,
        seed: int,
        device: str | torch.device = "cpu",
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"Loader: dp_rank {dp_rank} must be in [0, dp_size {dp_size})")
        self.split, self.batch_size, self.seq_len, self.seed = split, batch_size, seq_len, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.device = torch.device(device)
        self.position = 0
        # A window needs seq_len + 1 tokens; shard i offers len - seq_len starts.
        self._starts = np.array([max(len(s) - seq_len, 0) for s in split.shards], dtype=np.int64)
        self._ends = np.cumsum(self._starts)
        if not len(self._ends) or self._ends[-1] == 0:
            longest = max((len(s) for s in split.shards), default=0)
            raise ValueError(
                f"{split.name}: no shard holds seq_len + 1 = {seq_len + 1} tokens (the longest has {longest})"
            )

    def batch(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        rng = np.random.default_rng([self.seed, position])
        flat = rng.integers(0, self._ends[-1], size=self.dp_size * self.batch_size)  # the global batch
        flat = flat[self.dp_rank * self.batch_size : (self.dp_rank + 1) * self.batch_size]
        shard = np.searchsorted(self._ends, flat, side="right")
        offset = flat - (self._ends[shard] - self._starts[shard])
        rows = [self.split.shards[s][o : o + self.seq_len + 1] for s, o in zip(shard, offset, strict=True)]
        tokens = np.stack(rows).astype(np.int64)  # (batch_size, seq_len + 1)
        if tokens.max() >= self.split.vocab_size:
            raise ValueError(
                f"{self.split.name}: token {tokens.max()} is outside the vocabulary of "
                f"{self.split.vocab_size}: the data does not match its tokenizer"
            )
        t = torch.from_numpy(tokens)
        if self.device.type == "cuda":
            t = t.pin_memory().to(self.device, non_blocking=True)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch(self.position)
        self.position += 1
        return batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.position = state["seed"], state["position"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m horse.data", description="Tokenise text into token shards."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenise text files into train/val shards")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="UTF-8 text files")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--tokenizer", metavar="PATH", help="a BPE tokenizer.json (default: bytes)")
    p.add_argument(
        "--val-fraction", type=float, default=0.1, help="last fraction of each file held out (0.1)"
    )
    p.add_argument(
        "--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens per shard ({SHARD_TOKENS:,})"
    )
    args = parser.parse_args(argv)
    for path in args.inputs:
        if not Path(path).is_file():
            parser.error(f"INPUT {path} is not a file")
    meta = prepare(args.inputs, args.out, args.tokenizer, args.val_fraction, args.shard_tokens)
    for split in ("train", "val"):
        n = sum(e["tokens"] for e in meta[split])
        print(f"{split}: {n:,} tokens in {len(meta[split])} shard(s)")
    print(f"tokenizer {meta['tokenizer']}, vocabulary {meta['vocab_size']:,}; wrote {args.out}/meta.json")


if __name__ == "__main__":
    main()
