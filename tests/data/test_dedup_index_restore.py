"""A damaged or missing dedup-index part is restored from the committed dataset it was copied from (issue 44, 6:
8c6205f failed every rerun until a person acted, although the dataset held a good copy)."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
from lifecycle.core.fs import sha256_file
from lifecycle.tasks.data.dedup.restore import INDEX_FILE, restore_parts


def _published(tmp_path):
    dataset = tmp_path / "datasets" / "dedup" / "abc"
    dataset.mkdir(parents=True)
    pq.write_table(pa.table({"doc_id": ["d1", "d2"], "exact_hash": [1, 2]}), dataset / INDEX_FILE)
    directory = tmp_path / "dedup-index" / "0123456789abcdef"
    directory.mkdir(parents=True)
    (directory / "part-00000.parquet").write_bytes((dataset / INDEX_FILE).read_bytes())
    parts = [{"path": "part-00000.parquet", "sha256": sha256_file(dataset / INDEX_FILE), "num_rows": 2,
              "dataset": "abc", "dataset_path": str(dataset)}]
    (directory / "_index.json").write_text(json.dumps({"parts": parts}))
    return dataset, directory, parts


def test_a_damaged_part_is_restored_from_its_dataset(tmp_path, caplog):
    dataset, directory, parts = _published(tmp_path)
    part = directory / "part-00000.parquet"
    data = bytearray(part.read_bytes())
    data[20] ^= 0xFF
    part.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="lifecycle"):
        assert restore_parts(directory, parts) == [part]
    assert part.read_bytes() == (dataset / INDEX_FILE).read_bytes() and pq.read_table(part).num_rows == 2
    assert f"dedup index part {part} was damaged" in caplog.text and str(dataset / INDEX_FILE) in caplog.text
    assert len(list((tmp_path / "damaged" / "dedup-index" / directory.name).iterdir())) == 1  # moved, not deleted
    assert restore_parts(directory, parts) == []  # good now: nothing to do
    part.unlink()
    assert restore_parts(directory, parts) == [part] and sha256_file(part) == parts[0]["sha256"]  # a missing one


def test_a_part_whose_dataset_copy_is_damaged_too_is_left_alone(tmp_path):
    dataset, directory, parts = _published(tmp_path)
    for f in (directory / "part-00000.parquet", dataset / INDEX_FILE):
        f.write_bytes(b"not parquet")
    assert restore_parts(directory, parts) == []  # Index then refuses it, naming the file
    assert (directory / "part-00000.parquet").read_bytes() == b"not parquet"
