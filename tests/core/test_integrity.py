"""Nothing on disk is trusted because it exists: a committed dataset is reused only when its files match its
manifest, damage found on a read names the file, and a damaged dataset is moved aside and rebuilt."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lifecycle.core.dataset import (

    DAMAGED_DIR, MANIFEST, DatasetDamaged, DatasetRef, StageStats, materialize, read_parquet, verify_dataset,

)

from lifecycle.core.shards import run_plan
from lifecycle.tasks.data.collect.stage import CollectConfig, plan_collect, resolve_inputs
from lifecycle.tasks.data.scrub.stage import STAGE as SCRUB, ScrubConfig
from tests.core.test_shards import write_inputs


def flip(path: Path, n: int = 64, at: float = 0.5) -> None:
    """Invert `n` bytes in the middle of a file, size unchanged (bit rot, a bad disk, a stray write)."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + n] = bytes(b ^ 0xFF for b in data[start:start + n])
    path.write_bytes(bytes(data))


def table(n: int, tag: str = "x") -> pa.Table:
    return pa.table({"doc_id": [f"{tag}{i}" for i in range(n)], "text": [f"document {i} " * 40 for i in range(n)]})


def build_count(workdir, calls: list, tables=(200, 150)):
    def build(writer):
        calls.append(1)
        for i, n in enumerate(tables):
            writer.write_table(table(n, f"t{i}-"))
        return {"stats": StageStats(rows_in=sum(tables), rows_kept=sum(tables))}

    return materialize(workdir, "demo", {"k": 1}, "code", build)


def damaged_dirs(workdir, stage="demo") -> list[Path]:
    return sorted((Path(workdir) / DAMAGED_DIR / stage).glob("*"))


def test_clean_reuse_does_not_rebuild(tmp_path):
    calls = []
    first = build_count(tmp_path, calls)
    again = build_count(tmp_path, calls)
    assert calls == [1] and again.reused and again.sha256 == first.sha256
    assert verify_dataset(first.dir) == []


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest_truncated", "manifest_garbage"])
def test_damaged_dataset_is_moved_aside_and_rebuilt(tmp_path, caplog, damage):
    calls = []
    first = build_count(tmp_path, calls)
    part = first.files()[1]
    if damage == "flip":  # same size: only the sha256 tells
        flip(part)
        culprit, what = part, "sha256"
    elif damage == "truncate":
        part.write_bytes(part.read_bytes()[:-100])
        culprit, what = part, "bytes"
    elif damage == "delete":
        part.unlink()
        culprit, what = part, "missing"
    elif damage == "manifest_truncated":
        text = first.manifest_path.read_text()
        first.manifest_path.write_text(text[: len(text) // 2])
        culprit, what = first.manifest_path, "unreadable manifest"
    else:
        first.manifest_path.write_text('["not a manifest"]')
        culprit, what = first.manifest_path, "invalid manifest"
    with caplog.at_level(logging.WARNING, logger="lifecycle.core.dataset"):
        again = build_count(tmp_path, calls)
    assert calls == [1, 1] and not again.reused  # rebuilt
    assert again.sha256 == first.sha256 and again.dir == first.dir  # the same bytes, where they were
    assert verify_dataset(again.dir) == []
    warning = caplog.text
    assert str(culprit) in warning and what in warning and "moved it aside" in warning
    [aside] = damaged_dirs(tmp_path)  # nothing is lost
    assert aside.name.startswith(first.dir.name + "-") and (aside / MANIFEST).exists()
    assert build_count(tmp_path, calls).reused and calls == [1, 1]  # and the rebuilt one is trusted


def test_a_write_with_mtime_put_back_is_still_caught(tmp_path):
    """Reuse skips re-hashing only a file whose (size, mtime, ctime, inode) is what it was when its sha256 last
    matched; a write changes ctime even when the writer restores mtime."""
    calls = []
    first = build_count(tmp_path, calls)
    build_count(tmp_path, calls)  # records the verified signatures
    part = first.files()[0]
    st = part.stat()
    flip(part)
    os.utime(part, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = build_count(tmp_path, calls)
    assert calls == [1, 1] and not again.reused and len(damaged_dirs(tmp_path)) == 1


def test_edited_manifest_entry_is_caught(tmp_path):
    """A manifest whose file list was edited (a sha256 changed to match damaged bytes) no longer matches the
    content sha256 that children and MLflow recorded."""
    first = build_count(tmp_path, [])
    m = json.loads(first.manifest_path.read_text())
    m["files"][0]["sha256"] = "0" * 64
    first.manifest_path.write_text(json.dumps(m))
    [problem] = verify_dataset(first.dir)
    assert str(first.manifest_path) in problem and "file list's sha256" in problem


def test_read_hashes_what_it_reads_and_names_the_file(tmp_path):
    first = build_count(tmp_path, [])
    assert first.read().num_rows == 350
    part = first.files()[0]
    flip(part)
    with pytest.raises(DatasetDamaged, match="sha256") as e:
        first.read()
    assert e.value.path == part and str(first.dir) in str(e.value)
    with pytest.raises(DatasetDamaged, match=str(part)):
        read_parquet(part)
    # the reuse check of the next run hashes it again (its verified record is gone), moves it aside, rebuilds
    calls = []
    assert not build_count(tmp_path, calls).reused and calls == [1]


def test_unreadable_manifest_names_the_file(tmp_path):
    first = build_count(tmp_path, [])
    first.manifest_path.write_text(first.manifest_path.read_text()[:100])
    with pytest.raises(DatasetDamaged, match=f"{first.manifest_path}: unreadable manifest"):
        DatasetRef.from_dir(first.dir)
    with pytest.raises(DatasetDamaged, match=str(first.manifest_path)):
        first.files()


def test_parquet_pages_carry_checksums(tmp_path):
    """Files outside a committed dataset (no manifest hash to compare) are still checked page by page."""
    first = build_count(tmp_path, [])
    loose = tmp_path / "loose.parquet"
    loose.write_bytes(first.files()[0].read_bytes())
    assert pq.ParquetFile(loose).metadata.row_group(0).num_rows == 200
    assert read_parquet(loose).num_rows == 200
    flip(loose, at=0.3)
    with pytest.raises(DatasetDamaged, match=f"{loose}: unreadable Parquet"):
        read_parquet(loose)


def test_flipped_parts_of_real_stages_are_rebuilt(tmp_path, caplog):
    """The adversarial case: 64 flipped bytes in a committed collect part and a committed scrub part. The rerun
    of each stage function warns naming the file, moves the dataset aside and rebuilds the same bytes."""
    inputs = resolve_inputs(write_inputs(tmp_path / "in", files=2, per_file=20))
    wd = str(tmp_path / "w")
    ccfg = CollectConfig(inputs=[str(tmp_path / "in" / "*.jsonl")], shard_bytes=1)
    docs = run_plan(plan_collect(ccfg, wd, inputs))
    clean = run_plan(SCRUB.plan(docs, ScrubConfig(), wd))
    assert run_plan(plan_collect(ccfg, wd, inputs)).reused and run_plan(SCRUB.plan(docs, ScrubConfig(), wd)).reused
    for ref in (docs, clean):
        flip(ref.files()[0])
    with caplog.at_level(logging.WARNING, logger="lifecycle.core.dataset"):
        docs2 = run_plan(plan_collect(ccfg, wd, inputs))
        clean2 = run_plan(SCRUB.plan(docs2, ScrubConfig(), wd))
    assert not docs2.reused and not clean2.reused
    assert (docs2.sha256, clean2.sha256) == (docs.sha256, clean.sha256)
    for ref in (docs, clean):
        assert f"{ref.files()[0]}: sha256" in caplog.text
    assert len(damaged_dirs(wd, "collect")) == 1 and len(damaged_dirs(wd, "scrub")) == 1


def test_lifecycle_verify_exits_1_on_damage_and_0_when_clean(tmp_path, capsys):
    from lifecycle.cli import main
    from lifecycle.tasks.train import commit as ckpt

    wd = tmp_path / "w"
    first = build_count(wd, [])
    other = materialize(wd, "other", {}, "code", lambda w: w.write_table(table(30)) or {})
    tag = wd / "train" / "abc" / "checkpoints" / ckpt.tag_name(5)
    tag.mkdir(parents=True)
    (tag / "model.safetensors").write_bytes(os.urandom(4096))
    ckpt.commit(tag, 5)
    (wd / "train" / "abc" / "checkpoints" / ckpt.tag_name(9)).mkdir()  # uncommitted leftover: not an item
    assert main(["verify", "--workdir", str(wd)]) == 0
    out = capsys.readouterr().out
    assert "2 dataset(s), 1 checkpoint(s)" in out and "DAMAGED" not in out

    flip(first.files()[0])
    other.manifest_path.write_text(other.manifest_path.read_text()[:-40])
    flip(tag / "model.safetensors")
    assert main(["verify", "--workdir", str(wd), "--json"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    damaged = [line for line in lines if line.startswith("DAMAGED")]
    assert len(damaged) == 3
    assert f"DAMAGED dataset {first.dir}: {first.files()[0]}: sha256" in damaged[0]
    assert f"DAMAGED dataset {other.dir}: {other.manifest_path}: unreadable manifest" in damaged[1]
    assert f"DAMAGED checkpoint {tag}: model.safetensors: sha256 mismatch" in damaged[2]
    report = json.loads(lines[-1])
    assert [d["kind"] for d in report["damaged"]] == ["dataset", "dataset", "checkpoint"]
    # verify reports and moves nothing; the next reuse moves the damaged dataset aside and rebuilds it
    assert first.dir.exists() and not damaged_dirs(wd)
    assert not build_count(wd, []).reused
    assert main(["verify", "--workdir", str(wd)]) == 1  # the two others are still damaged
    assert capsys.readouterr().out.count("DAMAGED") == 2
