"""Stopping on request: SIGTERM (a scheduler's, Kubernetes') and SIGINT (Ctrl-C).

The first signal only asks for a stop (:func:`requested`): the Trainer then writes its checkpoint and
raises :class:`Stopped`. ``GRACE_S`` seconds later, or at once on a second signal, the process ends its
children (the temporary Prefect API among them) and exits; an interrupted stage leaves only its
temporary folder. Either way the exit status is 128 + the signal's number, and the same command resumes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

from repsim.errors import RepsimError

GRACE_S = 8.0  # from the signal to the forced exit: within a 10 s grace period, with room to exit
CHILDREN_S = 1.0  # how long the child processes get to end on SIGTERM before they are killed
SIGNALS = (signal.SIGTERM, signal.SIGINT)
_requested: list[signal.Signals] = []
_training: dict[str, int | None] = {}  # the training running in this process: its "step", "total" and "saved"


class Stopped(RepsimError):
    """The run stopped because a signal asked it to; the same command resumes it."""

    def __init__(self, what: str, fix: str, signum: int):
        super().__init__(what, fix)
        self.signum = signum

    def __reduce__(self) -> tuple:  # pickled with a failed task's state
        return Stopped, (self.what, self.fix, self.signum)


def install() -> None:
    """Turn SIGTERM and SIGINT into a stop request (from the main thread only, where Python delivers
    signals). The experiment flow calls it again to take them back from Prefect's flow engine."""
    if threading.current_thread() is threading.main_thread():
        for signum in SIGNALS:
            signal.signal(signum, _on_signal)


def requested() -> signal.Signals | None:
    return _requested[0] if _requested else None


def stopped(where: str) -> Stopped:
    """The error of a run that stopped ``where`` (``at step 12 of 40, its checkpoint written``) on request."""
    signum = requested() or signal.SIGTERM
    return Stopped(f"stopped by {signum.name} {where}", "run the same command again to resume from there", signum)


def training_at(step: int, total: int, saved: int | None) -> None:
    """Note that this process trains, ``step`` steps of ``total`` done, its checkpoint written after step
    ``saved`` (None: none yet), for the line a forced stop prints."""
    _training.update(step=step, total=total, saved=saved)


def training_ended() -> None:
    _training.clear()


def forced_stop(signum: signal.Signals) -> str:
    """The line of a stop that could not wait for the stage: the step a training was in, and what the
    same command resumes from."""
    if not _training:
        return (f"stopped by {signum.name} before the stage it was in ended; the same command runs it again, "
                "from its last checkpoint if it is a training that wrote one")
    step, total, saved = _training["step"], _training["total"], _training["saved"]
    resume = f"resumes from its checkpoint of step {saved}" if saved else "starts the training again (no checkpoint yet)"
    return (f"stopped by {signum.name} in step {step + 1} of {total}, which did not end within {GRACE_S:g} s; "
            f"the same command {resume}")


def _on_signal(signum: int, _frame: object) -> None:
    signum = signal.Signals(signum)
    if _requested:  # a second signal: stop now
        exit_now(signum, forced_stop(signum))
    _requested.append(signum)
    timer = threading.Timer(GRACE_S, lambda: exit_now(signum, forced_stop(signum)))
    timer.daemon = True
    timer.start()


def exit_now(signum: signal.Signals, message: str) -> None:
    """End the child processes, print ``error: <message>`` and exit with 128 + ``signum``, skipping
    clean-ups that talk to servers the signal may have stopped too."""
    _end(_descendants(os.getpid()))
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def _end(pids: list[int]) -> None:
    """SIGTERM ``pids``, then SIGKILL those still alive after ``CHILDREN_S``."""
    _send(pids, signal.SIGTERM)
    deadline = time.monotonic() + CHILDREN_S
    while (left := [pid for pid in pids if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    _send(left, signal.SIGKILL)


def _send(pids: list[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    fields = _stat(Path(f"/proc/{pid}"))
    return fields is not None and fields[0] != "Z"


def _stat(process: Path) -> list[str] | None:
    """The fields of a /proc process entry's ``stat`` after its name (state, parent, ...); None once it is gone."""
    try:
        return (process / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """The processes below ``pid``, children first (from /proc; none where there is no /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        if (fields := _stat(entry)) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        children = [child for parent in frontier for child in parents.get(parent, [])]
        found += children
        frontier = children
    return found
