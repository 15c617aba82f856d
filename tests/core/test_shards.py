"""Sharded data stages: resumable shard by shard, byte-identical whatever the crash or the worker count.

The library-level tests crash a stage between shards and check what the rerun rebuilds. The flow-level test
SIGKILLs the real `lifecycle run` process group (flow process and its Dask workers) during each data stage in
turn, reruns it, and compares every manifest with an uninterrupted run that had a different number of Dask
workers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pytest

from lifecycle.core.dataset import StageStats

from lifecycle.core.shards import (
    SHARD_MARKER, PerFileStage, commit_plan, group_files, map_tables, plan_stage, resolve, run_plan, run_shard,
    warm_worker,
)
from lifecycle.tasks.data.collect.stage import CollectConfig, plan_collect, resolve_inputs, shard_inputs
from lifecycle.tasks.data.filter.stage import STAGE as FILTER, FilterConfig
from tests.conftest import ROOT, corpus_records, last_json, lifecycle, make_collect


def write_inputs(d: Path, files: int, per_file: int) -> list[str]:
    """`files` JSONL files of real documentation sections, every document distinct."""
    recs = corpus_records(files * per_file)
    d.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        with open(d / f"part-{k:02d}.jsonl", "w") as f:
            for r in recs[k * per_file:(k + 1) * per_file]:
                f.write(json.dumps(r) + "\n")
    return [str(d / "*.jsonl")]


def test_shard_inputs_groups_files_in_order():
    from lifecycle.core.dataset import RawFile

    raws = [RawFile(path=f"f{i}", sha256="x", bytes=b) for i, b in enumerate([5, 5, 20, 1, 1, 1])]
    assert shard_inputs(raws, 10) == [["f0", "f1"], ["f2"], ["f3", "f4", "f5"]]
    assert shard_inputs(raws, 1) == [[r.path] for r in raws]
    assert shard_inputs([], 10) == []


def test_small_input_still_makes_min_shards(tmp_path):
    """A 24 MB corpus is not one shard (issue 25: one worker did all the work): `min_shards` caps the shard size at
    1/min_shards of the input, down to 256 KiB; uncompressed JSONL is split by that size too."""
    from lifecycle.core.dataset import RawFile
    from lifecycle.tasks.data.collect.stage import MIN_SHARD_BYTES

    mib = 1 << 20
    raws = [RawFile(path=f"f{i}.jsonl.gz", sha256="x", bytes=b) for i, b in enumerate([mib] * 8)]
    assert shard_inputs(raws, 8 * mib, 64 * mib, min_shards=8) == [[r.path] for r in raws]
    assert shard_inputs(raws, 8 * mib, 64 * mib, min_shards=2) == [[r.path for r in raws[:4]], [r.path for r in raws[4:]]]
    assert shard_inputs(raws, 8 * mib, 64 * mib, min_shards=1) == [[r.path for r in raws]]
    tiny = [RawFile(path=f"t{i}.jsonl.gz", sha256="x", bytes=1000) for i in range(8)]
    assert shard_inputs(tiny, 8 * mib, 64 * mib, min_shards=8) == [[r.path for r in tiny]]  # the 256 KiB floor
    big = tmp_path / "one.jsonl"
    line = b'{"text": "' + b"x" * 1000 + b'"}\n'
    big.write_bytes(line * (4 * MIN_SHARD_BYTES // len(line)))
    raw = RawFile(path=str(big), sha256="x", bytes=big.stat().st_size)
    parts = shard_inputs([raw], 8 * mib, 64 * mib, min_shards=4)
    assert len(parts) in (4, 5) and all(len(p) == 1 for p in parts)
    assert shard_inputs([raw], 8 * mib, 0, min_shards=4) == [[str(big)]]  # split_bytes=0: never split


def test_collect_committed_says_whether_collect_has_work(tmp_path):
    """The flow starts its Dask workers before collect only when collect will compute (not on a rerun)."""
    from lifecycle.tasks.data.collect.stage import collect_committed

    inputs = resolve_inputs(write_inputs(tmp_path / "in", files=2, per_file=5))
    cfg = CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")])
    wd = str(tmp_path / "w")
    assert not collect_committed(cfg, wd, inputs)
    run_plan(plan_collect(cfg, wd, inputs))
    assert collect_committed(cfg, wd, inputs)
    assert not collect_committed(cfg.model_copy(update={"max_json_depth": 9}), wd, inputs)  # another config


def test_crash_between_shards_rebuilds_only_unfinished(tmp_path):
    inputs = resolve_inputs(write_inputs(tmp_path / "in", files=4, per_file=30))
    cfg = CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")], shard_bytes=1, rows_per_shard=10)
    reference = run_plan(plan_collect(cfg, str(tmp_path / "ref"), inputs))

    wd = str(tmp_path / "w")
    plan = plan_collect(cfg, wd, inputs)
    assert len(plan.shards) == 4
    run_shard(plan, 0)
    run_shard(plan, 2)
    # a crash inside shard 1: its private directory is left half-written
    (plan.building / ".tmp-shard-00001-deadbeef").mkdir()
    (plan.building / ".tmp-shard-00001-deadbeef" / "part-00000.parquet").write_bytes(b"torn")
    with pytest.raises(RuntimeError, match=r"shards \[1, 3\] of 4 are not finished"):
        commit_plan(plan)
    before = {i: (plan.shard_dir(i) / SHARD_MARKER).stat().st_mtime_ns for i in (0, 2)}

    again = plan_collect(cfg, wd, inputs)  # the rerun plans the same fingerprint and keeps finished shards
    assert again.fingerprint == plan.fingerprint and again.done_shards() == [0, 2]
    assert not list(again.building.glob(".tmp-*"))  # the torn leftover is gone
    assert [run_shard(again, i)["reused"] for i in range(4)] == [True, False, True, False]
    assert {i: (again.shard_dir(i) / SHARD_MARKER).stat().st_mtime_ns for i in (0, 2)} == before
    ref = commit_plan(again)
    assert ref.sha256 == reference.sha256
    assert [(f["path"], f["sha256"]) for f in ref.manifest()["files"]] == \
        [(f["path"], f["sha256"]) for f in reference.manifest()["files"]]
    assert ref.manifest()["stats"] == reference.manifest()["stats"] and ref.num_rows == 120
    assert not again.building.exists()  # the building directory became the dataset


def test_failing_shard_publishes_nothing(tmp_path):
    """A shard that raises leaves no marker and no files, so the next attempt starts it clean."""
    parent = make_collect(str(tmp_path), [pa.table({"text": ["a b c"]})], "one")
    plan = plan_stage(str(tmp_path), "boom", {"v": 1}, "c", _boom, [[str(p)] for p in parent.files()],
                      parents=[parent])
    with pytest.raises(ValueError, match="shard failed"):
        run_shard(plan, 0)
    assert plan.done_shards() == [] and list(plan.building.iterdir()) == []


def _boom(cfg, files, writer) -> StageStats:
    writer.write_table(pa.table({"x": [1]}))
    raise ValueError("shard failed")


WARMED: list = []


def _warm(cfg) -> None:
    WARMED.append(cfg)


def _copy(cfg, files, writer) -> StageStats:
    return map_tables(files, writer, lambda t: (t, t.slice(0, 0), StageStats(rows_in=t.num_rows, rows_kept=t.num_rows)))


def test_the_warm_up_comes_from_the_stage_object(tmp_path):
    """A per-file stage object's plan carries its shard and warm-up functions by name (shard workers import them);
    `warm_worker` runs the warm-up once per plan in a process, found through the plan, not by a module-level name;
    a function a worker could not import by name is refused when the plan is made."""
    parent = make_collect(str(tmp_path), [pa.table({"text": ["a b c"]}), pa.table({"text": ["d e"]})], "two")
    stage = PerFileStage("copy", "lifecycle.core", _copy, warm=_warm, grouped=False)
    plan = stage.plan(parent, {"v": 1}, str(tmp_path))
    assert (resolve(plan.shard_fn), resolve(plan.warm_fn)) == (_copy, _warm)
    assert plan.shards == [[str(p)] for p in parent.files()]
    WARMED.clear()
    warm_worker(plan)
    warm_worker(plan)
    assert WARMED == [{"v": 1}]
    assert stage.run(parent, {"v": 1}, str(tmp_path)).num_rows == 2
    assert FILTER.plan(parent, FilterConfig(), str(tmp_path)).warm_fn == "lifecycle.tasks.data.filter.stage:warm_filter"
    with pytest.raises(TypeError, match="not a module-level function"):
        PerFileStage("nope", "lifecycle.core", lambda cfg, files, writer: StageStats()).plan(parent, {}, str(tmp_path))


def test_filter_plan_groups_small_parent_files(tmp_path, monkeypatch):
    """A per-file stage's shard is one parent file, or consecutive small ones up to 1 MiB together (a shard costs
    a task and a process: more than filtering 15 documents)."""
    import lifecycle.core.shards as shards

    inputs = resolve_inputs(write_inputs(tmp_path / "in", files=3, per_file=10))
    cfg = CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")], shard_bytes=1, rows_per_shard=4)
    collect = run_plan(plan_collect(cfg, str(tmp_path), inputs))
    files = [str(p) for p in collect.files()]
    assert len(files) == 9  # 3 files x ceil(10/4)
    assert FILTER.plan(collect, FilterConfig(), str(tmp_path)).shards == [files]  # 9 small files: one shard
    sizes = [(f, os.path.getsize(f)) for f in files]
    assert group_files(sizes, 1) == [[f] for f in files]
    two = sizes[0][1] + sizes[1][1]
    assert group_files(sizes[:3], two) == [files[:2], files[2:3]]  # up to the size, in order
    monkeypatch.setattr(shards, "PER_FILE_SHARD_BYTES", 1)
    plan = FILTER.plan(collect, FilterConfig(), str(tmp_path))
    assert plan.shards == [[f] for f in files]
    filtered = run_plan(plan)
    assert FILTER.plan(collect, FilterConfig(), str(tmp_path)) == filtered.model_copy(update={"reused": True})


def test_dedup_signatures_resume_only_unfinished_shards(tmp_path, monkeypatch):
    """dedup's costly half (signatures) is sharded per parent file: after a crash the rerun hashes only the
    documents of unfinished shards, and the dedup dataset equals an uninterrupted run's."""
    from lifecycle.tasks.data.dedup import minhash
    from lifecycle.tasks.data.dedup.stage import SIGNATURES, DedupConfig, run_dedup

    import lifecycle.core.shards as shards

    monkeypatch.setattr(shards, "PER_FILE_SHARD_BYTES", 1)  # one shard per parent file
    inputs = resolve_inputs(write_inputs(tmp_path / "in", files=3, per_file=20))
    ccfg = CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")], shard_bytes=1, rows_per_shard=10)
    cfg = DedupConfig(incremental=False)
    parent = run_plan(plan_collect(ccfg, str(tmp_path / "ref"), inputs))
    reference = run_dedup(parent, cfg, str(tmp_path / "ref"))

    wd = str(tmp_path / "w")
    plan = SIGNATURES.plan(parent, cfg, wd)
    assert plan.shards == [[str(p)] for p in parent.files()] and len(plan.shards) == 6
    run_shard(plan, 0)
    run_shard(plan, 3)
    before = {i: (plan.shard_dir(i) / SHARD_MARKER).stat().st_mtime_ns for i in (0, 3)}
    hashed = []
    real = minhash.signatures
    monkeypatch.setattr(minhash, "signatures", lambda t, *a, **k: hashed.extend(pa.array(t).to_pylist()) or real(t, *a, **k))
    again = SIGNATURES.plan(parent, cfg, wd)  # the rerun
    assert again.fingerprint == plan.fingerprint and again.done_shards() == [0, 3]
    sigs = run_plan(again)
    # the finished shards were kept as they were (the building directory became the dataset)
    assert {i: (sigs.dir / again.shard_dir(i).name / SHARD_MARKER).stat().st_mtime_ns for i in (0, 3)} == before
    assert len(hashed) == 40  # 4 unfinished shards x 10 documents; the 20 of shards 0 and 3 were not hashed again
    ref = run_dedup(parent, cfg, wd, signatures=sigs)
    assert ref.sha256 == reference.sha256 and ref.manifest()["stats"] == reference.manifest()["stats"]
    assert ref.manifest()["signatures"]["sha256"] == sigs.sha256 == \
        json.loads(open(reference.manifest()["signatures"]["manifest"]).read())["sha256"]


# --------------------------------------------------------------------------------------------------
# the real flow process, killed during each data stage

DATA_STAGES = ("collect", "filter", "dedup", "scrub")


def run_args(workdir: Path, inputs: list[str], workers: int) -> list[str]:
    return ["run", str(ROOT / "deploy/configs/demo.yaml"), "--json", "--until", "scrub", "--set", f"workdir={workdir}", "--set", f"collect.inputs={json.dumps(inputs)}",
            "--set", "collect.shard_bytes=1", "--set", "collect.rows_per_shard=15",
            "--set", f"orchestration.dask_workers={workers}", "--set", "orchestration.retry_backoff_s=0.1"]


def in_progress(workdir: Path, stage: str) -> bool:
    """The stage has started writing and has not committed: a published shard (dedup: of its signatures)."""
    d = workdir / "datasets" / ("dedup-signatures" if stage == "dedup" else stage)
    return any(d.glob(f".building-*/shard-*/{SHARD_MARKER}"))


def run_and_kill_during(workdir: Path, inputs: list[str], stage: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "lifecycle.cli", *run_args(workdir, inputs, 2)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.time() + 300
        while not in_progress(workdir, stage):
            assert proc.poll() is None, f"run ended before {stage} started:\n{proc.stdout.read().decode()[-3000:]}"
            assert time.time() < deadline, f"{stage} did not start"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.stdout.close()
    committed = [p.parent.name for p in (workdir / "datasets" / stage).glob("*/_manifest.json")]
    assert committed == [], f"the kill came after {stage} had committed"


@pytest.mark.slow  # minutes on 2 cores (CI stays under 30 min)
def test_sigkill_during_each_data_stage_then_rerun_is_identical(tmp_path):
    inputs = write_inputs(tmp_path / "in", files=6, per_file=40)
    # the uninterrupted reference runs with 1 Dask worker; the killed-and-resumed runs use 2
    ref = last_json(lifecycle(*run_args(tmp_path / "ref", inputs, 1)).stdout)
    assert ref["stages"] == {s: "computed" for s in DATA_STAGES}

    wd = tmp_path / "w"
    for stage in DATA_STAGES:
        run_and_kill_during(wd, inputs, stage)
    out = last_json(lifecycle(*run_args(wd, inputs, 2)).stdout)
    # every stage before the last one killed was finished by an earlier resumed run; scrub resumes now
    assert out["stages"]["collect"] == out["stages"]["filter"] == "reused"
    assert out["stages"]["dedup"] == "reused"
    assert out["stages"]["scrub"] == "resumed", out["stages"]

    for stage in DATA_STAGES:
        a = json.loads(Path(ref["datasets"][stage]).read_text())
        b = json.loads(Path(out["datasets"][stage]).read_text())
        assert b["sha256"] == a["sha256"], stage
        for kind in ("files", "rejected", "extra"):
            assert [(e["path"], e["sha256"]) for e in b[kind]] == [(e["path"], e["sha256"]) for e in a[kind]]
        assert b["stats"] == a["stats"], stage
    assert not list((wd / "datasets").glob("*/.building-*")) and not list((wd / "datasets").glob("*/.tmp-*"))


def test_shards_run_on_a_dask_cluster_given_by_address(tmp_path):
    """`orchestration.dask_address`: the shards run on an existing cluster's workers (here a LocalCluster
    started by the test, as `dask scheduler` + `dask worker` would be), and the result equals a serial run."""
    from distributed import Client, LocalCluster

    inputs = write_inputs(tmp_path / "in", files=3, per_file=20)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1",
                      dashboard_address=None) as cluster, Client(cluster) as client:
        args = run_args(tmp_path / "w", inputs, 0)[:-4]  # drop the worker count: the address decides
        args += ["--set", f"orchestration.dask_address={cluster.scheduler_address}", "--until", "filter"]
        proc = lifecycle(*args)
        # the cluster's workers ran the tasks (Dask logs every task transition on the worker that ran it)
        ran = client.run(lambda dask_worker: len({str(e[0]) for e in dask_worker.state.log}))
    out = last_json(proc.stdout)
    collect = json.loads(open(out["datasets"]["collect"]).read())
    assert collect["shards"] == 3 and sum(ran.values()) >= 3, ran  # 3 collect shards + the filter shards
    ref = last_json(lifecycle(*run_args(tmp_path / "s", inputs, 0), "--until", "filter").stdout)
    for stage in ("collect", "filter"):
        assert json.loads(open(out["datasets"][stage]).read())["sha256"] == \
            json.loads(open(ref["datasets"][stage]).read())["sha256"]


def test_a_large_jsonl_file_is_split_at_line_boundaries(tmp_path):
    """One big uncompressed JSONL file becomes several shards (byte ranges starting at line starts); the rows,
    source ids (path:line), quarantined bad lines and stats are those of reading the file whole."""
    from lifecycle.tasks.data.collect.stage import parse_item, split_file

    recs = [json.dumps(r) for r in corpus_records(60)]
    lines = recs[:10] + ["not json", "", "   "] + recs[10:30] + ['{"text": 5}', "\ufffe" * 3] + recs[30:] + [""]
    big = tmp_path / "in" / "big.jsonl"
    big.parent.mkdir()
    big.write_text("\n".join(lines) + "\n")
    size = big.stat().st_size
    parts = split_file(str(big), size // 5)
    assert len(parts) >= 4 and parts[0].start == 0 and parts[-1].end == size
    assert all(a.end == b.start for a, b in zip(parts, parts[1:]))
    data = big.read_bytes()
    for p in parts:  # every range starts at a line start and knows its line number
        assert p.start == 0 or data[p.start - 1 : p.start] == b"\n"
        assert data[: p.start].count(b"\n") + 1 == p.first_line
    assert split_file(str(big), size // 5, chunk=7) == parts  # ranges found across read chunks alike
    assert split_file(str(big), size * 2) == [parts[0].model_copy(update={"end": size})]
    assert len(plan_collect(CollectConfig(inputs=[str(big)], split_bytes=0), str(tmp_path / "n")).shards) == 1

    whole = run_plan(plan_collect(CollectConfig(inputs=[str(big)]), str(tmp_path / "whole")))
    cfg = CollectConfig(inputs=[str(big)], split_bytes=size // 5)
    plan = plan_collect(cfg, str(tmp_path / "split"))
    assert len(plan.shards) == len(parts) and all(parse_item(s[0])[1] is not None for s in plan.shards)
    split = run_plan(plan)
    cols = ["doc_id", "source_id", "text"]
    assert split.read(columns=cols).to_pylist() == whole.read(columns=cols).to_pylist()
    key = lambda t: sorted((r["source_id"], r["reason"], r["detail"]) for r in t.to_pylist())
    assert key(split.read_rejected()) == key(whole.read_rejected())
    assert {r["reason"] for r in whole.read_rejected().to_pylist()} >= {"invalid_json", "text_not_string"}
    a, b = split.manifest()["stats"], whole.manifest()["stats"]
    assert a == b and a["rows_in"] == 63 and a["rows_kept"] == 60  # 3 bad lines quarantined


FORK_COPY = r"""
import gc, os, sys
from lifecycle.core.shards import freeze_heap
heap = [{"k": i, "v": [i]} for i in range(300_000)]  # ~80 MB of small objects, as a warmed pool worker holds
if sys.argv[1] == "freeze":
    freeze_heap()
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # the shard process: one full collection, as any allocation-heavy shard triggers
    gc.collect()
    private = sum(int(line.split()[1]) for line in open("/proc/self/smaps_rollup")
                  if line.startswith(("Private_Dirty", "Private_Clean")))
    os.write(w, str(private).encode())
    os._exit(0)
os.close(w)
os.waitpid(pid, 0)
print(os.read(r, 100).decode())
"""


def test_a_forked_shard_process_does_not_copy_its_parents_heap_when_it_collects():
    """run_shard_watched forks each shard from a pool worker that holds the stage's models; `freeze_heap` before
    the fork keeps the child's garbage collections off the inherited objects, whose headers a collection would
    write and so copy page by page (~80 MB here without the freeze)."""
    kb = {mode: int(subprocess.run([sys.executable, "-c", FORK_COPY, mode], capture_output=True, text=True,
                                   check=True).stdout) for mode in ("plain", "freeze")}
    assert kb["plain"] > 40_000, kb  # the copy this guards against is real on this interpreter
    assert kb["freeze"] < kb["plain"] / 4, kb


def test_a_process_that_froze_its_heap_exits_without_nanobind_leak_reports():
    """A frozen object is never freed; DuckDB's bindings (nanobind) reported each of theirs as "leaked" on stderr
    when a process that had frozen its heap exited (the forkserver's preload freezes it): ~40 lines of
    "nanobind: leaked ... reference counting issue" at the end of every run's log. freeze_heap unfreezes at exit."""
    code = "import duckdb\nfrom lifecycle.core.shards import freeze_heap\nduckdb.sql('select 1').fetchall()\nfreeze_heap()\n"
    plain = subprocess.run([sys.executable, "-c", code.replace("from lifecycle.core.shards import freeze_heap",
                                                               "import gc\nfreeze_heap = gc.freeze")],
                           capture_output=True, text=True, check=True)
    assert "nanobind: leaked" in plain.stderr  # what a bare gc.freeze() does with this DuckDB
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stderr == ""
