"""At most $LIFECYCLE_EMBEDDED_MAX work dirs keep their embedded servers up (issue 41 §4: 16 work dirs left 32
idle processes and 7.5 GB): a new work dir's server stops those of the least recently used ones, never one a run
holds. The bound's bookkeeping on its own, then real servers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

from lifecycle.core.fs import cache_dir
from lifecycle.flows.startup import idle
from tests.conftest import ROOT


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_the_least_recently_used_idle_work_dirs_are_stopped(cache, monkeypatch):
    monkeypatch.setenv(idle.MAX_ENV, "2")
    dirs = [cache / f"w{i}" for i in range(4)]
    for i, wd in enumerate(dirs):
        (wd / "datasets").mkdir(parents=True)
        idle.note_use(wd)
        for f in idle.registry().iterdir():  # an order the clock cannot blur: w0 oldest, w3 newest
            if f.read_text() == str(wd):
                os.utime(f, (1000 + i, 1000 + i))
    busy = {dirs[0]}  # a run holds w0's server: never stopped, however old
    stopped: list = []
    got = idle.stop_least_used(dirs[3], idle=lambda wd: wd not in busy,
                               stop=lambda wd: stopped.append(wd) or ["embedded-prefect"])
    assert stopped == [dirs[1]]  # w2 (the most recent other) stays with w3: 2 in all
    assert got == [f"embedded-prefect ({dirs[1]})"]
    assert sorted(f.read_text() for f in idle.registry().iterdir()) == sorted(map(str, (dirs[0], dirs[2], dirs[3])))
    monkeypatch.setenv(idle.MAX_ENV, "0")
    with pytest.raises(ValueError, match="LIFECYCLE_EMBEDDED_MAX must be a whole number >= 1"):
        idle.limit()


START = ("import json, sys; from lifecycle.flows.startup.environment import embedded_server; "
         "print(json.dumps(embedded_server(sys.argv[1])))")


def start(wd, env) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", START, str(wd)], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_a_third_work_dir_stops_the_first_ones_real_server(tmp_path):
    real_template = next(cache_dir().glob("prefect-*-empty.db"), None)  # spare the new cache Prefect's migrations
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), idle.MAX_ENV: "2"}
    if real_template is not None:
        (tmp_path / "cache" / "lifecycle").mkdir(parents=True)
        shutil.copy(real_template, tmp_path / "cache" / "lifecycle" / real_template.name)
    wds = [tmp_path / f"w{i}" for i in range(3)]
    servers = []
    try:
        for wd in wds:
            servers.append(start(wd, env))
            time.sleep(0.05)  # distinct use times
        first, second, third = (s for s, _ in servers)
        assert f"stopped the idle embedded-prefect ({wds[0]})" in servers[2][1]
        assert not (wds[0] / ".servers" / "embedded.json").exists()
        for s in (second, third):
            os.kill(s["pid"], 0)  # still up
    finally:
        for wd in wds:
            subprocess.run([sys.executable, "-m", "lifecycle.cli", "down", "--set", f"workdir={wd}"], cwd=ROOT,
                           capture_output=True, env=env, timeout=60)
