"""The command line of ``horse.train``: a flag for every field of ``TrainConfig`` and of
``horse.model.GPTConfig``, a JSON file of them (``--config``), and the saved flags of a run that
``--resume`` continues. ``python -m horse.train`` and ``python horse/train.py`` land in :func:`main`."""

import argparse
import contextlib
import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Literal

from horse import checkpoint, recipes
from horse import train as trainer
from horse.model import GPTConfig
from horse.train import TrainConfig, flag


def integer(text: str) -> int:
    """An int flag that also takes 1e9 (and, as int() does, 10_000_000)."""
    with contextlib.suppress(ValueError):
        return int(text)
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


def _flag_kwargs(hint) -> dict:
    """argparse keywords for a field's type: int, float, str, bool, a Literal of choices, or X | None."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is Literal:
        return {"choices": typing.get_args(hint)}
    if hint is bool:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": {int: integer, float: float, str: str}[hint]}


def _docs(cls) -> dict[str, str]:
    """Field descriptions from the ``name: text`` lines of a dataclass's docstring."""
    return dict(re.findall(r"^ {4}(\w+): (.+)$", cls.__doc__, re.MULTILINE))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m horse.train",
        description=trainer.__doc__.split("\n\n")[0],
        argument_default=argparse.SUPPRESS,  # so that only what was given overrides the config file
    )
    parser.add_argument("--config", metavar="JSON", help="flags from a JSON object keyed by field name")
    for title, cls in (("training", TrainConfig), ("model (each overrides the preset's value)", GPTConfig)):
        group = parser.add_argument_group(title)
        docs, hints = _docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f" (default {f.default!r})" if cls is TrainConfig and f.default is not None else ""
            if cls is TrainConfig and f.name in recipes.FIELDS:
                default = " (default: the preset's recipe)"
            kwargs = _flag_kwargs(hints[f.name])
            group.add_argument(flag(f.name), dest=f.name, help=docs.get(f.name, "") + default, **kwargs)
    return parser


def _from_json(path: str, parser: argparse.ArgumentParser) -> dict:
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(values, dict):
        parser.error(f"--config {path}: expected a JSON object of field names and values")
    hints = typing.get_type_hints(TrainConfig) | typing.get_type_hints(GPTConfig)
    for key, value in values.items():
        if key not in hints:
            parser.error(f"--config {path}: unknown field {key!r}")
        kwargs = _flag_kwargs(hints[key])
        ok = value is None if typing.get_origin(hints[key]) in (typing.Union, types.UnionType) else False
        if "choices" in kwargs:
            ok |= value in kwargs["choices"]
        elif "action" in kwargs:
            ok |= isinstance(value, bool)
        else:
            kind = kwargs["type"]
            ok |= isinstance(value, (int, float) if kind is float else str if kind is str else int)
            ok &= not isinstance(value, bool)
        if not ok:
            parser.error(f"--config {path}: {key} cannot be {value!r}")
    return values


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, dict]:
    """(TrainConfig, model overrides) from defaults < the preset's recipe < the resumed run's
    config.json < --config file < command line: ``--out-dir DIR --resume`` alone continues a run
    with the flags it was started with."""
    parser = build_parser()
    given = vars(parser.parse_args(argv))
    values = _from_json(given.pop("config"), parser) if "config" in given else {}
    values |= given
    saved = Path(values.get("out_dir", "")) / "config.json"
    if values.get("resume") and values.get("out_dir") and saved.is_file():
        run = json.loads(saved.read_text())
        run["train"].pop("fail_at_step", None)  # in older runs' config.json; tests inject faults now
        # A run saved before document masking existed goes on as it began (its checkpoint's model).
        run["model"].setdefault("document_masking", False)
        run["model"].setdefault("eot_id", None)
        values = run["train"] | run["model"] | values
    values = recipes.recipe_values(values.get("preset", TrainConfig.preset), values)
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        cfg = TrainConfig(**{k: v for k, v in values.items() if k in train_fields})
    except ValueError as e:
        parser.error(str(e))
    return cfg, {k: v for k, v in values.items() if k not in train_fields}


def main(argv: list[str] | None = None) -> None:
    cfg, overrides = parse_args(argv)
    try:
        trainer.train(cfg, overrides)
    except (ValueError, FileNotFoundError, ImportError, checkpoint.SaveError) as e:
        sys.exit(f"horse.train: error: {e}")
