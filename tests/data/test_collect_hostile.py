"""Hostile inputs to collect: a decompression bomb stays under `collect.max_memory_bytes`, file names that are not
UTF-8 (or hold a newline) are collected with their raw bytes recoverable, and a symlink loop under `**` collects each
file once."""

from __future__ import annotations

import glob
import gzip
import json
import os
import subprocess
import sys
import textwrap

import pytest

from lifecycle.config import ConfigError, validate_config
from lifecycle.tasks.data.collect.inputs import raw_name, walk_glob
from lifecycle.tasks.data.collect.stage import CollectConfig, resolve_inputs, run_collect
from tests.conftest import ROOT

MiB = 1 << 20


def test_decompression_bomb_stays_under_the_memory_bound(tmp_path):
    """400 lines of 1 MiB (400 MiB of text) in an 820 KB `.jsonl.gz`. Held whole, as before parts were cut by bytes,
    the shard peaked at 1.24 GB; with a 300 MiB bound it must stay under it, and every line is kept."""
    line = (json.dumps({"text": "lorem ipsum " * (MiB // 12)}) + "\n").encode()
    member = gzip.compress(line)  # gzip members concatenate into one valid stream
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "bomb.jsonl.gz", "wb") as f:
        for _ in range(400):
            f.write(member)
    assert os.path.getsize(tmp_path / "in" / "bomb.jsonl.gz") < 1_000_000
    bound = 300 * MiB
    script = textwrap.dedent(f"""
        import json, re
        from lifecycle.tasks.data.collect.stage import CollectConfig, run_collect
        cfg = CollectConfig(inputs=[{str(tmp_path / 'in' / '*.jsonl.gz')!r}], max_memory_bytes={bound},
                            max_line_bytes=2 << 20, max_doc_bytes=2 << 20)
        ref = run_collect(cfg, {str(tmp_path / 'w')!r})
        m = ref.manifest()
        # VmHWM: this process image's peak RSS (ru_maxrss would carry the forking parent's peak across exec)
        peak = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024
        print(json.dumps({{"peak": peak, "stats": m["stats"],
                          "parts": len(m["files"]), "rows": ref.num_rows}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["peak"] < bound, f"peak RSS {got['peak'] / MiB:.0f} MiB >= bound {bound / MiB:.0f} MiB"
    assert got["rows"] == 400 and got["stats"]["rows_in"] == 400 and got["stats"]["rows_rejected"] == 0
    assert got["parts"] > 1  # cut by bytes: 400 rows are far below rows_per_shard


def test_over_long_line_is_quarantined_naming_file_and_line(tmp_path):
    p = tmp_path / "a.jsonl.gz"
    with gzip.open(p, "wt") as f:
        f.write(json.dumps({"text": "ok"}) + "\n" + json.dumps({"text": "x" * (3 * MiB)}) + "\n"
                + json.dumps({"text": "after"}) + "\n")
    ref = run_collect(CollectConfig(inputs=[str(p)], max_line_bytes=2 * MiB, max_doc_bytes=2 * MiB),
                      str(tmp_path / "w"))
    assert ref.read().column("text").to_pylist() == ["ok", "after"]
    (rej,) = ref.read_rejected().to_pylist()
    assert rej["reason"] == "too_large" and rej["source_id"] == f"{p}:2" and "line 2" in rej["detail"]


def test_memory_bound_must_hold_a_line():
    with pytest.raises(ConfigError, match="max_memory_bytes .* must be >= 192 MiB \\+ 12 x max_line_bytes"):
        validate_config({"collect": {"inputs": ["x"], "max_memory_bytes": 300 * MiB}})


def test_file_names_that_are_not_utf8_or_hold_a_newline_are_collected(tmp_path):
    d = os.fsencode(tmp_path / "in")
    os.mkdir(d)
    names = {b"caf\xe9.jsonl": "latin-1", b"new\nline.jsonl": "newline", b"plain.jsonl": "plain"}
    for name, text in names.items():
        with open(os.path.join(d, name), "wb") as f:
            f.write(json.dumps({"text": f"a {text} document"}).encode() + b"\n" + b"{bad json\n")
    ref = run_collect(CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")]), str(tmp_path / "w"))
    rows = ref.read().to_pylist()
    assert sorted(r["text"] for r in rows) == ["a latin-1 document", "a newline document", "a plain document"]
    latin = next(r for r in rows if "latin-1" in r["text"])
    escaped = f"{tmp_path}/in/caf\\xe9.jsonl"  # the stored name: the bad byte as the text `\xe9`
    assert latin["source"] == escaped and latin["source_id"] == f"{escaped}:1"
    assert any(r["source"] == f"{tmp_path}/in/new\nline.jsonl" for r in rows)
    rejected = ref.read_rejected().to_pylist()  # bad records in such files are quarantined like any other
    assert sorted(r["source_id"] for r in rejected) == sorted(
        [f"{escaped}:2", f"{tmp_path}/in/new\nline.jsonl:2", f"{tmp_path}/in/plain.jsonl:2"])
    inputs = {r["path"]: r for r in ref.manifest()["inputs"]}
    assert "path_bytes" not in inputs[f"{tmp_path}/in/plain.jsonl"]
    raw = inputs[escaped]  # the raw bytes are recoverable from the manifest
    assert bytes.fromhex(raw["path_bytes"]) == os.path.join(d, b"caf\xe9.jsonl")
    assert os.path.exists(raw_name(raw["path"], raw["path_bytes"]))


def test_a_split_file_whose_name_is_not_utf8_is_collected_whole(tmp_path):
    d = os.fsencode(tmp_path)
    with open(os.path.join(d, b"gro\xdf.jsonl"), "wb") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"document {i}"}).encode() + b"\n")
    cfg = CollectConfig(inputs=[str(tmp_path / "*.jsonl")], split_bytes=100)  # about 4 lines a shard
    ref = run_collect(cfg, str(tmp_path / "w"))
    assert ref.manifest()["shards"] > 1
    rows = ref.read().to_pylist()
    assert [r["text"] for r in rows] == [f"document {i}" for i in range(20)]
    assert [r["source_id"] for r in rows] == [f"{tmp_path}/gro\\xdf.jsonl:{i + 1}" for i in range(20)]


def test_symlink_loops_under_a_double_star_collect_each_file_once(tmp_path):
    d = tmp_path / "in"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text('{"text": "a"}\n')
    (d / "sub" / "b.jsonl").write_text('{"text": "b"}\n')
    os.symlink("..", d / "sub" / "up")  # a loop
    os.symlink(".", d / "self")  # a second loop: glob would spell each file 2**40 ways
    os.symlink("a.jsonl", d / "alias.jsonl")  # a second name for one file
    pattern = str(d / "**" / "*.jsonl")
    assert [r.path for r in resolve_inputs([pattern])] == [str(d / "a.jsonl"), str(d / "sub" / "b.jsonl")]
    ref = run_collect(CollectConfig(inputs=[pattern, str(d / "*.jsonl")]), str(tmp_path / "w"))
    assert sorted(ref.read().column("text").to_pylist()) == ["a", "b"]


@pytest.mark.parametrize("pattern", ["**/*.jsonl", "**", "*/*.jsonl", "**/b.jsonl", "sub/**/*", "**/.h/*",
                                     "**/[ab].jsonl", "sub//**/*.jsonl"])
def test_walk_glob_matches_glob_without_loops(tmp_path, pattern, monkeypatch):
    """Same files, same spellings as `glob.glob(recursive=True)`, hidden names included (relative and absolute)."""
    root = tmp_path / "t"
    for rel in ["a.jsonl", "sub/b.jsonl", "sub/deep/c.jsonl", "sub/.h/d.jsonl", ".h/e.jsonl", "sub/.f.jsonl", "x.txt",
                "../o/f.jsonl"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("{}")
    os.symlink("../o", root / "sub" / "ext")  # a symlinked directory (no loop, no twin) is followed, as glob does
    monkeypatch.chdir(root)
    for pat in (pattern, f"{root}/{pattern}"):
        expected = sorted(p for p in glob.glob(pat, recursive=True) if os.path.isfile(p))
        assert walk_glob(pat) == expected, pat
