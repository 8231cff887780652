"""Token data: the built-in corpus, the tokenizers, binary token shards and the batch loader.

    python -m horse.data prepare INPUT... --out DIR [--tokenizer tokenizer.json] [--workers N]
        [--text-field text] [--val-fraction 0.1] [--shard-tokens 100_000_000]
    python -m horse.data inspect DIR [--seq-len 1024]     documents, tokens, windows per split

``prepare`` tokenises files, directories (every file under them, recursively, but hidden ones) and
globs: plain UTF-8 text, one document a file, and JSON Lines (``.jsonl``, ``.ndjson``), one document
a line in its ``--text-field``. An end-of-text token follows every document: the tokenizer's own
(``<|endoftext|>``, ``</s>``...) or, for bytes, id 256 (vocabulary 257). The last ``val-fraction``
of each file (cut at a line start) is held out for validation; when a document is cut there, each
part ends with the end-of-text token, so that no two documents run together in either split.

It streams: files are read in line-aligned pieces of about a megabyte, tokenised in ``--workers``
processes with a bounded number in flight and written to the shard open at the time, so memory
stays that of a few pieces whatever the corpus size, and time is linear in it. The pieces do not
depend on the number of workers and their tokens are written in order, so the output is
byte-identical for any --workers. A shard is written as NAME.tmp and renamed when whole; meta.json
(the tokenizer, the vocabulary, the end-of-text id, every shard with its token count; a BPE
tokenizer.json is copied beside them) is written last, after an existing one has been removed at
the start, so an interrupted run leaves nothing a loader takes for a data set.

A shard is a 32-byte little-endian header, then its tokens:

    magic b"HORSETOK" | version u32 | bytes per token u32 (2: uint16, 4: uint32 for vocabularies
    above 65,535) | token count u64 | vocabulary size u32 | reserved u32

Shards are memory-mapped when loaded, after the header has been checked against the file's size
and meta.json, so a truncated, foreign or mismatched file is an error, never garbage tokens.
"""

from __future__ import annotations

import argparse
import collections
import glob
import importlib.resources
import json
import multiprocessing
import os
import resource
import shutil
import struct
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

if TYPE_CHECKING:
    # Imported where a tensor is made: prepare's spawned workers would each spend ~2 CPU-seconds
    # importing torch, which tokenising never uses.
    import torch

MAGIC = b"HORSETOK"
VERSION = 1
HEADER = struct.Struct("<8sIIQII")
SHARD_TOKENS = 100_000_000  # 200 MB of uint16 per shard
PIECE_BYTES = 1 << 20  # text read and tokenised at a time
JSONL_SUFFIXES = (".jsonl", ".ndjson")
NUL, NEWLINE = b"\0", b"\n"
CORPUS = "tinyshakespeare.txt"
# The end-of-text tokens of GPT-2, LLaMA/Mistral, LLaMA 3 and others, looked up in a tokenizer.json.
EOT_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>")


# ----------------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, nothing to download or train. With ``eot``, id 256
    ends a document (vocabulary 257): the tokenizer of data made by ``prepare``."""

    EOT_TEXT = "<|endoftext|>"  # how decode shows id 256

    def __init__(self, eot: bool = False):
        self.name = "bytes+eot" if eot else "bytes"
        self.eot_id = 256 if eot else None
        self.vocab_size = 257 if eot else 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]

    def decode(self, ids: list[int]) -> str:
        # A sample may end mid-character: errors="replace".
        runs, run = [], []
        for i in ids:
            if i == self.eot_id:
                runs.append(bytes(run).decode("utf-8", errors="replace"))
                run = []
            else:
                run.append(i)
        return self.EOT_TEXT.join([*runs, bytes(run).decode("utf-8", errors="replace")])


class BPETokenizer:
    """A Hugging Face ``tokenizers`` tokenizer from a local tokenizer.json (no downloads); its
    end-of-text id is that of the first of EOT_TOKENS it has (None: none of them)."""

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
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception that does not name the file
            raise ValueError(f"{path}: not a tokenizers tokenizer.json ({e})") from e
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        ids = (self._tokenizer.token_to_id(t) for t in EOT_TOKENS)
        self.eot_id = next((i for i in ids if i is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.uint32) for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=False)


def load_tokenizer(directory: str | Path, name: str) -> ByteTokenizer | BPETokenizer:
    """The tokenizer ``name`` ("bytes", "bytes+eot" or "tokenizer.json") recorded for data or a
    checkpoint in directory (or for a file in it: an exported model.safetensors)."""
    directory = Path(directory)
    if directory.is_file():
        directory = directory.parent
    if name in ("bytes", "bytes+eot"):
        return ByteTokenizer(eot=name == "bytes+eot")
    if name == BPETokenizer.name:
        return BPETokenizer(Path(directory) / name)
    raise ValueError(
        f"{directory}: unknown tokenizer {name!r} (expected 'bytes', 'bytes+eot' or 'tokenizer.json')"
    )


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


class ShardWriter:
    """Tokens of one split streamed into DIR/<split>_NNN.bin shards of shard_tokens each: each is
    written as .tmp, its header's count filled in at the end, then renamed."""

    def __init__(self, out_dir: Path, split: str, vocab_size: int, shard_tokens: int):
        self.out_dir, self.split, self.vocab_size, self.shard_tokens = (
            out_dir,
            split,
            vocab_size,
            shard_tokens,
        )
        self.dtype = token_dtype(vocab_size).newbyteorder("<")
        self.shards: list[dict] = []  # meta.json's entries of the finished shards
        self.file, self.count = None, 0

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self.file is None:
                self.file = open(self._path(".tmp"), "wb")  # noqa: SIM115 (closed in _finish)
                self.file.write(b"\0" * HEADER.size)  # the header, once the count is known
                self.count = 0
            take = min(len(tokens), self.shard_tokens - self.count)
            self.file.write(np.ascontiguousarray(tokens[:take], dtype=self.dtype).tobytes())
            self.count += take
            tokens = tokens[take:]
            if self.count == self.shard_tokens:
                self._finish()

    def close(self) -> list[dict]:
        if self.file is not None:
            self._finish()
        return self.shards

    def discard(self) -> None:
        """Remove this writer's shards and its unfinished one (after a failure)."""
        if self.file is not None:
            self.file.close()
            self._path(".tmp").unlink(missing_ok=True)
        for entry in self.shards:
            (self.out_dir / entry["file"]).unlink(missing_ok=True)

    def _path(self, suffix: str = "") -> Path:
        return self.out_dir / f"{self.split}_{len(self.shards):03d}.bin{suffix}"

    def _finish(self) -> None:
        self.file.seek(0)
        self.file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.count, self.vocab_size, 0))
        self.file.close()
        self.file = None
        os.replace(self._path(".tmp"), self._path())
        self.shards.append({"file": self._path().name, "tokens": self.count})


def find_inputs(inputs: list[str | Path]) -> list[Path]:
    """The files of inputs, in order: a file; a directory's files, recursively, sorted, hidden ones
    (a name starting with '.') left out; a glob's matches, sorted (``**`` recurses)."""
    files = []
    for item in map(str, inputs):
        if Path(item).is_file():
            found = [Path(item)]
        elif Path(item).is_dir() or any(c in item for c in "*?["):
            roots = (
                [Path(item)]
                if Path(item).is_dir()
                else [Path(m) for m in sorted(glob.glob(item, recursive=True))]
            )
            found = []
            for root in roots:
                if root.is_file():
                    found.append(root)
                    continue
                for path in sorted(root.rglob("*")):
                    hidden = any(part.startswith(".") for part in path.relative_to(root).parts)
                    if path.is_file() and not hidden:
                        found.append(path)
            if not found:
                raise ValueError(f"INPUT {item}: no files there")
        else:
            raise FileNotFoundError(f"INPUT {item}: no such file, directory or glob match")
        files += found
    return files


@dataclass(frozen=True)
class Piece:
    """A run of whole lines of one file (a text file's longest lines aside) to tokenise."""

    path: str
    line: int  # the number of its first line, from 1
    data: bytes
    jsonl: bool
    split: str  # train or val
    ends_document: bool  # a text file's piece at the end of its split: the end-of-text token follows


def _line_start_before(f, position: int) -> int:
    """The start of the line holding byte position (a UTF-8 character's start if that line began
    more than PIECE_BYTES before it)."""
    f.seek(max(0, position - PIECE_BYTES))
    before = f.read(position - max(0, position - PIECE_BYTES))
    newline = before.rfind(b"\n")
    if newline >= 0:
        return position - len(before) + newline + 1
    while position > 0 and len(before) and 0x80 <= before[-1] < 0xC0:  # a continuation byte
        before, position = before[:-1], position - 1
    return position


def file_pieces(path: Path, val_fraction: float, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """Pieces of about piece_bytes of path, cut after a newline: train's up to the line start
    nearest the last val_fraction of the file, then val's. A JSON line is never cut; a text line
    longer than piece_bytes is, at a UTF-8 character's start."""
    jsonl = path.suffix.lower() in JSONL_SUFFIXES
    size = path.stat().st_size
    with open(path, "rb") as f:
        cut = _line_start_before(f, size - int(size * val_fraction))
        f.seek(0)
        line = 1
        for split, end in (("train", cut), ("val", size)):
            while f.tell() < end:
                start = f.tell()
                data = f.read(min(piece_bytes, end - start))
                if f.tell() < end and not data.endswith(b"\n"):
                    newline = data.rfind(b"\n")
                    if newline >= 0:
                        data = data[: newline + 1]
                    elif jsonl:  # a long JSON line: read on to its end
                        rest = f.readline()
                        data += rest[: end - start - len(data)]
                    else:
                        while len(data) > 1 and 0x80 <= data[-1] < 0xC0:
                            data = data[:-1]
                        data = data[:-1] if len(data) > 1 and data[-1] >= 0xC0 else data
                    f.seek(start + len(data))
                last = f.tell() >= end
                yield Piece(str(path), line, data, jsonl, split, ends_document=last and not jsonl)
                line += data.count(b"\n")


_worker_tokenizer = None  # each worker's, set by _start_worker


def _start_worker(tokenizer_path: str | None) -> None:
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    _worker_tokenizer = ByteTokenizer(eot=True) if tokenizer_path is None else BPETokenizer(tokenizer_path)


def encode_piece(piece: Piece, tokenizer, text_field: str) -> tuple[np.ndarray, int]:
    """(tokens, documents ended) of a piece: its text, or each JSON line's text_field, encoded,
    with the end-of-text id after each document. Not text, or a JSON line without the field, is an
    error naming the file and line."""
    data = piece.data

    def where(offset: int) -> str:
        return f"{piece.path} line {piece.line + data.count(NEWLINE, 0, offset)}"

    if NUL in data:
        raise ValueError(f"{where(data.index(NUL))}: a NUL byte: not a text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where(e.start)}: byte 0x{data[e.start]:02x} is not UTF-8: not a text file"
        ) from None
    eot = np.array([tokenizer.eot_id], dtype=np.uint32)
    if not piece.jsonl:
        if isinstance(tokenizer, ByteTokenizer):  # the bytes are the tokens
            tokens = np.frombuffer(data, dtype=np.uint8)
        else:
            tokens = np.asarray(tokenizer.encode(text), dtype=np.uint32)
        if piece.ends_document:
            return np.concatenate([tokens, eot]), 1
        return tokens.astype(np.uint32), 0
    texts = []
    for i, line in enumerate(text.split("\n")):
        if not line.strip():
            continue
        here = f"{piece.path} line {piece.line + i}"
        try:
            document = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{here}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(document, dict) or text_field not in document:
            keys = f"its keys: {', '.join(document)}" if isinstance(document, dict) else "not an object"
            raise ValueError(f"{here}: no {text_field!r} field ({keys}); choose the field with --text-field")
        if not isinstance(document[text_field], str):
            kind = type(document[text_field]).__name__
            raise ValueError(f"{here}: field {text_field!r} is a {kind}, not a string of text")
        texts.append(document[text_field])
    parts = [p for tokens in tokenizer.encode_batch(texts) for p in (tokens, eot)]
    return (np.concatenate(parts) if parts else np.empty(0, np.uint32)), len(texts)


def _encode_in_worker(piece: Piece, text_field: str) -> tuple[np.ndarray, int]:
    return encode_piece(piece, _worker_tokenizer, text_field)


def encode_pieces(
    pieces: Iterator[Piece], tokenizer, tokenizer_path: str | None, text_field: str, workers: int
) -> Iterator[tuple[Piece, np.ndarray, int]]:
    """(piece, tokens, documents) of each piece, in order; tokenised in this process (workers 1)
    or in a pool of workers processes with at most 2 · workers pieces in flight."""
    if workers == 1:
        for piece in pieces:
            yield piece, *encode_piece(piece, tokenizer, text_field)
        return
    # submit over a bounded window, not map: map submits the whole input at once, holding it in
    # memory whenever the workers are slower than the disk.
    # spawn, not fork: a forked worker inherits locks held by the parent's threads (tqdm's monitor,
    # the tokenizers library's pool), and a test run hung in the pool's shutdown. An executor, not
    # multiprocessing.Pool: Pool.terminate after a worker's error (a piece without its text field)
    # hung a clean CI run in its handler threads' join; the executor cancels what is queued instead.
    context = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker, initargs=(tokenizer_path,)
    )
    try:
        window = collections.deque()
        for piece in pieces:
            window.append((piece, pool.submit(_encode_in_worker, piece, text_field)))
            if len(window) >= 2 * workers:
                piece, result = window.popleft()
                yield piece, *result.result()
        for piece, result in window:
            yield piece, *result.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def prepare(
    inputs: list[str | Path],
    out_dir: str | Path,
    tokenizer: str | Path | None = None,
    val_fraction: float = 0.1,
    shard_tokens: int = SHARD_TOKENS,
    text_field: str = "text",
    workers: int = 1,
    piece_bytes: int = PIECE_BYTES,
    progress: bool | None = False,
) -> dict:
    """Tokenise inputs into train/val shards in out_dir (see the module docstring); returns meta.
    progress: a tqdm bar of bytes read, with tokens/s (None: when stderr is a terminal)."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    for name, value in (("shard_tokens", shard_tokens), ("workers", workers), ("piece_bytes", piece_bytes)):
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    files = find_inputs(inputs)
    tok = ByteTokenizer(eot=True) if tokenizer is None else BPETokenizer(tokenizer)
    if tok.eot_id is None:
        raise ValueError(
            f"{tokenizer}: no end-of-text token among its tokens (looked for {', '.join(EOT_TOKENS)}); "
            "add one as a special token"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # A data set is what meta.json lists: remove it first, then the shards an earlier run left.
    (out_dir / "meta.json").unlink(missing_ok=True)
    for stale in [*out_dir.glob("train_*.bin*"), *out_dir.glob("val_*.bin*")]:
        stale.unlink()
    writers = {s: ShardWriter(out_dir, s, tok.vocab_size, shard_tokens) for s in ("train", "val")}
    pieces = (p for f in files for p in file_pieces(f, val_fraction, piece_bytes))
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(
        total=total,
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=None if progress is None else not progress,
    )
    n_tokens, documents, start = 0, 0, time.perf_counter()
    try:
        path = tokenizer and str(tokenizer)
        for piece, tokens, docs in encode_pieces(pieces, tok, path, text_field, workers):
            writers[piece.split].write(tokens)
            n_tokens, documents = n_tokens + len(tokens), documents + docs
            bar.update(len(piece.data))
            rate = n_tokens / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{n_tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)
        meta = {"version": VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id}
        for split, writer in writers.items():
            meta[split] = writer.close()
            if not meta[split]:
                raise ValueError(
                    f"prepare: no {split} tokens from {[str(p) for p in inputs]}: the inputs are too short"
                )
    except BaseException:  # an error or an interrupt: nothing of this run is left behind
        for writer in writers.values():
            writer.discard()
        raise
    finally:
        bar.close()
    meta |= {"documents": documents, "seconds": round(time.perf_counter() - start, 3)}
    if isinstance(tok, BPETokenizer):
        shutil.copyfile(tok.path, out_dir / BPETokenizer.name)
    (out_dir / "meta.json.tmp").write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(out_dir / "meta.json.tmp", out_dir / "meta.json")
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


def _rows_to_tensor(split: Split, rows: list[np.ndarray]) -> torch.Tensor:
    import torch

    tokens = np.stack(rows).astype(np.int64)
    if tokens.max() >= split.vocab_size:
        raise ValueError(
            f"{split.name}: token {tokens.max()} is outside the vocabulary of {split.vocab_size}: the data "
            "does not match its tokenizer"
        )
    return torch.from_numpy(tokens)


def _batch(split: Split, rows: list[np.ndarray], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of windows of seq_len + 1 tokens, (rows, seq_len) each, on device (on a GPU
    through pinned memory, with a non-blocking copy)."""
    t = _rows_to_tensor(split, rows)  # (rows, seq_len + 1)
    if device.type == "cuda":
        t = t.pin_memory().to(device, non_blocking=True)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _global_batch_change(state: dict, global_batch: int, layout: str, where: str) -> str | None:
    """The line a resume prints when the checkpoint's global batch (state's) is not this run's."""
    if state["global_batch"] == global_batch:
        return None
    return (
        f"data: the global batch is now {global_batch:,} windows ({layout}), the checkpoint's "
        f"{state['global_batch']:,} ({state['layout']}): the stream goes on from {where}, none skipped or "
        "repeated"
    )


class Loader:
    """Batches of (input, target) windows, (batch_size, seq_len) int64 each, target shifted by one,
    in epochs without replacement.

    Windows: the split's tokens, its shards one after another, cut into windows of seq_len + 1
    tokens at a stride of seq_len, window w holding tokens w·seq_len ... (w + 1)·seq_len. A window's
    last token is the next one's first, so every token is an input once and a target once an epoch
    (the split's last tokens, fewer than seq_len, are in none); a window may hold the end of one
    shard and the start of the next, as it may hold the end of one document and the start of the
    next (document masking keeps them apart, ``horse.model.Documents``).

    Order: epoch e draws every window once, in the order of a permutation seeded with (seed, e), a
    new one each epoch. The job's draws are one stream, draw d being window d % windows of epoch
    d // windows's permutation: a pure function of (seed, d), so a loader set back to a saved place
    continues exactly. The permutation is held as 8 bytes a window (80 MB at 10M windows).

    Layout: each next() draws the job's next dp_size · batch_size windows and data-parallel rank
    dp_rank takes its own consecutive batch_size of them; a step's grad_accum calls draw its global
    batch of G = dp_size · batch_size · grad_accum windows. Step s therefore trains on draws s·G ...
    (s + 1)·G - 1 whatever dp size, batch size per rank and accumulation make up G. A resume at
    another G continues at the first window not yet drawn, none skipped and none repeated, and
    ``layout_change`` says so. On a GPU the batch goes through pinned memory with a non-blocking copy.
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
        grad_accum: int = 1,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"Loader: dp_rank {dp_rank} must be in [0, dp_size {dp_size})")
        self.split, self.batch_size, self.seq_len, self.seed = split, batch_size, seq_len, seed
        self.dp_rank, self.dp_size, self.grad_accum = dp_rank, dp_size, grad_accum
        import torch

        self.device = torch.device(device)
        self._shard_ends = np.cumsum([len(s) for s in split.shards], dtype=np.int64)
        tokens = int(self._shard_ends[-1]) if len(split.shards) else 0
        self.windows = max(tokens - 1, 0) // seq_len  # an epoch's
        if self.windows == 0:
            raise ValueError(
                f"{split.name}: {tokens:,} tokens, fewer than a window of seq_len + 1 = {seq_len + 1}"
            )
        self.drawn = 0  # windows the whole job has drawn: the stream's position
        self.layout_change: str | None = None  # what a resume at another global batch changed
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation), the last used

    @property
    def global_batch(self) -> int:
        """Windows a step draws (over every data-parallel rank and micro-batch)."""
        return self.dp_size * self.batch_size * self.grad_accum

    @property
    def epoch(self) -> int:
        return self.drawn // self.windows

    @property
    def position(self) -> int:
        """Windows of this epoch already drawn."""
        return self.drawn % self.windows

    def order(self, epoch: int) -> np.ndarray:
        """Epoch's permutation of the window indices 0 .. windows - 1."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.windows))
        return self._order[1]

    def window_indices(self, first: int, count: int) -> np.ndarray:
        """The windows of draws first ... first + count - 1 (they may cross into the next epoch)."""
        draws = np.arange(first, first + count, dtype=np.int64)
        epochs = draws // self.windows
        indices = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):
            drawn_in = epochs == epoch
            indices[drawn_in] = self.order(int(epoch))[draws[drawn_in] % self.windows]
        return indices

    def _window(self, index: int) -> np.ndarray:
        """Tokens index·seq_len ... (index + 1)·seq_len, read from the shards that hold them."""
        start, length, pieces = index * self.seq_len, self.seq_len + 1, []
        shard = int(np.searchsorted(self._shard_ends, start, side="right"))
        while length > 0:
            tokens = self.split.shards[shard]
            offset = start - (int(self._shard_ends[shard]) - len(tokens))
            pieces.append(tokens[offset : offset + length])
            start, length, shard = start + len(pieces[-1]), length - len(pieces[-1]), shard + 1
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        first = self.drawn + self.dp_rank * self.batch_size  # this rank's part of the job's draws
        rows = [self._window(int(w)) for w in self.window_indices(first, self.batch_size)]
        self.drawn += self.dp_size * self.batch_size
        return _batch(self.split, rows, self.device)

    def _layout(self) -> str:
        return f"dp {self.dp_size} x batch {self.batch_size} x grad_accum {self.grad_accum}"

    def state_dict(self) -> dict:
        return {
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
            "windows": self.windows,
            "global_batch": self.global_batch,
            "layout": self._layout(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.layout_change = state["seed"], None
        if "windows" not in state:  # an earlier loader's: batches drawn at random offsets
            self.drawn = state["position"] * self.dp_size * self.batch_size
            self.layout_change = (
                f"data: the checkpoint's loader drew windows at random offsets; epochs without "
                f"replacement start here, at window {self.position:,} of epoch {self.epoch}"
            )
            return
        if state["windows"] != self.windows:
            raise ValueError(
                f"{self.split.name}: the checkpoint's loader had {state['windows']:,} windows an epoch, "
                f"this data at seq_len {self.seq_len} has {self.windows:,}: resume with the same data "
                "and --seq-len"
            )
        self.drawn = state["epoch"] * self.windows + state["position"]
        where = f"window {self.position:,} of epoch {self.epoch}"
        self.layout_change = _global_batch_change(state, self.global_batch, self._layout(), where)


def parse_mixture(data: str) -> dict[str, float] | None:
    """--data as a mixture of prepared directories and their weights: ``DIR=WEIGHT,DIR=WEIGHT`` or
    a .json or .toml file of ``{DIR: WEIGHT}``; None when data names one directory."""
    if data.endswith((".json", ".toml")):
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"--data {data}: no such mixture file")
        text = path.read_text()
        import tomllib

        weights = json.loads(text) if data.endswith(".json") else tomllib.loads(text)
    elif "=" in data:
        weights = {}
        for part in data.split(","):
            name, _, weight = part.rpartition("=")
            try:
                weights[name] = float(weight)
            except ValueError:
                raise ValueError(f"--data {data}: {part!r} is not DIR=WEIGHT") from None
    else:
        return None
    if not weights or not all(isinstance(w, (int, float)) and w > 0 for w in weights.values()):
        raise ValueError(f"--data {data}: a mixture needs directories with weights > 0, got {weights}")
    return {name: float(w) for name, w in weights.items()}


def load_mixture(
    weights: dict[str, float],
) -> tuple[dict[str, Split], dict[str, Split], BPETokenizer | ByteTokenizer]:
    """(train splits, val splits, tokenizer) of a mixture's directories, which must share a tokenizer."""
    train, val, tokenizers = {}, {}, {}
    for name in weights:
        train[name], val[name], tokenizers[name] = load_dataset(name)
    kinds = {name: (t.name, t.vocab_size, t.eot_id) for name, t in tokenizers.items()}
    if len(set(kinds.values())) > 1:
        raise ValueError(f"--data: the mixture's directories must share a tokenizer, got {kinds}")
    return train, val, next(iter(tokenizers.values()))


# A mixture's source choices come from generators seeded with (seed, block, MIXTURE_KEY), a block of
# draws at a time: another stream than the epochs' permutations, seeded with (seed, epoch).
MIXTURE_BLOCK, MIXTURE_KEY = 4096, 0x6D6978


class Mixture:
    """A Loader's batches drawn from several sources (prepared directories), each window's source
    picked by a seeded rule: draw d of the job goes to source i when u_d falls in i's share of [0, 1),
    the shares the weights normalised, u_d uniform from a generator seeded with (seed, d // 4096): a
    pure function of (seed, d), whatever the layout. Each source walks its own windows in epochs
    without replacement (a :class:`Loader`'s order, seeded with seed), as far as its draws have gone;
    ``epochs`` says how far. Layout, state and resume as the Loader's."""

    def __init__(
        self,
        splits: dict[str, Split],
        weights: dict[str, float],
        batch_size: int,
        seq_len: int,
        seed: int,
        device: str | torch.device = "cpu",
        dp_rank: int = 0,
        dp_size: int = 1,
        grad_accum: int = 1,
    ):
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"Mixture: dp_rank {dp_rank} must be in [0, dp_size {dp_size})")
        self.sources = {name: Loader(split, 1, seq_len, seed) for name, split in splits.items()}
        total = sum(weights.values())
        self.weights = {name: weights[name] / total for name in splits}
        self._shares = np.cumsum(list(self.weights.values()))
        self.batch_size, self.seed, self.dp_rank, self.dp_size = batch_size, seed, dp_rank, dp_size
        self.grad_accum = grad_accum
        import torch

        self.device = torch.device(device)
        self.drawn = 0
        self.layout_change: str | None = None

    global_batch = Loader.global_batch
    _layout = Loader._layout

    @property
    def epochs(self) -> dict[str, float]:
        """Epochs each source has gone through (windows drawn / its windows)."""
        return {name: loader.drawn / loader.windows for name, loader in self.sources.items()}

    def choose(self, first: int, count: int) -> np.ndarray:
        """The source (its index) of draws first ... first + count - 1."""
        blocks = range(first // MIXTURE_BLOCK, (first + count - 1) // MIXTURE_BLOCK + 1)
        u = np.concatenate(
            [np.random.default_rng([self.seed, b, MIXTURE_KEY]).random(MIXTURE_BLOCK) for b in blocks]
        )
        start = first - blocks[0] * MIXTURE_BLOCK
        chosen = np.searchsorted(self._shares, u[start : start + count], side="right")
        return np.minimum(chosen, len(self.sources) - 1)  # a u at the top of the last share's rounding

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        job = self.choose(self.drawn, self.dp_size * self.batch_size)  # the job's micro-batch
        before, mine = (
            job[: self.dp_rank * self.batch_size],
            job[self.dp_rank * self.batch_size :][: self.batch_size],
        )
        rows: list[np.ndarray] = [np.empty(0)] * self.batch_size
        for i, loader in enumerate(self.sources.values()):
            at = np.flatnonzero(mine == i)
            windows = loader.window_indices(loader.drawn + int((before == i).sum()), len(at))
            for row, window in zip(at, windows, strict=True):
                rows[row] = loader._window(int(window))
            loader.drawn += int((job == i).sum())
        self.drawn += self.dp_size * self.batch_size
        return _batch(next(iter(self.sources.values())).split, rows, self.device)

    def state_dict(self) -> dict:
        sources = {name: loader.state_dict() for name, loader in self.sources.items()}
        return {
            "seed": self.seed,
            "drawn": self.drawn,
            "sources": sources,
            "global_batch": self.global_batch,
            "layout": self._layout(),
        }

    def load_state_dict(self, state: dict) -> None:
        if "sources" not in state or state["sources"].keys() != self.sources.keys():
            saved = list(state.get("sources", ["one directory"]))
            raise ValueError(f"--data: the checkpoint's data was {saved}, this run's {list(self.sources)}")
        self.seed, self.drawn = state["seed"], state["drawn"]
        for name, loader in self.sources.items():
            loader.load_state_dict(state["sources"][name])
        self.layout_change = _global_batch_change(
            state, self.global_batch, self._layout(), f"draw {self.drawn:,}"
        )


class HeldOut:
    """The first ``tokens`` tokens of a split as consecutive windows of seq_len inputs (targets
    shifted by one; a window never crosses a shard's end), in batches of batch_size: the same
    held-out tokens at every evaluation, each counted once. Data parallel: rank dp_rank takes
    windows dp_rank, dp_rank + dp_size, ...; the caller sums over the ranks."""

    def __init__(
        self,
        split: Split,
        tokens: int,
        seq_len: int,
        batch_size: int,
        device: str | torch.device = "cpu",
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if tokens < seq_len:
            raise ValueError(f"--eval-tokens {tokens:,} is less than one window of seq_len {seq_len}")
        needed = tokens // seq_len
        starts = []  # (shard, offset) of each window
        for s, shard in enumerate(split.shards):
            offsets = range(0, len(shard) - seq_len, seq_len)[: needed - len(starts)]
            starts += [(s, o) for o in offsets]
        if len(starts) < needed:
            raise ValueError(
                f"--eval-tokens {tokens:,}: {split.name} holds {len(starts):,} windows of seq_len {seq_len}, "
                f"{len(starts) * seq_len:,} tokens; ask for at most that"
            )
        import torch

        self.split, self.seq_len, self.batch_size, self.device = (
            split,
            seq_len,
            batch_size,
            torch.device(device),
        )
        self.starts = starts[dp_rank::dp_size]
        self.tokens = needed * seq_len  # over all the ranks
        most_windows = -(-needed // dp_size)  # rank 0's: it takes the first window of every dp_size
        self.most_batches = -(-most_windows // batch_size)  # the busiest rank's batches

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(input, target) batches, (batch_size or fewer, seq_len) int64 each."""
        for i in range(0, len(self.starts), self.batch_size):
            rows = [
                self.split.shards[s][o : o + self.seq_len + 1]
                for s, o in self.starts[i : i + self.batch_size]
            ]
            t = _rows_to_tensor(self.split, rows).to(self.device)  # (batch, seq_len + 1)
            yield t[:, :-1], t[:, 1:]


@dataclass
class SplitStats:
    """What ``inspect`` prints of a split: its documents (ended by the end-of-text token; the
    tokens after the last one, if any, count as one more), tokens, longest and median document, and
    of the Loader's windows at seq_len, how many and how many hold more than one document."""

    documents: int
    tokens: int
    longest: int
    median: float
    windows: int
    windows_crossing: int


def split_stats(split: Split, eot_id: int | None, seq_len: int) -> SplitStats:
    """The statistics of split's documents and of its Loader windows at seq_len (one pass over
    the shards, holding the end-of-text positions)."""
    ends, offset = [], 0  # each document's last token, in the split's tokens (shards one after another)
    for shard in split.shards:
        if eot_id is not None:
            ends.append(np.flatnonzero(shard == eot_id) + offset)
        offset += len(shard)
    tokens = offset
    ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
    if not len(ends) or ends[-1] != tokens - 1:  # the tokens after the last end of text
        ends = np.append(ends, tokens - 1)
    lengths = np.diff(ends, prepend=-1)
    windows = max(tokens - 1, 0) // seq_len
    # Window w (tokens w·seq_len ... (w + 1)·seq_len) holds two documents when one ends before its last token.
    crossing = np.unique(ends[ends < windows * seq_len] // seq_len)
    return SplitStats(
        len(lengths), tokens, int(lengths.max()), float(np.median(lengths)), windows, len(crossing)
    )


def inspect(data: str | Path, seq_len: int) -> dict[str, SplitStats]:
    """SplitStats of the train and val splits of a prepared directory."""
    train, val, tokenizer = load_dataset(data)
    return {
        "train": split_stats(train, tokenizer.eot_id, seq_len),
        "val": split_stats(val, tokenizer.eot_id, seq_len),
    }


def _at_least_1(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text}")
    return int(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m horse.data", description="Tokenise text into token shards."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="tokenise text and JSON Lines into train/val shards")
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="UTF-8 text or .jsonl files, directories, globs",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    p.add_argument("--tokenizer", metavar="PATH", help="a BPE tokenizer.json (default: bytes)")
    p.add_argument("--text-field", default="text", help="the text of a JSON line (default: text)")
    p.add_argument(
        "--workers",
        type=_at_least_1,
        default=len(os.sched_getaffinity(0)),
        help="tokenising processes (default: the CPUs this process may use)",
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.1, help="last fraction of each file held out (0.1)"
    )
    p.add_argument(
        "--shard-tokens", type=int, default=SHARD_TOKENS, help=f"tokens per shard ({SHARD_TOKENS:,})"
    )
    p = commands.add_parser("inspect", help="documents, tokens and windows of a prepared directory")
    p.add_argument("dir", metavar="DIR", help="a directory made by prepare")
    p.add_argument("--seq-len", type=_at_least_1, default=1024, help="the windows' input tokens (1024)")
    args = parser.parse_args(argv)
    if args.command == "inspect":
        try:
            stats = inspect(args.dir, args.seq_len)
        except (ValueError, FileNotFoundError) as e:
            parser.exit(2, f"python -m horse.data inspect: error: {e}\n")
        for split, st in stats.items():
            share = st.windows_crossing / max(st.windows, 1)
            print(
                f"{split}: {st.documents:,} documents, {st.tokens:,} tokens; longest document {st.longest:,} "
                f"tokens, median {st.median:,.0f}; {st.windows:,} windows at --seq-len {args.seq_len}, "
                f"{share:.1%} of them crossing a document boundary"
            )
        return
    try:
        meta = prepare(
            args.inputs,
            args.out,
            args.tokenizer,
            args.val_fraction,
            args.shard_tokens,
            args.text_field,
            args.workers,
            progress=None,
        )
    except (ValueError, FileNotFoundError, ImportError) as e:
        parser.exit(2, f"python -m horse.data prepare: error: {e}\n")
    tokens = 0
    for split in ("train", "val"):
        n = sum(e["tokens"] for e in meta[split])
        tokens += n
        print(f"{split}: {n:,} tokens in {len(meta[split])} shard(s)")
    # Peak resident memory (ru_maxrss, KiB on Linux) of this process and of its largest worker.
    main_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    worker_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(
        f"{meta['documents']:,} documents, {tokens:,} tokens in {meta['seconds']:.1f} s "
        f"({tokens / max(meta['seconds'], 1e-9):,.0f} tokens/s, {args.workers} worker(s)); peak memory "
        f"{main_mib:,.0f} MiB" + (f", each worker at most {worker_mib:,.0f} MiB" if args.workers > 1 else "")
    )
    print(
        f"tokenizer {meta['tokenizer']}, vocabulary {meta['vocab_size']:,}, end of text {meta['eot_id']}; "
        f"wrote {args.out}/meta.json"
    )


if __name__ == "__main__":
    main()
