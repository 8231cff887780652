"""Preemption: a signal asks the run to finish the step in flight, save it and stop, resumable.

Slurm and Kubernetes preempt a job with SIGTERM and a grace period before SIGKILL (Slurm's
``--signal=USR1@120`` warns ahead with SIGUSR1). On any signal of ``--save-on-signal`` the trainer
finishes its step; at the end of every step all ranks agree, through one all-reduce of the signal
number, whether any rank received one (a rank that stopped alone would leave the others waiting
in a collective forever); then every rank writes its part of the checkpoint and the job exits
with :data:`PREEMPTED` (75, EX_TEMPFAIL: "try again later"), which a job script can take as "requeue
with --resume". A process's second signal during that save aborts it, exiting 128 + its number as the signal
would have: the save leaves only its temporary directory, never a partial checkpoint, and older
checkpoints are untouched (``horse.checkpoint`` renames a save into place only when it is whole
and rotates only after that). A second signal before the save counts as the first: under Slurm
every process of a step gets the signal, and torchrun forwards its own copy to its workers.

torchrun forwards SIGTERM to its workers and waits 30 s before SIGKILL; for SIGUSR1 it needs
``TORCHELASTIC_SIGNALS_TO_HANDLE=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1`` in its environment (or
send the signal to the workers themselves).
"""

import contextlib
import os
import signal
import sys

import torch
import torch.distributed as dist

PREEMPTED = 75  # sysexits.h EX_TEMPFAIL


def parse_signals(text: str) -> list[signal.Signals]:
    """The signals named in text ("SIGTERM SIGUSR1", commas allowed, SIG optional); empty: none."""
    names = text.replace(",", " ").split()
    found = []
    for name in names:
        full = name.upper() if name.upper().startswith("SIG") else "SIG" + name.upper()
        if full in ("SIGKILL", "SIGSTOP") or not isinstance(getattr(signal, full, None), signal.Signals):
            raise ValueError(f"--save-on-signal: {name!r} is not a signal that can be caught")
        found.append(signal.Signals[full])
    return found


class Preempted(SystemExit):
    """Raised by the trainer after the checkpoint of a preemption is written: exits PREEMPTED."""

    def __init__(self):
        super().__init__(PREEMPTED)


class Aborted(SystemExit):
    """A second signal: stop now, exiting as the signal would (128 + its number)."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


class Preemption:
    """Catches the given signals while installed (a context manager) and tells, at the end of each
    step, whether any rank of the world has received one.

    The handler only records the signal: the step in flight runs to its end. This rank's second
    signal inside :meth:`saving` raises :class:`Aborted` there; its first one there, while saving
    for another rank's signal, is the same request (torchrun forwards SIGTERM to its workers one
    after the other)."""

    def __init__(self, signals: list[signal.Signals], device: str = "cpu"):
        self.signals, self.device = signals, device
        self.received: signal.Signals | None = None
        self.in_save = False
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.received is not None and self.in_save:
            print(f"{signal.Signals(signum).name} again: aborting now", file=sys.stderr, flush=True)
            raise Aborted(signum)
        self.received = self.received or signal.Signals(signum)

    def __enter__(self) -> "Preemption":
        for s in self.signals:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def agreed(self) -> signal.Signals | None:
        """The signal any rank received (the highest number), the same on every rank; None when
        none did. Every rank calls it at the same point of every step: under torchrun it is an
        all-reduce (MAX). Only the reduced value is returned: this rank's handler may run after the
        all-reduce, and a signal it records then is the next step's, as on every other rank."""
        if not (self.signals and dist.is_initialized()):
            return self.received  # None when no signal is caught
        flag = torch.tensor([self.received or 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signum = int(flag.item())
        return signal.Signals(signum) if signum else None

    @contextlib.contextmanager
    def saving(self):
        """Around a checkpoint save: a signal after the first one aborts it."""
        self.in_save = True
        try:
            yield
        finally:
            self.in_save = False


def restart_store_warning() -> str | None:
    """A warning for a torchrun launch that restarts its workers (--max-restarts) while sharing its
    rendezvous store with them: the restarted workers can read the failed ones' stale addresses."""
    shared_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if shared_store and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        return (
            "warning: restarts may fail to reconnect while torchrun shares its rendezvous store with the "
            "workers: launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch/pytorch#135712)"
        )
    return None
