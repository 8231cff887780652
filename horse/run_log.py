"""What a training run writes as it goes: OUT/config.json (its flags and model), OUT/metrics.jsonl
(one JSON record a step) and the console's log line; on a data- or tensor-parallel run, rank 0
alone writes them (``horse.train``)."""

import contextlib
import dataclasses
import json
from pathlib import Path


def start(out_dir: Path, cfg, config, resumed_step: int | None) -> Path:
    """Write out_dir/config.json and return metrics.jsonl's path; a run resumed at resumed_step keeps
    the records up to that step and drops those the interrupted run logged after it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    run = {"train": dataclasses.asdict(cfg), "model": dataclasses.asdict(config)}
    (out_dir / "config.json").write_text(json.dumps(run, indent=1) + "\n")
    metrics_path = out_dir / "metrics.jsonl"
    kept = []
    if resumed_step is not None and metrics_path.exists():
        for line in metrics_path.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError, KeyError, TypeError):
                if json.loads(line)["step"] <= resumed_step:
                    kept.append(line + "\n")
    metrics_path.write_text("".join(kept))
    return metrics_path


def line(record: dict, max_steps: int) -> str:
    """The console's log line of a step's record."""
    text = f"step {record['step']:>{len(str(max_steps))}}/{max_steps} | loss {record['loss']:.4f} | "
    if "router_aux_loss" in record:  # a mixture of experts: its load-balancing loss, before the coefficient
        text += f"aux loss {record['router_aux_loss']:.4f} | "
    text += (
        f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | {_si(record['tokens_per_s'])} tok/s"
    )
    if record["loss_scale"] is not None:
        text += f" | scale {record['loss_scale']:g}"
    if record["skipped"]:
        text += " (step skipped: inf/NaN gradients)"
    if record["mfu"] is not None:
        text += f" | MFU {100 * record['mfu']:.1f}%"
    if "val_loss" in record:
        text += f" | val loss {record['val_loss']:.4f}"
    if "val_loss_by_source" in record:  # a mixture's sources
        losses, epochs = record["val_loss_by_source"], record["epochs_by_source"]
        sources = (f"{name} {loss:.4f}, epoch {epochs[name]:.2f}" for name, loss in losses.items())
        text += f" ({'; '.join(sources)})"
    return text


def _si(x: float) -> str:
    return next(
        f"{x / s:.1f}{u}" for s, u in ((1e9, "G"), (1e6, "M"), (1e3, "K"), (1, "")) if x >= s or s == 1
    )
