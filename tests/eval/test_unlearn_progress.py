"""An unlearning says how far it is (issue 44, 1c: 25 minutes without a line): a progress line at most every 15 s,
with an ETA once a chunk is done."""

from __future__ import annotations

from lifecycle.tasks.eval import unlearn as ul


def test_progress_lines_are_throttled_and_carry_an_eta_after_the_first_chunk(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(ul.time, "time", lambda: clock[0])
    lines: list[str] = []
    pace = ul._Pace(chunks=4, log=lines.append)
    clock[0] += 5
    pace.step(0, 10, 1000)  # within 15 s: no progress line, but the worst case, up front
    assert lines == ["[unlearn] at 0.50 s a step, the worst case (every chunk to max_epochs) is 33 min; lower "
                     "unlearn.max_epochs or raise chunk_size to bound it"]
    clock[0] += 15
    pace.step(0, 40, 1000)
    assert lines[1:] == ["[unlearn] chunk 1/4: step 40 (at most 1000), 20 s so far"]
    pace.chunk_done()
    clock[0] += 20
    pace.step(1, 5, 1000)
    assert lines[-1] == "[unlearn] chunk 2/4: step 5 (at most 1000), 40 s so far, ETA 120 s at the pace of the chunks done"
