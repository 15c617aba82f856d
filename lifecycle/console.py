"""What `lifecycle run` shows while it runs: one line per stage, the libraries' chatter in a log file.

`Capture` sends file descriptors 1 and 2 (Dask's workers, Prefect's server, MLflow, DeepSpeed's launcher and every
Python warning with them) to `<workdir>/logs/run-<timestamp>.log`, keeping copies of the originals for the stage
lines and the summary. `RunConsole`, a `lifecycle.flows.reporting.Reporter`, draws one line per stage: a `rich`
Live area on a terminal (rows in, kept, rejected, rows/s, the top drop reasons; step, loss, tokens/s, ETA), plain
lines elsewhere (one per finished stage; at most one progress line per `PLAIN_EVERY_S`). `-v/--verbose` leaves the
descriptors alone and prints plain lines. This module imports neither Prefect nor the flow: `Capture` must start
before Prefect is imported (Prefect's console handler decides on colours when it is created). `print_summary` is
the run's closing summary.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from lifecycle.flows.reporting import Reporter

PLAIN_EVERY_S = 60.0
"""Non-terminal output: the least time between two progress lines of one stage."""
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


class Capture:
    """Sends file descriptors 1 and 2 (and every process started from here) to `log_path`, appending;
    `out` and `err` write to the original stdout and stderr. `close()` puts the descriptors back; it also
    runs at exit, after the libraries' own exit handlers (registered later, run earlier), so their shutdown
    messages land in the log too."""

    def __init__(self, log_path: Path):
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        sys.stdout.flush()
        sys.stderr.flush()
        self._saved = (os.dup(1), os.dup(2))
        self.out = _text(self._saved[0], sys.stdout)
        self.err = _text(self._saved[1], sys.stderr)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.write(fd, f"=== {time.strftime('%Y-%m-%dT%H:%M:%S')} {' '.join(sys.argv)}\n".encode())
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        self._closed = False
        # the project's own warnings (a damaged dataset moved aside and rebuilt, a damaged checkpoint skipped)
        # are for the user: they go to the terminal's stderr as well as the log
        self._warnings = logging.StreamHandler(self.err)
        self._warnings.setLevel(logging.WARNING)
        self._warnings.setFormatter(logging.Formatter("lifecycle: warning: %(message)s"))
        logging.getLogger("lifecycle").addHandler(self._warnings)
        atexit.register(self.close)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        logging.getLogger("lifecycle").removeHandler(self._warnings)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os.dup2(self._saved[0], 1)
        os.dup2(self._saved[1], 2)
        for fd in self._saved:
            os.close(fd)


def _text(fd: int, like: TextIO) -> TextIO:
    """A line-buffered text stream on a copy of `fd`, with the encoding of the stream it stands in for."""
    return io.TextIOWrapper(os.fdopen(os.dup(fd), "wb", buffering=0), encoding=getattr(like, "encoding", None),
                            errors="replace", line_buffering=True)


def log_path_for(workdir: str | Path) -> Path:
    return Path(workdir).resolve() / "logs" / f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"


# --------------------------------------------------------------------------------------------------
# formatting


def _num(n: float) -> str:
    """1234 -> 1,234; 12345678 -> 12.3M (keeps a stage line short)."""
    if abs(n) >= 10_000_000:
        return f"{n / 1e6:.1f}M"
    return f"{int(n):,}" if float(n).is_integer() else f"{n:,.1f}"


def _rate(n: float) -> str:
    return f"{n / 1e3:.1f}k" if n >= 10_000 else f"{n:,.0f}"


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def funnel(stats: dict, elapsed: float | None) -> str:
    """'2,130 in, 679 kept, 1,451 rejected (68.1%), 1,203 rows/s; top: too_short 900, ...; pii_email 2' of a
    stage's manifest stats: the three most frequent drop reasons, then its three largest counters."""
    rows_in, kept = stats.get("rows_in", 0), stats.get("rows_kept", 0)
    rejected = stats.get("rows_rejected", rows_in - kept)
    text = f"{_num(rows_in)} in, {_num(kept)} kept, {_num(rejected)} rejected"
    if rows_in:
        text += f" ({100 * rejected / rows_in:.1f}%)"
    if elapsed and elapsed > 0 and rows_in:
        text += f", {_rate(rows_in / elapsed)} rows/s"
    top = sorted((stats.get("rejected_by_reason") or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    if top:
        text += "; top: " + ", ".join(f"{reason} {_num(n)}" for reason, n in top)
    counts = sorted((stats.get("counters") or {}).items(), key=lambda kv: (-kv[1], kv[0]))[:3]
    if counts:  # what a stage counts besides drops: redactions, near duplicates, tokens
        text += "; " + ", ".join(f"{name} {_num(n)}" for name, n in counts)
    return text


def train_progress(rec: dict, max_steps: int | None, step_s: float | None = None) -> str:
    """'step 120/200, loss 5.43, 10.2k tok/s, ETA 1:05' of a metrics record (kind train). The ETA counts
    `step_s` seconds a step (the mean over the steps seen, evaluations and saves included), else the record's
    own step time."""
    step = rec["step"]
    text = f"step {step}/{max_steps}" if max_steps else f"step {step}"
    if rec.get("loss") is not None:
        text += f", loss {rec['loss']:.4f}"
    if rec.get("tokens_per_s"):
        text += f", {_rate(rec['tokens_per_s'])} tok/s"
    if max_steps and (step_s or rec.get("step_time")):
        text += f", ETA {_duration(max(max_steps - step, 0) * (step_s or rec['step_time']))}"
    return text


# --------------------------------------------------------------------------------------------------
# the console


def _width(out: TextIO) -> int | None:
    """The terminal's width when `out` is one (rich would ask descriptors 0-2, which may be the log file)."""
    try:
        return (os.get_terminal_size(out.fileno()).columns or None) if out.isatty() else None  # a bare pty says 0
    except (OSError, ValueError, io.UnsupportedOperation):  # StringIO, closed or odd streams: rich's default
        return None


class _Line:
    def __init__(self, name: str):
        self.name, self.status, self.text = name, "running", ""
        self.t0 = time.monotonic()
        self.printed_at = self.t0  # plain mode: when this stage last printed a progress line


class RunConsole(Reporter):
    """One line per stage on `out`: live on a terminal, plain lines otherwise (see the module docstring).
    The flow reports to it through the methods of `Reporter`."""

    def __init__(self, out: TextIO, max_steps: int | None = None, live: bool | None = None):
        self.out = out
        self._first_step: tuple[float, int] | None = None  # (clock, step) of the first training record seen
        self.max_steps = max_steps
        self.rich = Console(file=out, highlight=False, soft_wrap=False, width=_width(out))
        self.live_mode = self.rich.is_terminal if live is None else live
        self.lines: dict[str, _Line] = {}
        self._lock = threading.RLock()
        self._live: Live | None = None

    # ---- lifecycle

    def __enter__(self) -> "RunConsole":
        if self.live_mode:
            self._live = Live(self, console=self.rich, refresh_per_second=4, transient=False,
                              redirect_stdout=False, redirect_stderr=False)
            self._live.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            for line in self.lines.values():
                if line.status == "running" and exc[0] is not None:
                    line.status = "failed"
        if self._live is not None:
            self._live.stop()
            self._live = None

    def print(self, text: str = "") -> None:
        """A line above the live area (or a plain line). Never called holding `_lock`: rich's refresh thread
        holds its own lock while it asks `__rich__` for the lines."""
        if self._live is not None:
            self._live.console.print(Text(text), soft_wrap=True)
        else:
            with self._lock:
                self.out.write(text + "\n")
                self.out.flush()

    def __rich__(self) -> Group:
        with self._lock:
            frame = SPINNER[int(time.monotonic() * 8) % len(SPINNER)]
            rows = []
            for line in self.lines.values():
                mark = frame if line.status == "running" else " "
                running = line.status == "running"  # a finished line may wrap: all of its figures stay readable
                rows.append(Text(f"{mark} {self._format(line)}", no_wrap=running, overflow="ellipsis" if running else "fold"))
            return Group(*rows)

    @staticmethod
    def _format(line: _Line) -> str:
        return f"{line.name:<10} {line.status:<9} {line.text}".rstrip()

    def _plain(self, line: _Line, force: bool) -> None:
        now = time.monotonic()
        if force or now - line.printed_at >= PLAIN_EVERY_S:
            line.printed_at = now
            self.out.write(f"  {self._format(line)}\n")
            self.out.flush()

    # ---- Reporter

    def stage_started(self, stage: str) -> None:
        with self._lock:
            self.lines[stage] = _Line(stage)
            if stage == "train":
                self.lines[stage].text = "launching DeepSpeed ranks"

    def shards_done(self, stage: str, done: int, total: int, stats: dict) -> None:
        with self._lock:
            line = self.lines.get(stage) or self.lines.setdefault(stage, _Line(stage))
            line.text = f"shard {done}/{total}: " + funnel(stats, time.monotonic() - line.t0)
            if self._live is None and done < total:
                self._plain(line, force=False)

    def train_metrics(self, record: dict) -> None:
        if record.get("kind") != "train":
            return
        with self._lock:
            line = self.lines.get("train") or self.lines.setdefault("train", _Line("train"))
            now = time.monotonic()
            first = self._first_step = self._first_step or (now, record["step"])
            steps = record["step"] - first[1]  # the mean since the first record: evaluations and saves count
            line.text = train_progress(record, self.max_steps, (now - first[0]) / steps if steps > 0 else None)
            if self._live is None and record["step"] != self.max_steps:
                self._plain(line, force=False)

    def progress(self, stage: str, text: str) -> None:
        with self._lock:
            line = self.lines.get(stage) or self.lines.setdefault(stage, _Line(stage))
            line.text = f"{text} [{_duration(time.monotonic() - line.t0)} so far]"
            if self._live is None:
                self._plain(line, force=False)  # in CI, at most one line per PLAIN_EVERY_S

    def stage_done(self, stage: str, outcome: str, stats: dict | None = None, detail: str = "") -> None:
        with self._lock:
            line = self.lines.get(stage) or self.lines.setdefault(stage, _Line(stage))
            elapsed = time.monotonic() - line.t0
            line.status = outcome
            parts = [funnel(stats, elapsed if outcome != "reused" else None)] if stats else []
            parts += [detail] if detail else []
            line.text = "; ".join(parts) + ("" if outcome == "reused" else f" [{_duration(elapsed)}]")
            if self._live is None:
                self._plain(line, force=True)
        if self._live is not None:
            self._live.refresh()

    def note(self, text: str) -> None:
        self.print(f"  {text}")


# the figures a user decides on, printed in the summary; the rest are in the model card, MLflow and --json
# (with evaluate's own headline, metrics_text.HEADLINE)
SUMMARY_METRICS = ("train_loss", "train_steps", "train_params", "val_perplexity", "contamination_near_copy_rate")


def print_summary(s: dict, file=None) -> None:
    def p(text: str = "") -> None:
        print(text, file=file or sys.stdout)

    outcomes = ", ".join(f"{n} {o}" for o, n in Counter(s["stages"].values()).items())
    p(f"\nlifecycle run {s['status']} in {s['elapsed_s']} s" + (f": {len(s['stages'])} stages ({outcomes})"
                                                               if s["stages"] else ""))
    p(f"  work dir:        {s['workdir']}" + (" (each stage's output: latest/<stage>)" if s["stages"] else ""))
    if s.get("model"):
        promo = s.get("promotion") or {}
        p(f"  model:           {s['model']['name']} version {s['model']['version']}"
          + (f"; champion: {promo['decision']}" if promo.get("decision") else ""))
    from lifecycle.tasks.eval.evaluate.metrics_text import HEADLINE

    shown = {k: v for k, v in s["metrics"].items() if k in SUMMARY_METRICS + HEADLINE}
    for line in metric_lines(shown):
        p(line)
    if s["status"] == "no_new_inputs":  # a no-op scheduled tick: nothing was committed and no MLflow run opened
        p("  nothing to do: every input file was collected by an earlier run (no MLflow run was opened)")
        return
    rest = len(s["metrics"]) - len(shown)
    p(f"  MLflow run:      {s['mlflow_run_id']}" + (f" ({rest} more metrics there, in the model card and "
                                                      f"under --json)" if rest > 0 else ""))
    for name, label in (("funnel", "funnel chart"), ("loss_curves", "loss curves"), ("model_card", "model card")):
        if s.get("artifacts", {}).get(name):
            p(f"  {label + ':':<16} {s['artifacts'][name].removeprefix('file://')}")
    if s.get("log"):
        p(f"  log:             {s['log']}")
    if s.get("left_running"):
        p(f"  left running:    {s['left_running']}")
    bindir = os.path.dirname(sys.executable)  # the venv's, so that the commands work from any directory
    p(f"\nOpen the MLflow UI:  {bindir}/mlflow ui --backend-store-uri {s['mlflow_tracking_uri']} --port 5000")
    p(f"Why documents were dropped:  {bindir}/lifecycle sql \"SELECT stage, reason, count(*) FROM rejected GROUP BY "
      f"ALL ORDER BY 3 DESC\" --workdir {s['workdir']}")


def metric_lines(metrics: dict) -> list[str]:
    """One line per metric family, in order: {val_loss: 5.314, val_bpb: 2.063, step: 200} ->
    ['  val:             loss 5.314, bpb 2.063', '  step:            200']."""
    groups: dict[str, list[str]] = {}
    for k, v in metrics.items():
        family, _, name = k.partition("_")
        value = f"{v:.4g}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
        groups.setdefault(family, []).append(f"{name} {value}" if name else value)
    return [f"  {family + ':':<16} " + ", ".join(items) for family, items in groups.items()]
