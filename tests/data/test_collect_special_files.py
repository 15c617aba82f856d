"""A FIFO (or socket, device) matched by an input pattern is skipped with one warning naming it (issue 44, 6:
8c6205f skipped it without a word)."""

import logging
import os

from lifecycle.tasks.data.collect.stage import match_inputs


def test_a_fifo_matched_by_a_pattern_is_named_and_skipped(tmp_path, caplog):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    os.mkfifo(tmp_path / "b.jsonl")
    logger = logging.getLogger("lifecycle")
    logger.addHandler(caplog.handler)  # whether or not the lifecycle logger propagates (the console may stop it)
    try:
        got = match_inputs([str(tmp_path / "*.jsonl")])
    finally:
        logger.removeHandler(caplog.handler)
    assert got == [str(tmp_path / "a.jsonl")]
    assert sorted({r.getMessage() for r in caplog.records if "FIFO" in r.getMessage()}) == [
        f"collect.inputs: pattern {str(tmp_path / '*.jsonl')!r} matches {tmp_path / 'b.jsonl'}, a FIFO: skipped"]
