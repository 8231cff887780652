"""horse/train.py with faults injected at chosen steps, for tests/test_faults.py.

    HORSE_FAULTS="kill@7" python tests/faulty_train.py --out-dir RUN ...      (horse.train's flags)

HORSE_FAULTS is a comma-separated list of KIND@STEP[:RANK[:RESTART]]: fault KIND strikes in step
STEP (1-based, the step in flight) on rank RANK (default 0) of torchrun attempt RESTART (default 0:
the first launch; TORCHELASTIC_RESTART_COUNT counts them). Kinds:

    raise         a RuntimeError at the step's start (a rank's failure: torchrun restarts the job)
    kill          SIGKILL after the step's optimizer update, before its metrics are written
    kill-in-save  SIGKILL in the step's checkpoint save, after its weights file is written
    term, usr1    SIGTERM / SIGUSR1 after the step's optimizer update (a grace period: the run saves)
    term-nograce  SIGTERM as above, then SIGKILL once the save it asks for has begun
    term-twice    SIGTERM as above, then a second SIGTERM in the middle of that save
    enospc        the step's save fails as on a full disk: its weights file is cut in half and
                  writing it raises what safetensors raises then (ENOSPC in a SafetensorError); once
    nan-grad      a NaN in the gradient of the step's first module output (a tensor hook on it, in
                  the first micro-batch's backward): the loss stays finite

A save's faults strike in the save of step STEP, which with --async-checkpoint runs in a thread
while later steps train. Each fault says what it does on stderr before it strikes. Signals are sent
by the process to itself, so the step they land in is exact. HORSE_WRITE_DELAY=SECONDS stands in
for a slow file system: every weights file's write first sleeps that long.
"""

import errno
import os
import re
import signal
import sys
import time

import torch
from safetensors import SafetensorError

from horse import checkpoint, cli, optim


def _faults() -> dict[int, str]:
    """{step: kind} of the faults for this rank and attempt."""
    rank, restart = int(os.environ.get("RANK", "0")), int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    chosen = {}
    for spec in filter(None, os.environ.get("HORSE_FAULTS", "").split(",")):
        kind, _, where = spec.partition("@")
        step, fault_rank, fault_restart = ([*map(int, where.split(":")), 0, 0])[:3]
        if (fault_rank, fault_restart) == (rank, restart):
            chosen[step] = kind
    return chosen


def main() -> None:
    faults = _faults()
    in_flight = [0]
    write_delay = float(os.environ.get("HORSE_WRITE_DELAY", "0"))

    def say(what: str, step: int | None = None) -> None:
        print(f"fault: {what} in step {step or in_flight[0]}", file=sys.stderr, flush=True)

    def lr_at(step, max_steps, cfg):  # called once at the start of every step
        in_flight[0] = step + 1
        if faults.get(in_flight[0]) == "raise":
            say("RuntimeError")
            raise RuntimeError(f"injected failure in step {in_flight[0]}")
        return real_lr_at(step, max_steps, cfg)

    def optimizer_step(*args, **kwargs):
        result = real_optimizer_step(*args, **kwargs)
        kind = faults.get(in_flight[0])
        if kind == "kill":
            say("kill -9")
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind in ("term", "term-nograce", "term-twice", "usr1"):
            say("SIGUSR1" if kind == "usr1" else "SIGTERM")
            os.kill(os.getpid(), signal.SIGUSR1 if kind == "usr1" else signal.SIGTERM)
        return result

    def save_file(tensors, path, metadata=None):
        time.sleep(write_delay)
        real_save_file(tensors, path, metadata=metadata)
        saved = int(re.search(r"ckpt_(\d+)", str(path)).group(1))  # the step whose save this is
        kind = faults.get(saved)
        if kind in ("kill-in-save", "term-nograce"):
            say("kill -9 during the save", saved)
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "term-twice":
            say("a second SIGTERM during the save", saved)
            os.kill(os.getpid(), signal.SIGTERM)
        elif kind == "enospc":
            faults.pop(saved)
            say("ENOSPC during the save", saved)
            os.truncate(path, os.path.getsize(path) // 2)
            no_space = f"{os.strerror(errno.ENOSPC)} (os error {errno.ENOSPC})"
            raise SafetensorError(f"Error while serializing: I/O error: {no_space}")

    def poison_gradient(module, args, output):  # every module's forward, once installed
        if faults.get(in_flight[0]) != "nan-grad" or not (torch.is_tensor(output) and output.requires_grad):
            return
        faults.pop(in_flight[0])
        say(f"a NaN into the gradient of {type(module).__name__}'s output")

        def nan_in_first_element(grad):
            grad = grad.clone()
            grad.view(-1)[0] = float("nan")
            return grad

        output.register_hook(nan_in_first_element)

    if "nan-grad" in faults.values():
        torch.nn.modules.module.register_module_forward_hook(poison_gradient)
    real_lr_at, real_optimizer_step, real_save_file = optim.lr_at, optim.optimizer_step, checkpoint.save_file
    optim.lr_at, optim.optimizer_step, checkpoint.save_file = lr_at, optimizer_step, save_file
    cli.main(sys.argv[1:])


if __name__ == "__main__":
    main()
