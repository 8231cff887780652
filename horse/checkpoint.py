"""Checkpoints: one directory per step, written whole or not at all, one shard per tensor-parallel rank.

    OUT/ckpt_0001000/model.safetensors   the float32 master weights; the model config and the
                                         tokenizer's name in the metadata, so the file stands alone
    OUT/ckpt_0001000/state.pt            optimizer (keyed by parameter name), loss scaler, RNG
                                         states, data positions, step and train config: plain
                                         tensors and containers, so torch.load(weights_only=True)
                                         reads it
    OUT/ckpt_0001000/tokenizer.json      the BPE tokenizer, when the data had one
    OUT/ckpt_0001000/manifest.json       the tensor-parallel size and every file above, with its
                                         size and SHA-256

With tensor parallelism each tp rank writes its own shard, ``model-tp01-of-04.safetensors`` and
``state-tp01-of-04.pt`` (under the unsharded parameter names), and the data-parallel replicas
of it (dp rank > 0) write nothing. Every file goes into a temporary directory; when every rank
has written its files, rank 0 writes the manifest and renames the directory into place, so a run
killed mid-write leaves no directory that :func:`latest` would pick up, and only then deletes the
checkpoints beyond --keep-last. A save that fails on any rank (a full disk, permissions, an I/O
error) raises :class:`SaveError` on every rank, leaving the older checkpoints as they were.
Across nodes OUT must be a shared file system.

Resuming verifies before it trusts: :func:`newest_good` checks the sizes and checksums of the
newest checkpoint and falls back to older ones, saying what failed. Check a run by hand with

    python -m horse.checkpoint verify RUN_OR_CKPT_DIR      (exit status 1 when any is damaged)

Loading reshards: a checkpoint saved at tp=2 resumes at tp=1 or tp=4 (the weights and AdamW's
moments, which have the parameters' shapes, are gathered whole and split again). Export writes one
consolidated file that ``horse.generate`` and ``GPT(config).load_state_dict`` take:

    python -m horse.checkpoint export CKPT_OR_RUN_DIR --out model.safetensors
    python -m horse.checkpoint export CKPT_OR_RUN_DIR --format hf --out DIR    (horse.hf: a folder
                                               that transformers loads as GPT-2 or LLaMA)
"""

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from horse.data import BPETokenizer
from horse.model import GPTConfig
from horse.parallel import Parallel, gather_state_dicts, shard, shard_spec, shard_state_dict, unshard

WEIGHTS, STATE, MANIFEST = "model.safetensors", "state.pt", "manifest.json"
_NAME = re.compile(r"ckpt_(\d{7,})")


def shard_files(tp_rank: int, tp_size: int) -> tuple[str, str]:
    """(weights, state) file names of tp rank tp_rank's shard; model.safetensors and state.pt at tp=1."""
    if tp_size == 1:
        return WEIGHTS, STATE
    tag = f"tp{tp_rank:02d}-of-{tp_size:02d}"
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


def _written(path: Path) -> dict:
    """Flush a file just written to the disk; its :func:`_digest`, read back."""
    _fsync(path)
    return _digest(path)


def _on_every_rank(work: Callable[[], dict], parallel: Parallel) -> dict:
    """work() on this rank, then a wait for every rank (it holds a collective): the union of their
    results, or SaveError on every rank when work() raised on any."""
    try:
        result, error = work(), None
    except Exception as e:  # on a full disk safetensors raises SafetensorError, torch.save RuntimeError
        result, error = {}, str(e) if isinstance(e, OSError) else f"{type(e).__name__}: {e}"
    gathered = [(result, error)]
    if parallel.distributed:
        gathered = [None] * parallel.world_size
        dist.all_gather_object(gathered, (result, error))
    failed = [f"rank {r}: {e}" if parallel.distributed else e for r, (_, e) in enumerate(gathered) if e]
    if failed:
        raise SaveError("; ".join(failed))
    return {k: v for part, _ in gathered for k, v in part.items()}


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
    """optimizer.state_dict() with parameter names in place of positions."""
    return _by_name(optimizer.state_dict(), _positions(optimizer, model))


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, state: dict) -> None:
    """Load a state of :func:`optimizer_state` into optimizer (whose parameters are model's)."""
    index = {name: i for i, name in enumerate(_positions(optimizer, model))}
    optimizer.load_state_dict(_rekey(state, index.__getitem__))


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


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
) -> Path:
    """Write checkpoint ``step`` of model (a horse GPT, or this rank's shard of one), its optimizer
    and state into out_dir; then keep the newest keep_last. Every rank calls it (it holds
    collectives); when any rank cannot write, every rank raises SaveError."""
    parallel = parallel or Parallel()
    out_dir = Path(out_dir)
    final = out_dir / f"ckpt_{step:07d}"
    tmp = out_dir / f".{final.name}.tmp"

    def start() -> dict:
        if parallel.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed mid-write
            tmp.mkdir(parents=True)
        return {}

    def write_shard() -> dict:
        if parallel.dp_rank != 0:  # the other dp ranks hold copies of the same shard
            return {}
        weights_file, state_file = shard_files(parallel.tp_rank, parallel.tp_size)
        weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
        metadata = {
            "config": json.dumps(dataclasses.asdict(model.config)),
            "tokenizer": tokenizer,
            "tp_rank": str(parallel.tp_rank),
            "tp_size": str(parallel.tp_size),
        }
        save_file(weights, tmp / weights_file, metadata=metadata)
        torch.save(state | {"optimizer": optimizer_state(optimizer, model)}, tmp / state_file)
        return {f: _written(tmp / f) for f in (weights_file, state_file)}

    def finish(files: dict) -> dict:
        if parallel.rank != 0:
            return {}
        if tokenizer_file is not None:
            shutil.copyfile(tokenizer_file, tmp / tokenizer_file.name)
            files[tokenizer_file.name] = _written(tmp / tokenizer_file.name)
        manifest = {"step": step, "tp_size": parallel.tp_size, "files": dict(sorted(files.items()))}
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
        _on_every_rank(start, parallel)
        files = _on_every_rank(write_shard, parallel)
        _on_every_rank(lambda: finish(files), parallel)  # no rank reads the run before the rename
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


# ----------------------------------------------------------------------------------------------
# Finding and reading
# ----------------------------------------------------------------------------------------------


def _manifest(ckpt: Path) -> dict:
    """The manifest of checkpoint directory ckpt, its files a dict of name: {size, sha256}; for one
    written before tensor parallelism (no manifest), the two files it always had. Files of a
    manifest written before checksums map to None."""
    if not (ckpt / MANIFEST).is_file():
        return {"tp_size": 1, "files": dict.fromkeys([WEIGHTS, STATE]), "legacy": True}
    manifest = json.loads((ckpt / MANIFEST).read_text())
    if isinstance(manifest["files"], list):
        manifest["files"] = dict.fromkeys(manifest["files"])
    return manifest


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
    exist). Empty: good. Rank rank of world_size checks every world_size-th file only."""
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


def tp_size(ckpt: str | Path) -> int:
    """The tensor-parallel size checkpoint ckpt was saved at (1 for an exported file)."""
    ckpt = Path(ckpt)
    return 1 if ckpt.is_file() else _manifest(ckpt)["tp_size"]


def _weights_file(ckpt: Path, tp_rank: int = 0) -> Path:
    return ckpt if ckpt.is_file() else ckpt / shard_files(tp_rank, tp_size(ckpt))[0]


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


def _for_this_rank(read: Callable[[int], dict], saved_tp: int, config: GPTConfig, parallel: Parallel) -> dict:
    """This rank's shard of a state dict saved in saved_tp shards (read(r): shard r's dict): its own
    file when the tp size is unchanged, else every shard gathered whole and split again."""
    if saved_tp == parallel.tp_size:
        return read(parallel.tp_rank)
    full = gather_state_dicts([read(r) for r in range(saved_tp)], config)
    return shard_state_dict(full, config, parallel.tp_rank, parallel.tp_size)


def full_weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's weights (on the CPU) of a checkpoint saved at any tp size."""
    ckpt = Path(ckpt)
    shards = [load_file(_weights_file(ckpt, r)) for r in range(tp_size(ckpt))]
    return gather_state_dicts(shards, read_metadata(ckpt)[0])


def load_weights(ckpt: str | Path, model: nn.Module, parallel: Parallel | None = None) -> None:
    """Load ckpt's weights into model (this rank's shard of one under tensor parallelism), or raise
    naming every tensor that does not fit."""
    parallel = parallel or Parallel()
    ckpt = Path(ckpt)
    config, _ = read_metadata(ckpt)
    weights = _for_this_rank(lambda r: load_file(_weights_file(ckpt, r)), tp_size(ckpt), config, parallel)
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


def load_state(ckpt: str | Path, tp_rank: int = 0) -> dict:
    """The state file of tp rank tp_rank's shard, as saved (the optimizer keyed by parameter name)."""
    ckpt = Path(ckpt)
    path = ckpt / shard_files(tp_rank, tp_size(ckpt))[1]
    return torch.load(path, map_location="cpu", weights_only=True)


def _reshard_optimizer(shards: list[dict], config: GPTConfig, parallel: Parallel) -> dict:
    """This rank's optimizer state from every saved tp rank's: the per-parameter tensors (AdamW's
    exp_avg and exp_avg_sq, the parameter's shape) gathered and split like the parameter; scalars
    (the step count), the same on every rank, from the first."""
    state = {}
    for name, entry in shards[0]["state"].items():
        spec = shard_spec(name, config)
        state[name] = {
            key: shard(
                unshard([s["state"][name][key] for s in shards], spec),
                spec,
                parallel.tp_rank,
                parallel.tp_size,
            )
            if value.dim() > 0
            else value
            for key, value in entry.items()
        }
    return {"state": state, "param_groups": shards[0]["param_groups"]}


def load(
    ckpt: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, parallel: Parallel | None = None
) -> dict:
    """Load ckpt's weights and optimizer state into model and optimizer, resharded to parallel's tp
    size; returns the rest of the saved state (step, scaler, RNG, loader, train config)."""
    parallel = parallel or Parallel()
    ckpt = Path(ckpt)
    load_weights(ckpt, model, parallel)
    manifest = _manifest(ckpt)
    same_tp = manifest["tp_size"] == parallel.tp_size  # then this rank's own shard is enough
    states = [load_state(ckpt, r) for r in ([parallel.tp_rank] if same_tp else range(manifest["tp_size"]))]
    saved = [s.pop("optimizer") for s in states]
    if manifest.get("legacy"):  # written before tensor parallelism: by position, in today's order
        saved = [_by_name(o, _positions(optimizer, model)) for o in saved]
    if not same_tp:
        saved = [_reshard_optimizer(saved, read_metadata(ckpt)[0], parallel)]
    load_optimizer_state(optimizer, model, saved[0])
    return states[0]


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def save_run(out_dir, step, model, optimizer, scaler, loader, cfg, tokenizer, keep_last, parallel) -> Path:
    """Save a training run's step: the model and optimizer (:func:`save`), and the loss scaler, the
    RNGs, the data loader's place and the run's TrainConfig beside them."""
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
    return save(out_dir, step, model, optimizer, state, tokenizer.name, tokenizer_file, keep_last, parallel)


def restore_run(ckpt: Path, model, optimizer, scaler, loader, parallel: Parallel) -> int:
    """Load everything a checkpoint holds back into place, resharded to this run's tp size; returns
    its step."""
    state = load(ckpt, model, optimizer, parallel)
    if scaler.is_enabled() and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    cuda_rng = state["rng"]["cuda"]
    if torch.cuda.is_available() and len(cuda_rng):
        if isinstance(cuda_rng, list):  # written before: every device's, this rank's at its index
            cuda_rng = cuda_rng[min(torch.cuda.current_device(), len(cuda_rng) - 1)]
        torch.cuda.set_rng_state(cuda_rng)
    loader.load_state_dict(state["loader"])
    return state["step"]


def export(ckpt: str | Path, out: str | Path) -> Path:
    """Write the whole model of checkpoint ckpt (a checkpoint or run directory, any tp size) into
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
        print(f"{ckpt.name}: good ({how})")
    for leftover in sorted(run.glob(".ckpt_*.tmp")):
        print(f"{leftover.name}: an unfinished save (ignored; the next save removes it)")
    damaged = len(found) - len(good)
    print(f"{len(good)} good, {damaged} damaged" + (f"; newest good: {good[-1]}" if good else ""))
    return 1 if damaged else 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m horse.checkpoint", description="Checkpoint tools.")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("export", help="the whole model in one safetensors file (from any tp size)")
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
        sys.exit(verify_main(Path(args.run), parser))
    try:
        if args.format == "hf":
            from horse import hf  # it builds on this module

            ckpt = hf.export(args.ckpt, args.out)
        else:
            ckpt = export(args.ckpt, args.out)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(f"wrote {args.out}: the whole model of {ckpt} (saved at tp={tp_size(ckpt)})")


if __name__ == "__main__":
    main()
