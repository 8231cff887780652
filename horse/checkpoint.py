"""Checkpoints: one directory per step, written whole or not at all, in pieces that each rank writes.

    OUT/ckpt_0001000/model.safetensors   the float32 master weights; the model config and the
                                         tokenizer's name in the metadata, so the file stands alone
    OUT/ckpt_0001000/state.pt            optimizer (keyed by parameter name), loss scaler, RNG
                                         states, data positions, step and train config: plain
                                         tensors and containers, so torch.load(weights_only=True)
                                         reads it
    OUT/ckpt_0001000/tokenizer.json      the BPE tokenizer, when the data had one
    OUT/ckpt_0001000/manifest.json       the layout (tp size, dp_shard), every file above with its
                                         size and SHA-256, every tensor's whole shape and the rows
                                         each FSDP piece holds, and "checked_finite": every weight
                                         and optimizer tensor was checked free of inf and NaN

With tensor parallelism each tp rank writes its own shard, ``model-tp01-of-04.safetensors`` and
``state-tp01-of-04.pt`` (under the unsharded parameter names). With FSDP2 (--dp-shard N) each
of those shards is cut again by rows, as FSDP holds it, and every dp-shard rank writes its rows of
every tensor, weights and AdamW's moments alike: ``model-tp01-of-04-fsdp02-of-08.safetensors``
(``model-fsdp02-of-08.safetensors`` at tp 1). No rank gathers more than it holds, and the
data-parallel replicas of a piece (DDP's dp ranks, HSDP's dp_replicate > 0) write nothing. Every
file goes into a temporary directory; when every rank has written its files, rank 0 writes the
manifest and renames the directory into place, so a run killed mid-write leaves no directory
that :func:`latest` would pick up, and only then deletes the checkpoints beyond --keep-last. A
save that fails on any rank (a full disk, permissions, an I/O error) raises :class:`SaveError` on
every rank, leaving the older checkpoints as they were; so does a state that holds an inf or NaN
(a poisoned step: never written, since a checkpoint that passes its checksums would be resumed
from). With a :class:`BackgroundSaver` (``--async-checkpoint``) the writing runs in a thread from
host copies taken at the step, with the same temporary directory, manifest, rename, rotation and
agreement on failure; a kill during it leaves the previous checkpoint the newest good one. Across
nodes OUT must be a shared file system.

Our own format rather than torch.distributed.checkpoint: the tensor-parallel shards are plain
tensors cut by ``horse.parallel``'s plan (c_attn's rows in q, k and v sections, which no single
DTensor placement expresses), so DCP would see every tp rank's piece under one name; the plan
reshards them, and the format stays the one that ``verify``, ``export`` and checkpoints written
before FSDP share.

Resuming verifies before it trusts: :func:`newest_good` checks the sizes and checksums of the
newest checkpoint, and that every tensor in it is finite (checkpoints written before this check,
or by hand), and falls back to older ones, saying what failed. Check a run by hand with

    python -m horse.checkpoint verify RUN_OR_CKPT_DIR      (exit status 1 when any is damaged)

Loading reshards: a checkpoint saved at any (dp_replicate, dp_shard, tp) resumes at any other
(a tp that divides the model's heads, MLP width and vocabulary). Each rank builds its tensors one
at a time from just the pieces it needs: at the same tp, the rows of its own tp shard that its
new FSDP piece covers, read with safetensors' ``get_slice`` (and the optimizer's from a
memory-mapped ``torch.load``); at another tp, one whole tensor at a time, cut by the plan again.
Export writes one consolidated file, assembled a tensor at a time, that ``horse.generate`` and
``GPT(config).load_state_dict`` take:

    python -m horse.checkpoint export CKPT_OR_RUN_DIR --out model.safetensors
    python -m horse.checkpoint export CKPT_OR_RUN_DIR --format hf --out DIR    (horse.hf: a folder
                                               that transformers loads as GPT-2 or LLaMA)
"""

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import re
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from horse.data import BPETokenizer
from horse.model import GPTConfig
from horse.parallel import Parallel, ShardSpec, check_divisible, local, shard, shard_spec, unshard

WEIGHTS, STATE, MANIFEST = "model.safetensors", "state.pt", "manifest.json"
_NAME = re.compile(r"ckpt_(\d{7,})")


def shard_files(tp_rank: int, tp_size: int, dp_shard_rank: int = 0, dp_shard: int = 1) -> tuple[str, str]:
    """(weights, state) file names of the piece of tp rank tp_rank's shard that dp-shard rank
    dp_shard_rank holds; model.safetensors and state.pt at tp 1 without FSDP."""
    tags = []
    if tp_size > 1:
        tags.append(f"tp{tp_rank:02d}-of-{tp_size:02d}")
    if dp_shard > 1:
        tags.append(f"fsdp{dp_shard_rank:02d}-of-{dp_shard:02d}")
    if not tags:
        return WEIGHTS, STATE
    tag = "-".join(tags)
    return f"model-{tag}.safetensors", f"state-{tag}.pt"


class SaveError(RuntimeError):
    """A checkpoint could not be written (on any rank): nothing of it looks complete, and no older
    checkpoint was removed."""


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _digest(path: Path) -> dict:
    """A file's size and SHA-256, as the manifest records them."""
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


def _not_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names of those (name, tensor) pairs whose tensor holds an inf or NaN."""
    return [name for name, t in tensors if t.is_floating_point() and not torch.isfinite(t).all()]


def _optimizer_tensors(state: dict) -> Iterable[tuple[str, torch.Tensor]]:
    """("exp_avg of blocks.0.attn.c_attn.weight", tensor) for every tensor of an optimizer state
    keyed by parameter name (:func:`optimizer_state`)."""
    for name, entry in state["state"].items():
        for key, t in entry.items():
            yield f"{key} of {name}", t


def _file_not_finite(path: Path) -> list[str]:
    """The tensors of a checkpoint's file (a piece's weights, or its state's optimizer) that hold
    an inf or NaN; read one tensor at a time."""
    if path.suffix == ".safetensors":
        with safe_open(path, framework="pt") as f:
            return _not_finite((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118
    if path.suffix == ".pt":
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return _not_finite(_optimizer_tensors(state["optimizer"]))
    return []


def _written(path: Path) -> dict:
    """Flush a file just written to the disk; its :func:`_digest`, read back."""
    _fsync(path)
    return _digest(path)


def _on_every_rank(
    work: Callable[[], dict], parallel: Parallel, group: dist.ProcessGroup | None = None
) -> list[dict]:
    """work() on this rank, then a wait for every rank (it holds a collective, on group: None, the
    world's): every rank's result, in rank order, or SaveError on every rank when work() raised on
    any."""
    try:
        result, error = work(), None
    except Exception as e:  # on a full disk safetensors raises SafetensorError, torch.save RuntimeError
        result, error = {}, str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    gathered = [(result, error)]
    if parallel.distributed:
        gathered = [None] * parallel.world_size
        dist.all_gather_object(gathered, (result, error), group=group)
    failed = [f"rank {r}: {e}" if parallel.distributed else e for r, (_, e) in enumerate(gathered) if e]
    if failed:
        raise SaveError("; ".join(failed))
    return [part for part, _ in gathered]


# ----------------------------------------------------------------------------------------------
# Optimizer state by parameter name
# ----------------------------------------------------------------------------------------------
# torch's optimizer.state_dict() numbers the parameters by position. Keyed by name instead, the
# state can be resharded like the weights. (torch.distributed.checkpoint's get_optimizer_state_dict
# does the same, but first takes a zero-lr step when the state is empty, which would turn a skipped
# first fp16 step into a counted one.)


def _positions(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey(state: dict, key: Callable) -> dict:
    """An optimizer's state_dict with key(k) in place of each parameter key k."""
    return {
        "state": {key(k): s for k, s in state["state"].items()},
        "param_groups": [g | {"params": [key(k) for k in g["params"]]} for g in state["param_groups"]],
    }


def _by_name(state: dict, names: list[str]) -> dict:
    """An optimizer's state_dict with names[i] in place of position i."""
    return _rekey(state, names.__getitem__)


def optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """optimizer.state_dict() with parameter names in place of positions, each tensor this rank's
    plain local one (under FSDP2 its rows of the parameter's shape: AdamW's moments)."""
    state = _by_name(optimizer.state_dict(), _positions(optimizer, model))
    state["state"] = {name: {k: local(v) for k, v in entry.items()} for name, entry in state["state"].items()}
    return state


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, state: dict) -> None:
    """Load a state of :func:`optimizer_state` into optimizer (whose parameters are model's)."""
    index = {name: i for i, name in enumerate(_positions(optimizer, model))}
    optimizer.load_state_dict(_rekey(state, index.__getitem__))


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


class BackgroundSaver:
    """Checkpoint saves that do not stall training (``--async-checkpoint``): :func:`save` copies the
    state to host memory at the step (into pinned buffers, reused from save to save, where CUDA is),
    then a thread writes, fsyncs and hashes it while training goes on. At most one save is in
    flight: the next waits for it. The thread's collectives (the ranks' agreement on failure, the
    wait for every piece before rank 0 renames) run on a process group of their own (gloo), so they
    never interleave with training's; every rank creates it at its first save."""

    def __init__(self, parallel: Parallel):
        self.parallel = parallel
        self.group = None
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.thread: threading.Thread | None = None
        self.step: int | None = None  # of the save in flight, or of the one just finished
        self.outcome: Path | BaseException | None = None

    def stage(self, tensors: dict) -> dict:
        """A copy of tensors (a nested dict; its tensors this rank's local ones) in host memory."""
        if self.thread is not None:
            raise RuntimeError("a checkpoint save is in flight: wait() for it before the next")
        if self.group is None and self.parallel.distributed:
            self.group = dist.new_group(backend="gloo")
        staged = self._stage(tensors, ())
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory are done
        return staged

    def _stage(self, value, key: tuple):
        if isinstance(value, dict):
            return {k: self._stage(v, (*key, k)) for k, v in value.items()}
        if not isinstance(value, torch.Tensor):
            return value
        buffer = self.buffers.get(key)
        if buffer is None or (buffer.shape, buffer.dtype) != (value.shape, value.dtype):
            pin = torch.cuda.is_available()
            buffer = self.buffers[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=pin)
        return buffer.copy_(value, non_blocking=True)

    def start(self, step: int, write: Callable[[], Path]) -> None:
        """Run write() in a thread; wait() returns its checkpoint or raises its error."""
        self.step, self.outcome = step, None

        def run() -> None:
            try:
                self.outcome = write()
            except BaseException as e:  # SaveError, or a second signal's Aborted: wait() raises it
                self.outcome = e

        self.thread = threading.Thread(target=run, name=f"save of step {step}", daemon=True)
        self.thread.start()

    def wait(self) -> Path | None:
        """Wait for the save in flight: its checkpoint (None when none was in flight), or its
        SaveError, the same on every rank."""
        if self.thread is None:
            return None
        self.thread.join()
        self.thread, outcome = None, self.outcome
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


def save(
    out_dir: str | Path,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict,
    tokenizer: str,
    tokenizer_file: Path | None = None,
    keep_last: int = 3,
    parallel: Parallel | None = None,
    saver: BackgroundSaver | None = None,
) -> Path:
    """Write checkpoint ``step`` of model (a horse GPT, or this rank's tp shard of one, FSDP-sharded
    or not), its optimizer and state into out_dir, each rank its own piece; then keep the newest
    keep_last. Every rank calls it (it holds collectives); when any rank cannot write, every rank
    raises SaveError. With a saver, the state is copied to host memory now and written in its
    thread (which must not be busy: ``saver.wait()`` first); the path is returned at once, and
    ``saver.wait()`` raises the SaveError."""
    parallel, out_dir = parallel or Parallel(), Path(out_dir)
    weights = {name: local(w).detach() for name, w in model.state_dict().items()}
    pieces = {"weights": weights, "optimizer": optimizer_state(optimizer, model)}
    if saver is not None:
        pieces = saver.stage(pieces)  # training changes the originals in place from the next step on
    write = functools.partial(
        _write, out_dir, step, pieces, model.config, state, tokenizer, tokenizer_file, keep_last, parallel
    )
    if saver is None:
        return write()
    saver.start(step, functools.partial(write, group=saver.group))
    return out_dir / f"ckpt_{step:07d}"


def _write(
    out_dir: Path,
    step: int,
    pieces: dict,
    config: GPTConfig,
    state: dict,
    tokenizer: str,
    tokenizer_file: Path | None,
    keep_last: int,
    parallel: Parallel,
    group: dist.ProcessGroup | None = None,
) -> Path:
    """:func:`save`'s writing, of this rank's pieces (weights: {name: tensor}; optimizer: its state
    keyed by name), its collectives on group (None: the world's)."""
    final = out_dir / f"ckpt_{step:07d}"
    tmp = out_dir / f".{final.name}.tmp"
    weights, optimizer_pieces = pieces["weights"], pieces["optimizer"]

    def start() -> dict:
        if parallel.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed mid-write
            tmp.mkdir(parents=True)
        return {}

    def write_piece() -> dict:
        if parallel.dp_replicate_rank != 0:  # the other replicas hold copies of the same pieces
            return {}
        t, s = parallel.tp_rank, parallel.dp_shard_rank
        weights_file, state_file = shard_files(t, parallel.tp_size, s, parallel.dp_shard_size)
        poisoned = _not_finite(weights.items()) + _not_finite(_optimizer_tensors(optimizer_pieces))
        if poisoned:
            raise FloatingPointError(
                f"the state to save holds inf or NaN in {', '.join(poisoned[:5])}"
                + (f" and {len(poisoned) - 5} more tensors" if len(poisoned) > 5 else "")
            )
        metadata = {
            "config": json.dumps(dataclasses.asdict(config)),
            "tokenizer": tokenizer,
            "tp_rank": str(t),
            "tp_size": str(parallel.tp_size),
            "dp_shard_rank": str(s),
            "dp_shard": str(parallel.dp_shard_size),
        }
        save_file({n: w.contiguous() for n, w in weights.items()}, tmp / weights_file, metadata=metadata)
        torch.save(state | {"optimizer": optimizer_pieces}, tmp / state_file)
        return {
            "files": {f: _written(tmp / f) for f in (weights_file, state_file)},
            "piece": {
                "tp_rank": t,
                "dp_shard_rank": s,
                "shapes": {n: list(w.shape) for n, w in weights.items()},
            },
        }

    def finish(written: list[dict]) -> dict:
        if parallel.rank != 0:
            return {}
        files = {f: digest for piece in written for f, digest in piece.get("files", {}).items()}
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / tokenizer_file.name)
            files[tokenizer_file.name] = _written(tmp / tokenizer_file.name)
        manifest = {
            "step": step,
            "tp_size": parallel.tp_size,
            "dp_shard": parallel.dp_shard_size,
            "files": dict(sorted(files.items())),
            "tensors": _tensor_table([p["piece"] for p in written if p], config, parallel.tp_size),
            "checked_finite": True,  # every piece's weights and optimizer state, before it was written
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        old = out_dir / f".{final.name}.old"  # the same step saved before (a damaged one, on resume)
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync(out_dir)
        shutil.rmtree(old, ignore_errors=True)
        return {}

    try:
        _on_every_rank(start, parallel, group)
        written = _on_every_rank(write_piece, parallel, group)
        _on_every_rank(lambda: finish(written), parallel, group)  # no rank reads the run before the rename
    except BaseException as e:  # a full disk, or a second signal (horse.preemption) mid-save
        if parallel.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, SaveError):
            with contextlib.suppress(OSError):  # a full disk's errors do not always say so
                e = f"{e}; {shutil.disk_usage(out_dir).free:,} bytes free in {out_dir}"
            raise SaveError(
                f"checkpoint {final.name} could not be written: {e} (nothing of it is kept; the older "
                "checkpoints are untouched)"
            ) from None
        raise
    if parallel.rank == 0:  # only now that the new one is whole
        for old in complete(out_dir)[:-keep_last] if keep_last > 0 else []:
            shutil.rmtree(old)
        for leftover in out_dir.glob(".ckpt_*"):  # of saves cut short (a kill), never to be redone
            shutil.rmtree(leftover, ignore_errors=True)
    return final


def _tensor_table(pieces: list[dict], config: GPTConfig, tp: int) -> dict:
    """The manifest's "tensors": for each tensor its whole shape and the rows of its tp shard that
    each FSDP piece holds, as bounds: piece s holds rows [rows[s], rows[s + 1]) (one piece, all
    rows, without FSDP); from the shapes the pieces' writers reported."""
    by_shard = sorted((p for p in pieces if p["tp_rank"] == 0), key=lambda p: p["dp_shard_rank"])
    table = {}
    for name, shape in by_shard[0]["shapes"].items():
        starts = [0]
        for piece in by_shard:
            starts.append(starts[-1] + piece["shapes"][name][0])
        whole = [starts[-1], *shape[1:]]  # the tp shard's
        spec = shard_spec(name, config) if tp > 1 else None
        if spec is not None:
            whole[spec.dim] *= tp
        table[name] = {"shape": whole, "rows": starts}
    return table


# ----------------------------------------------------------------------------------------------
# Finding and reading
# ----------------------------------------------------------------------------------------------


# Formats before today's: these two functions are the only code that knows them; everything else
# reads today's manifest and state.


def _manifest(ckpt: Path, tensors: bool = False) -> dict:
    """The manifest of checkpoint ckpt (a directory, or an exported file) in today's format, whatever
    format it was written in: tp_size, dp_shard, files (name: {size, sha256}, or None where none was
    recorded), optimizer_by_position; with tensors, the "tensors" table too (read from the weights
    files' headers where the manifest has none). The formats before today's:

    * an exported file: the whole model, one piece, no checksums;
    * before tensor parallelism: no manifest; model.safetensors and state.pt, the optimizer's state
      keyed by position (``_upgraded_state`` names it);
    * before checksums: files a list of names;
    * before FSDP: no dp_shard (1) and no tensors table (each tensor one piece of its tp shard)."""
    if ckpt.is_file():
        manifest = {"tp_size": 1, "files": {ckpt.name: None}}
    elif not (ckpt / MANIFEST).is_file():
        manifest = {"tp_size": 1, "files": dict.fromkeys([WEIGHTS, STATE]), "optimizer_by_position": True}
    else:
        manifest = json.loads((ckpt / MANIFEST).read_text())
    if isinstance(manifest["files"], list):
        manifest["files"] = dict.fromkeys(manifest["files"])
    manifest.setdefault("dp_shard", 1)
    manifest.setdefault("optimizer_by_position", False)
    if tensors and "tensors" not in manifest:
        weights = ckpt if ckpt.is_file() else ckpt / shard_files(0, manifest["tp_size"])[0]
        with safe_open(weights, framework="pt") as f:
            config = GPTConfig(**json.loads(f.metadata()["config"]))
            shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}  # noqa: SIM118
        piece = {"tp_rank": 0, "dp_shard_rank": 0, "shapes": shapes}
        manifest["tensors"] = _tensor_table([piece], config, manifest["tp_size"])
    return manifest


def _upgraded_state(state: dict, positions: list[str] | None) -> dict:
    """A piece's state file in today's format: the optimizer's state keyed by name (positions: the
    parameter names in the optimizer's order, for a checkpoint of ``optimizer_by_position``); the
    loss scaler's clean steps under their name (torch.amp.GradScaler's "_growth_tracker" before
    ``horse.loss_scale``); this rank's CUDA RNG state alone (before, every device's, this rank's at
    its device index)."""
    state = dict(state)
    if positions is not None:
        state["optimizer"] = _by_name(state["optimizer"], positions)
    scaler = dict(state.get("scaler", {}))
    if "_growth_tracker" in scaler:
        scaler["clean_steps"] = scaler.pop("_growth_tracker")
        state["scaler"] = scaler
    cuda_rng = state.get("rng", {}).get("cuda")
    if isinstance(cuda_rng, list) and cuda_rng and torch.cuda.is_available():
        this_device = cuda_rng[min(torch.cuda.current_device(), len(cuda_rng) - 1)]
        state["rng"] = state["rng"] | {"cuda": this_device}
    return state


def _is_complete(ckpt: Path) -> bool:
    try:
        files = _manifest(ckpt)["files"]
    except (OSError, json.JSONDecodeError, KeyError):
        return False
    return all((ckpt / f).is_file() for f in files)


def complete(out_dir: str | Path) -> list[Path]:
    """The complete checkpoints in out_dir, oldest first."""
    return [p for p in candidates(out_dir) if _is_complete(p)]


def verify(ckpt: str | Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with checkpoint directory ckpt, a line per problem: each file missing, of
    another size or SHA-256 than its manifest says (files of a manifest without checksums need only
    exist), or holding a weight or optimizer tensor with an inf or NaN (a poisoned state, as saves
    before the check on saving could write). Empty: good. Rank rank of world_size checks every
    world_size-th file only."""
    ckpt = Path(ckpt)
    try:
        files = _manifest(ckpt)["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        return [f"{MANIFEST}: unreadable ({type(e).__name__}: {e})"]
    problems = []
    for name in sorted(files)[rank::world_size]:
        path, expected = ckpt / name, files[name]
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif expected is not None and path.stat().st_size != expected["size"]:
            problems.append(f"{name}: {path.stat().st_size:,} bytes, the manifest says {expected['size']:,}")
        elif expected is not None and _digest(path)["sha256"] != expected["sha256"]:
            problems.append(f"{name}: its SHA-256 is not the manifest's (the contents are damaged)")
        else:
            try:
                poisoned = _file_not_finite(path)
            except Exception as e:  # a file that no checksum vouches for, damaged
                problems.append(f"{name}: unreadable ({type(e).__name__}: {e})")
                continue
            if poisoned:
                more = f" and {len(poisoned) - 3} more" if len(poisoned) > 3 else ""
                problems.append(f"{name}: {', '.join(poisoned[:3])}{more} hold inf or NaN (a poisoned state)")
    return problems


def candidates(out_dir: str | Path) -> list[Path]:
    """Every checkpoint directory in out_dir, complete or not, oldest first (unfinished saves,
    .ckpt_*.tmp, are not among them)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = [p for p in out_dir.iterdir() if _NAME.fullmatch(p.name) and p.is_dir()]
    return sorted(found, key=lambda p: int(_NAME.fullmatch(p.name).group(1)))


def newest_good(
    out_dir: str | Path, parallel: Parallel | None = None, strict: bool = False
) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint in out_dir that :func:`verify` passes, a warning for each newer one
    that it fails); (None, []) when out_dir holds none. The ranks share the reading and agree.
    strict: a damaged newest checkpoint is a ValueError instead; so is a run with none good."""
    parallel = parallel or Parallel()
    warnings = []
    for ckpt in reversed(candidates(out_dir)):
        problems = [verify(ckpt, parallel.rank, parallel.world_size)]
        if parallel.distributed:
            problems = [None] * parallel.world_size
            dist.all_gather_object(problems, verify(ckpt, parallel.rank, parallel.world_size))
        problems = list(dict.fromkeys(p for part in problems for p in part))  # the manifest's once
        if not problems:
            return ckpt, warnings
        if strict:
            raise ValueError(f"checkpoint {ckpt} is damaged: {'; '.join(problems)} (--strict-resume)")
        warnings.append(f"checkpoint {ckpt.name} is damaged, skipped: {'; '.join(problems)}")
    if warnings:
        raise ValueError(f"no good checkpoint in {out_dir}: " + " | ".join(warnings))
    return None, []


def resume_point(
    out_dir: str | Path, resume: bool, config: GPTConfig, parallel: Parallel, strict: bool = False
) -> tuple[Path | None, list[str]]:
    """(the checkpoint a run in out_dir continues from, a warning for each damaged newer one). With
    resume, the newest good one (:func:`newest_good`), checked against config; without, None, and
    an error if out_dir holds checkpoints of an earlier run."""
    if not resume:
        ckpt = latest(out_dir)
        if ckpt is not None:
            raise ValueError(
                f"--out-dir {out_dir} holds checkpoints of an earlier run ({ckpt.name}): pass --resume to "
                "continue it, or choose another --out-dir"
            )
        return None, []
    ckpt, warnings = newest_good(out_dir, parallel, strict)
    if ckpt is not None:
        check_config(ckpt, config)
        check_reshardable(ckpt, config, parallel)
    return ckpt, warnings


def latest(out_dir: str | Path) -> Path | None:
    """The newest complete checkpoint in out_dir, or None."""
    found = complete(out_dir)
    return found[-1] if found else None


def resolve(path: str | Path) -> Path:
    """A checkpoint: a directory holding one (a manifest, or model.safetensors, as an export writes
    it), the newest complete one in a run's output directory, or an exported .safetensors file."""
    path = Path(path)
    if path.is_file() and path.suffix == ".safetensors":
        return path
    if (path / MANIFEST).is_file() or (path / WEIGHTS).is_file():
        return path
    newest = latest(path)
    if newest is None:
        raise FileNotFoundError(
            f"{path}: neither a checkpoint, a .safetensors file, nor a directory holding a checkpoint"
        )
    return newest


def layout(ckpt: str | Path) -> tuple[int, int]:
    """(tp size, dp_shard) that checkpoint ckpt was saved at: (1, 1) for an exported file, dp_shard
    1 for a checkpoint written before FSDP."""
    manifest = _manifest(Path(ckpt))
    return manifest["tp_size"], manifest["dp_shard"]


def tp_size(ckpt: str | Path) -> int:
    """The tensor-parallel size checkpoint ckpt was saved at (1 for an exported file)."""
    return layout(ckpt)[0]


def describe_layout(tp: int, dp_shard: int, dp_replicate: int | None = None) -> str:
    """ "dp_replicate 2 x dp_shard 2 x tp 1" (without dp_replicate: a checkpoint's, which has none)."""
    replicate = "" if dp_replicate is None else f"dp_replicate {dp_replicate} x "
    return f"{replicate}dp_shard {dp_shard} x tp {tp}"


def _weights_file(ckpt: Path) -> Path:
    """The first weights file of ckpt (every one holds the config), or ckpt itself, a file."""
    if ckpt.is_file():
        return ckpt
    tp, dp_shard = layout(ckpt)
    return ckpt / shard_files(0, tp, 0, dp_shard)[0]


def read_metadata(ckpt: str | Path) -> tuple[GPTConfig, str]:
    """(model config, tokenizer name) that checkpoint ckpt was saved with."""
    path = _weights_file(Path(ckpt))
    with safe_open(path, framework="pt") as f:
        metadata = f.metadata() or {}
    if "config" not in metadata:
        raise ValueError(f"{path}: no model config in its metadata: not a horse checkpoint")
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


def check_reshardable(ckpt: str | Path, config: GPTConfig, parallel: Parallel) -> None:
    """Raise, naming both layouts and why, unless ckpt (of a model of config) can be resharded to
    parallel's: its tp must split the model (any dp_shard can take any rows)."""
    try:
        check_divisible(config, parallel.tp_size)
    except ValueError as e:
        saved = describe_layout(*layout(ckpt))
        asked = describe_layout(parallel.tp_size, parallel.dp_shard_size, parallel.dp_replicate_size)
        raise ValueError(
            f"checkpoint {ckpt} (saved at {saved}) cannot be resharded to {asked}: {e}"
        ) from None


def local_rows(t: torch.Tensor) -> tuple[int, int]:
    """The rows [start, stop) of its tensor-parallel shard that this rank holds of t: all of them,
    or under FSDP2 its piece, which DTensor's Shard(0) cuts as torch.chunk does."""
    if not isinstance(t, DTensor):
        return 0, t.shape[0]
    (dim,) = [d for d, placement in enumerate(t.placements) if isinstance(placement, Shard)]
    rows, pieces = t.shape[0], t.device_mesh.size(dim)
    chunk = -(-rows // pieces)
    start = min(rows, t.device_mesh.get_local_rank(dim) * chunk)
    stop = min(rows, start + chunk)
    if stop - start != local(t).shape[0]:
        raise RuntimeError(f"FSDP holds {local(t).shape[0]} rows here, not torch.chunk's [{start}, {stop})")
    return start, stop


class Pieces:
    """The tensors of checkpoint ckpt (a directory, or an exported file) read from the pieces its
    files hold: tp shards cut by the plan, each cut by rows into dp_shard pieces. Files are opened
    once and read lazily: a slice reads just its rows."""

    def __init__(self, ckpt: str | Path):
        self.ckpt = Path(ckpt)
        manifest = _manifest(self.ckpt, tensors=True)
        self.tp_size, self.dp_shard = manifest["tp_size"], manifest["dp_shard"]
        tensors = manifest["tensors"]
        self.rows = {name: list(itertools.pairwise(entry["rows"])) for name, entry in tensors.items()}
        self.shapes = {name: entry["shape"] for name, entry in tensors.items()}
        self.optimizer_by_position = manifest["optimizer_by_position"]
        self.config = read_metadata(self.ckpt)[0]
        self.names: list[str] | None = None  # the optimizer's parameters in its order, for the above
        self._weights, self._states = {}, {}

    def _files(self, tp_rank: int, dp_shard_rank: int) -> tuple[Path, Path]:
        if self.ckpt.is_file():
            return self.ckpt, self.ckpt.with_suffix(".pt")
        names = shard_files(tp_rank, self.tp_size, dp_shard_rank, self.dp_shard)
        return self.ckpt / names[0], self.ckpt / names[1]

    def weights(self, tp_rank: int = 0, dp_shard_rank: int = 0):
        """The safetensors file of one piece, opened (its get_slice reads parts)."""
        key = (tp_rank, dp_shard_rank)
        if key not in self._weights:
            self._weights[key] = safe_open(self._files(*key)[0], framework="pt")
        return self._weights[key]

    def state(self, tp_rank: int = 0, dp_shard_rank: int = 0) -> dict:
        """The state file of one piece, memory-mapped (a slice reads just its pages); its
        optimizer keyed by parameter name."""
        key = (tp_rank, dp_shard_rank)
        if key not in self._states:
            state = torch.load(self._files(*key)[1], map_location="cpu", weights_only=True, mmap=True)
            self._states[key] = _upgraded_state(state, self.names if self.optimizer_by_position else None)
        return self._states[key]

    def tensor_names(self) -> list[str]:
        return list(self.weights().keys())

    def _piece(self, name: str, key: str | None, tp_rank: int, dp_shard_rank: int):
        if key is None:
            return self.weights(tp_rank, dp_shard_rank).get_slice(name)
        return self.state(tp_rank, dp_shard_rank)["optimizer"]["state"][name][key]

    def shard_shape(self, name: str, tp: int) -> list[int]:
        """The shape of a tp rank's shard of tensor name at tensor-parallel size tp."""
        whole = list(self.shapes[name])
        spec = shard_spec(name, self.config) if tp > 1 else None
        if spec is not None:
            whole[spec.dim] //= tp
        return whole

    def shard_rows(
        self, name: str, key: str | None, tp_rank: int, start: int = 0, stop: int | None = None
    ) -> torch.Tensor:
        """Rows [start, stop) (default: all) of saved tp rank tp_rank's shard of tensor name (key:
        an entry of its optimizer state, "exp_avg"; None: the weight), from the pieces that hold them."""
        pieces = self.rows[name]
        stop = pieces[-1][1] if stop is None else stop
        parts = [
            self._piece(name, key, tp_rank, s)[max(a, start) - a : min(b, stop) - a]
            for s, (a, b) in enumerate(pieces)
            if max(a, start) < min(b, stop)
        ]
        if not parts:  # no rows (an FSDP piece of a tensor with fewer rows than ranks)
            return self._piece(name, key, tp_rank, 0)[0:0]
        return torch.cat(parts)

    def whole(self, name: str, key: str | None = None) -> torch.Tensor:
        """The whole tensor name (or its optimizer state's entry key), assembled by the plan."""
        spec = shard_spec(name, self.config) if self.tp_size > 1 else None
        if spec is None:
            return self.shard_rows(name, key, 0)
        return unshard([self.shard_rows(name, key, t) for t in range(self.tp_size)], spec)

    def for_rank(
        self, name: str, key: str | None, tp_rank: int, tp: int, rows: tuple[int, int]
    ) -> torch.Tensor:
        """Rows [start, stop) of tp rank tp_rank's shard at tensor-parallel size tp: read from the
        pieces of the same shard when the tp is the saved one (or the tensor is not split), else
        only those rows and columns (:meth:`read`) from the saved shards that hold them."""
        spec = shard_spec(name, self.config)
        if tp == self.tp_size or spec is None:
            return self.shard_rows(name, key, tp_rank if spec is not None else 0, *rows)
        whole = self.shapes[name][spec.dim]
        indices = shard(torch.arange(whole), ShardSpec(0, spec.sections), tp_rank, tp)  # along spec.dim
        if spec.dim == 0:
            return self.read(name, key, indices[slice(*rows)], None)
        return self.read(name, key, torch.arange(*rows), indices)

    def read(
        self, name: str, key: str | None, rows: torch.Tensor, columns: torch.Tensor | None
    ) -> torch.Tensor:
        """``whole[rows][:, columns]`` of tensor name (key: as :meth:`shard_rows`; columns None: all),
        or ``whole[rows][:, :, columns]`` for a tensor the plan cuts along dim 2 (the experts'
        down_proj), rows and columns ascending indices of the whole tensor, reading from the saved tp
        shards only the rows asked for (all of a shard's columns, then cut)."""
        plan = shard_spec(name, self.config)
        spec = plan if self.tp_size > 1 else None
        if spec is None or (spec.dim == 0 and len(rows) == 0):  # held whole by every saved tp rank
            values = self._rows(name, key, 0, rows)  # (or, none of its rows: any rank's width)
            return values if columns is None else values.index_select(max(1, plan.dim), columns)
        whole = self.shapes[name][spec.dim]
        wanted = rows if spec.dim == 0 else torch.arange(whole) if columns is None else columns
        owner, position = torch.empty(whole, dtype=torch.long), torch.empty(whole, dtype=torch.long)
        for t in range(self.tp_size):  # which saved tp rank holds each index along spec.dim, and where
            held = shard(torch.arange(whole), ShardSpec(0, spec.sections), t, self.tp_size)
            owner[held], position[held] = t, torch.arange(len(held))
        parts, order = [], []
        for t in range(self.tp_size):
            mine = owner[wanted] == t
            if not mine.any():
                continue
            local_indices = position[wanted[mine]]
            if spec.dim == 0:
                values = self._rows(name, key, t, local_indices)
                parts.append(values if columns is None else values.index_select(1, columns))
            else:
                values = self._rows(name, key, t, rows)
                parts.append(values.index_select(spec.dim, local_indices))
            order.append(mine.nonzero().flatten())
        values = torch.cat(parts, dim=spec.dim)  # in the saved ranks' order; put back in wanted's
        return values.index_select(spec.dim, torch.cat(order).argsort())

    def _rows(self, name: str, key: str | None, tp_rank: int, rows: torch.Tensor) -> torch.Tensor:
        """The rows (ascending indices) of saved tp rank tp_rank's shard of tensor name."""
        if len(rows) == 0:  # an FSDP piece of a tensor with fewer rows than ranks
            return self.shard_rows(name, key, tp_rank, 0, 0)
        return torch.cat([self.shard_rows(name, key, tp_rank, a, b) for a, b in index_runs(rows)])


def index_runs(indices: torch.Tensor) -> list[tuple[int, int]]:
    """Ascending indices as the (start, stop) ranges of consecutive ones, in order."""
    if len(indices) == 0:
        return []
    breaks = (torch.nonzero(indices.diff() != 1).flatten() + 1).tolist()
    starts, stops = [0, *breaks], [*breaks, len(indices)]
    return [(int(indices[a]), int(indices[b - 1]) + 1) for a, b in zip(starts, stops, strict=True)]


def full_weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights (on the CPU) of a checkpoint saved at any layout."""
    pieces = Pieces(ckpt)
    return {name: pieces.whole(name) for name in pieces.tensor_names()}


def load_weights(ckpt: str | Path, model: nn.Module, parallel: Parallel | None = None) -> None:
    """Load ckpt's weights into model (this rank's shard of one under tensor parallelism, its
    pieces under FSDP), or raise naming every tensor that does not fit."""
    _load_weights(Pieces(ckpt), model, parallel or Parallel())


def _load_weights(pieces: Pieces, model: nn.Module, parallel: Parallel) -> None:
    ckpt = pieces.ckpt
    expected = model.state_dict(keep_vars=True)
    saved = pieces.tensor_names()
    problems = [f"missing {k}" for k in expected.keys() - set(saved)]
    problems += [f"unexpected {k}" for k in set(saved) - expected.keys()]
    problems += [
        f"{k} is {shape}, the model's is {list(v.shape)}"
        for k, v in expected.items()
        if k in saved and (shape := pieces.shard_shape(k, parallel.tp_size)) != list(v.shape)
    ]
    if problems:
        raise ValueError(f"checkpoint {ckpt} does not fit this model: {'; '.join(sorted(problems))}")
    with torch.no_grad():
        for name, t in expected.items():
            local(t).copy_(pieces.for_rank(name, None, parallel.tp_rank, parallel.tp_size, local_rows(t)))


def load_state(ckpt: str | Path, tp_rank: int = 0, dp_shard_rank: int = 0) -> dict:
    """The state file of one piece (tp rank tp_rank's, dp-shard rank dp_shard_rank's), as saved
    (the optimizer keyed by parameter name)."""
    ckpt = Path(ckpt)
    tp, dp_shard = layout(ckpt)
    return torch.load(
        ckpt / shard_files(tp_rank, tp, dp_shard_rank, dp_shard)[1], map_location="cpu", weights_only=True
    )


def _optimizer_for_rank(pieces: Pieces, model: nn.Module, parallel: Parallel) -> dict:
    """This rank's optimizer state (keyed by name) from the checkpoint's pieces: each tensor of a
    parameter's shape (AdamW's exp_avg and exp_avg_sq) cut like the parameter, as a DTensor of the
    parameter's placement under FSDP; scalars (the step count), the same on every rank, as saved."""
    params = dict(model.named_parameters())
    saved = pieces.state()["optimizer"]
    state = {}
    for name, entry in saved["state"].items():
        param = params[name]
        state[name] = {}
        for key, value in entry.items():
            if value.dim() == 0:
                state[name][key] = value.clone()
                continue
            rows = local_rows(param)
            mine = pieces.for_rank(name, key, parallel.tp_rank, parallel.tp_size, rows).to(param.device)
            if isinstance(param, DTensor):
                mine = DTensor.from_local(
                    mine, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                )
            state[name][key] = mine
    return {"state": state, "param_groups": saved["param_groups"]}


def load(
    ckpt: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel | None = None
) -> dict:
    """Load ckpt's weights and optimizer state into model and optimizer, resharded to parallel's
    layout; returns the rest of the saved state (step, scaler, RNG, loader, train config): this
    rank's own piece's when the layout is the saved one."""
    parallel = parallel or Parallel()
    pieces = Pieces(ckpt)
    _load_weights(pieces, model, parallel)
    pieces.names = _positions(optimizer, model)
    load_optimizer_state(optimizer, model, _optimizer_for_rank(pieces, model, parallel))
    same = (pieces.tp_size, pieces.dp_shard) == (parallel.tp_size, parallel.dp_shard_size)
    own = (parallel.tp_rank, parallel.dp_shard_rank) if same else (0, 0)
    rest = dict(pieces.state(*own))
    rest.pop("optimizer")
    return rest


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def save_run(
    out_dir, step, model, optimizer, scaler, loader, cfg, tokenizer, keep_last, parallel, saver=None
) -> Path:
    """Save a training run's step: the model and optimizer (:func:`save`, in saver's thread when
    given), and the loss scaler, the RNGs, the data loader's place and the run's TrainConfig beside
    them."""
    state = {
        "step": step,
        "scaler": scaler.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            # This rank's device only: a resume may see fewer GPUs (the local one is LOCAL_RANK % count).
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else [],
        },
        "loader": loader.state_dict(),
        "train_config": dataclasses.asdict(cfg),
    }
    tokenizer_file = tokenizer.path if isinstance(tokenizer, BPETokenizer) else None
    return save(
        out_dir, step, model, optimizer, state, tokenizer.name, tokenizer_file, keep_last, parallel, saver
    )


def restore_run(ckpt: Path, model, optimizer, scaler, loader, parallel: Parallel) -> int:
    """Load everything a checkpoint holds back into place, resharded to this run's layout; returns
    its step."""
    state = load(ckpt, model, optimizer, parallel)
    if state["scaler"]:  # bf16's and fp32's: the steps skipped in a row
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    cuda_rng = state["rng"]["cuda"]
    if torch.cuda.is_available() and len(cuda_rng):
        torch.cuda.set_rng_state(cuda_rng)
    loader.load_state_dict(state["loader"])
    return state["step"]


def export(ckpt: str | Path, out: str | Path) -> Path:
    """Write the whole model of checkpoint ckpt (a checkpoint or run directory, any layout) into
    one safetensors file, config and tokenizer name in its metadata; a BPE tokenizer.json is
    copied beside it. Returns the checkpoint exported."""
    ckpt, out = resolve(ckpt), Path(out)
    config, tokenizer = read_metadata(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"config": json.dumps(dataclasses.asdict(config)), "tokenizer": tokenizer}
    save_file(full_weights(ckpt), out, metadata=metadata)
    if tokenizer == "tokenizer.json":
        with contextlib.suppress(shutil.SameFileError):  # exported beside the tokenizer already
            shutil.copyfile((ckpt.parent if ckpt.is_file() else ckpt) / tokenizer, out.parent / tokenizer)
    return ckpt


def verify_main(run: Path, parser: argparse.ArgumentParser) -> int:
    """Print each checkpoint of run (or run itself, a checkpoint) as good or damaged and why;
    returns the exit status: 1 when any is damaged."""
    found = [run] if (run / MANIFEST).is_file() else candidates(run)
    if not found:
        parser.error(f"{run}: no checkpoint directories (ckpt_NNNNNNN) in it")
    good = []
    for ckpt in found:
        problems = verify(ckpt)
        if problems:
            print(f"{ckpt.name}: DAMAGED: {'; '.join(problems)}")
            continue
        good.append(ckpt.name)
        unchecked = None in _manifest(ckpt)["files"].values()  # written before checksums
        how = "files present, no checksums recorded" if unchecked else "sizes and SHA-256 match"
        how += ", every tensor finite"
        print(f"{ckpt.name}: good ({how})")
    for leftover in sorted(run.glob(".ckpt_*.tmp")):
        print(f"{leftover.name}: an unfinished save (ignored; the next save removes it)")
    damaged = len(found) - len(good)
    print(f"{len(good)} good, {damaged} damaged" + (f"; newest good: {good[-1]}" if good else ""))
    return 1 if damaged else 0


if __name__ == "__main__":
    from horse.hf.weights import main  # the command line exports to Hugging Face's layout too

    main()
