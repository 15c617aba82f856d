"""SIGKILL at random moments (and inside a save), then resume: the loss curve and final weights must be
bitwise-identical to an uninterrupted run. About a minute per kill on 2 cores, so it is slow-marked:

    LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow tests/train/test_faults.py    # LIFECYCLE_KILLS=10 by default

The harness (tests/faults.py) is also `python -m bench.kill_resume`.
"""

import os

import pytest

from tests.faults import kill_and_resume


@pytest.mark.slow
def test_random_sigkills_resume_bitwise_identically():
    kills = int(os.environ.get("LIFECYCLE_KILLS", "10"))
    got = kill_and_resume(kills)
    assert got["identical"] == got["kills"] == kills
    assert got["identical_mid_run"] >= kills // 2  # most kills land before the final commit, so they really resume
