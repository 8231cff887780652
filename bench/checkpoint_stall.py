"""How much a checkpoint save slows the steps around it, with and without --async-checkpoint, on a
slow file system (stood in for by a writer that sleeps before each weights file).

    python -m bench.checkpoint_stall                      # the CPU, a small model, a 2 s write
    python -m bench.checkpoint_stall --write-delay 5 --steps-around 40 --device cuda

One horse.train run per mode, in this process, with one save in the middle (after step
2 x --steps-around) and the last one at the end. The steps/s of the --steps-around steps after the
save (the save's own time included: a step's time_s in metrics.jsonl is taken before its save)
over those of the same number of steps before it: 1.0 when the save costs the training nothing,
below 1 when the steps waited for the write. A run without the save in the middle gives the same
ratio for no save at all: the machine's noise. A benchmark, not a test: the figure depends on the
machine.
"""

import argparse
import time
from pathlib import Path
from tempfile import TemporaryDirectory

from horse import checkpoint, train

MODEL = {"n_layer": 2, "d_model": 128, "n_head": 4, "block_size": 64}


def ratio(records: list[dict], save_step: int, around: int) -> tuple[float, float]:
    """(steps/s of the `around` steps after save_step's save over those of the `around` before it,
    the seconds the steps after it took)."""
    time_at = {r["step"]: r["time_s"] for r in records}
    before = time_at[save_step] - time_at[save_step - around]
    after = time_at[save_step + around] - time_at[save_step]
    return before / after, after


def run(mode: str, write_delay: float, around: int, device: str) -> tuple[float, float]:
    """One run with a save after step 2 x around (mode "sync" or "async"; "none": no save there)
    and at the end, by a writer that sleeps write_delay seconds first; (ratio, seconds of the
    steps after step 2 x around)."""
    real_save_file = checkpoint.save_file

    def slow_save_file(tensors, path, metadata=None):
        time.sleep(write_delay)
        real_save_file(tensors, path, metadata=metadata)

    checkpoint.save_file = slow_save_file
    try:
        with TemporaryDirectory() as out:
            cfg = train.TrainConfig(
                out_dir=str(Path(out) / "run"),
                batch_size=8,
                max_steps=3 * around,
                ckpt_interval=0 if mode == "none" else 2 * around,  # and one at the end
                eval_interval=10 * around,
                eval_tokens=512,
                sample_tokens=0,
                log_interval=10 * around,
                device=device,
                async_checkpoint=mode == "async",
            )
            records = train.train(cfg, MODEL)
    finally:
        checkpoint.save_file = real_save_file
    return ratio(records, 2 * around, around)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_stall", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--write-delay", type=float, default=2.0, help="seconds each weights file's write sleeps"
    )
    parser.add_argument("--steps-around", type=int, default=30, help="steps timed before and after the save")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args(argv)
    modes = {"none": "no save", "sync": "--no-async-checkpoint", "async": "--async-checkpoint"}
    rows = {mode: run(mode, args.write_delay, args.steps_around, args.device) for mode in modes}
    print(
        f"one save, its weights write slowed by {args.write_delay:g} s; {args.steps_around} steps each side"
    )
    for mode, (speed, after) in rows.items():
        print(
            f"{modes[mode]:>21}: steps/s after the save / before it = {speed:.3f} "
            f"({after:.2f} s for the steps after)"
        )


if __name__ == "__main__":
    main()
