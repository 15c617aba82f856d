"""A flow run that an interrupt (^C, SIGTERM) ends is Cancelled, not Crashed.

Prefect's engine marks such a run Crashed as the exception leaves the flow. The flow notes the run here as it
unwinds (`note_interrupted`); `lifecycle run` calls `cancel_interrupted` once the engine is done, while the server
still runs. This module imports Prefect only when there is a run to cancel: the CLI imports it on every interrupt.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from lifecycle.core.procs import Terminated

log = logging.getLogger(__name__)


def interrupt_of(exc: BaseException) -> str | None:
    """The signal's name when `exc` is an interrupt (^C, or SIGTERM as raised by the CLI's handler or by Prefect's
    own while a flow runs); None for any other failure."""
    from prefect.exceptions import TerminationSignal

    if isinstance(exc, KeyboardInterrupt):
        return "SIGINT"
    if isinstance(exc, Terminated):
        return str(exc)
    if isinstance(exc, TerminationSignal):
        return signal.Signals(exc.signal).name
    return None


# Process-wide, not passed: what the flow notes must reach the CLI's handler of the interrupt, and the exception
# that gets there is not the one the flow saw (Prefect's SIGTERM handler raises its own, then re-sends the signal).
_interrupted: list[tuple[Any, str]] = []  # (flow run id, signal) of flow runs an interrupt ended in this process


def note_interrupted(flow_run_id, signame: str) -> None:
    """Remember a flow run that an interrupt is ending; `cancel_interrupted` marks it once Prefect's engine is done."""
    _interrupted.append((flow_run_id, signame))


def cancel_interrupted() -> None:
    """Move the flow runs an interrupt ended to Cancelled. Prefect's engine forces them to Crashed as the exception
    leaves the flow; the caller (`lifecycle run`) calls this after that, while the server still runs."""
    if not _interrupted:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled

    while _interrupted:
        flow_run_id, signame = _interrupted.pop()
        try:
            with get_client(sync_client=True) as client:
                client.set_flow_run_state(flow_run_id, Cancelled(
                    message=f"interrupted by {signame}; rerun to resume from the last commit"), force=True)
        except Exception as e:  # the run is being interrupted: say so, never mask the interrupt
            log.warning("could not mark flow run %s cancelled: %s", flow_run_id, e)
