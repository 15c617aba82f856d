"""Helpers shared by the test modules (import them as `from tests.conftest import ...`) and the slow marker."""

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = sorted((ROOT / "corpus" / "python-docs").glob("*.jsonl.gz"))

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# each test's `lifecycle run` starts its work dir's embedded Prefect server (flows/startup/): let it stop soon after
os.environ.setdefault("LIFECYCLE_EMBEDDED_IDLE_S", "30")
# and no warm runner beside it (~500 MB and ~3 s of imports each): tests/flows/test_embedded_runner.py turns it on
os.environ.setdefault("LIFECYCLE_EMBEDDED_RUNNER", "0")
# tests run side by side, each in work dirs of its own: none stops another's idle server for the machine's bound
# (flows/startup/idle.py); tests/flows/test_idle_servers.py checks the bound in a cache of its own
os.environ.setdefault("LIFECYCLE_EMBEDDED_MAX", "1000")


def corpus_records(n: int, every_file: bool = False) -> list[dict]:
    """The first n records of the bundled (real, human-written) corpus: of its first file, or of all its files."""
    out = []
    for path in CORPUS if every_file else CORPUS[:1]:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            for line in f:
                out.append(json.loads(line))
                if len(out) == n:
                    return out
    return out


def docs_table(texts: list[str], prefix: str = "d"):
    """A document table (DOC_SCHEMA) holding `texts`, with doc_ids `<prefix><i>` and source_ids `src-<prefix><i>`."""
    import pyarrow as pa

    from lifecycle.core.dataset import DOC_SCHEMA

    n = len(texts)
    return pa.table({"doc_id": [f"{prefix}{i}" for i in range(n)], "source_id": [f"src-{prefix}{i}" for i in range(n)],
                     "text": texts, "source": ["test"] * n, "url": [None] * n, "meta": ["{}"] * n}, schema=DOC_SCHEMA)


def jaccard(a: str, b: str, n: int = 5) -> float:
    """True Jaccard similarity of two texts' word n-gram shingle sets (what dedup's MinHash estimates)."""
    from lifecycle.tasks.data.dedup.stage import shingles

    x, y = shingles(a, n), shingles(b, n)
    return len(x & y) / max(1, len(x | y))


def make_collect(workdir, tables, fixture: str = "tests"):
    """A committed `collect` dataset holding the given document tables (one Parquet file each)."""
    from lifecycle.core.dataset import StageStats, materialize

    def build(writer):
        for t in tables:
            writer.write_table(t)
        n = sum(t.num_rows for t in tables)
        return {"stats": StageStats(rows_in=n, rows_kept=n)}

    return materialize(workdir, "collect", {"fixture": fixture}, "test", build)


def load_shipped(path: Path, tmp_path: Path):
    """A deploy/configs file loaded as shipped; one that continues a Hugging Face checkpoint
    (`train.init_from: hf:`) gets the tiny random Llama 3 its comment says to make, made under tmp_path."""
    from lifecycle.config import load_config

    overrides = []
    if "init_from: hf:" in path.read_text():
        from bench.hf_import import make_tiny

        overrides = [f"train.init_from=hf:{make_tiny(tmp_path / 'base', 'llama3', shard_size='200KB')}"]
    return load_config(path, overrides)  # raises ConfigError naming the file and the field if a value is invalid


def last_json(text: str):
    """The JSON object a `--json` command prints as its last line."""
    return json.loads(text.strip().splitlines()[-1])


def lifecycle(*args: str, rc: int | None = 0, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run the `lifecycle` command as a user does (a new process, in the checkout, through the console script's
    entry point: `lifecycle run` goes to the warm runner where `lifecycle up` started one). `rc`: the exit status it
    must end with (None: any); the assertion shows the tail of its output."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle.launch", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if rc is not None:
        assert proc.returncode == rc, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def lifecycle_in_process(capsys, *argv: str):
    """Run a `lifecycle ... --json` command in this process; (exit status, its JSON)."""
    from lifecycle.cli import main

    capsys.readouterr()
    rc = main([*argv, "--json"])
    return rc, last_json(capsys.readouterr().out)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long fault-injection runs; skipped unless LIFECYCLE_SLOW=1")


_TIERS_BEFORE: set = set()


def pytest_sessionstart(session):
    from lifecycle.tasks.train import memtier  # stdlib only

    _TIERS_BEFORE.update(memtier.tiers())


def pytest_sessionfinish(session, exitstatus):
    """A failed or killed training run keeps its memory tier in /dev/shm for its rerun (`memtier.release_dead` frees
    it at the next launch); a test's run has no rerun, so the tiers this session created and whose supervisor is
    gone are removed here. Tiers that were there before the session (a user's own) are left alone. Under xdist only
    the controller does it, once every worker is done (a worker could see another's tier mid-creation)."""
    from lifecycle.tasks.train import memtier

    if hasattr(session.config, "workerinput"):
        return
    memtier.release_dead(grace_s=0.0, only=memtier.tiers() - _TIERS_BEFORE)


def pytest_collection_modifyitems(config, items):
    for item in items:  # pytest-timeout's bound (pyproject: 600 s) is a backstop against hangs; slow runs get more
        if "slow" in item.keywords and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(3600))
    if os.environ.get("LIFECYCLE_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with LIFECYCLE_SLOW=1 .venv/bin/python -m pytest -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _mapped_shm() -> set[str]:
    """Names of /dev/shm files some live process maps."""
    out = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            out.update(line.rsplit("/dev/shm/", 1)[1].strip() for line in maps.read_text().splitlines()
                       if "/dev/shm/" in line)
        except (OSError, IndexError):
            continue
    return out


def deepspeed_shm() -> set[str]:
    from lifecycle.tasks.train.supervise import SHM_PREFIX

    return {p.name for p in Path("/dev/shm").glob(f"{SHM_PREFIX}_*")} if Path("/dev/shm").is_dir() else set()


def _listening_ports() -> set[int]:
    """Local TCP ports some socket listens on (/proc/net/tcp{,6}, state 0A)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 3 and fields[3] == "0A":
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def release_new_deepspeed_shm(before: set[str]) -> list[str]:
    """Unlink the DeepSpeed all-reduce buffers that appeared since `before` and that belong to no live launch.

    A buffer is live while a process maps it, and also while its launch's store listens on the port in its name
    (`..._<addr>_<port>_<rank>`): DeepSpeed's rank creates its file before it maps it, and the peer ranks spin
    until it exists. Another xdist worker's run can be in that instant; unlinking its file there left a rank
    spinning and its peer waiting 30 minutes in `new_group` (CI, 2026-11-24)."""
    gone = []
    if new := deepspeed_shm() - before:
        mapped, listening = _mapped_shm(), _listening_ports()
        for name in sorted(new - mapped):
            port = name.rsplit("_", 2)[-2]
            if port.isdigit() and int(port) in listening:
                continue
            (Path("/dev/shm") / name).unlink(missing_ok=True)
            gone.append(name)
    return gone


@pytest.fixture(autouse=True)
def _release_deepspeed_shm():
    """DeepSpeed's CPU all-reduce op leaves two buffers of up to 66 MiB in /dev/shm per process group and unlinks
    none. A supervised launch releases its own (tasks/train/supervise.release_shm); a test that starts engines
    itself (torch.multiprocessing ranks, an in-process engine) would leave them behind: 3.3 GB after a day of
    test runs here. So a test's new buffers that no live process maps are removed after it."""
    before = deepspeed_shm()
    yield
    release_new_deepspeed_shm(before)
