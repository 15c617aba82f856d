"""`<workdir>/latest/<stage>` points at the dataset of the last completed run (issue 24), and `lineage doc` prints
the directory name beside the content hash."""

from __future__ import annotations

import json
import os

from lifecycle.cli import main
from lifecycle.core.dataset import committed_datasets
from lifecycle.core.latest import latest_targets, point_latest
from tests.conftest import docs_table, make_collect


def test_latest_points_at_the_last_completed_runs_dataset(tmp_path):
    first = make_collect(tmp_path, [docs_table(["one"])], fixture="a")
    second = make_collect(tmp_path, [docs_table(["one", "two"])], fixture="b")
    point_latest(tmp_path, latest_targets({"collect": str(first.dir / "_manifest.json")}, None))
    assert (tmp_path / "latest" / "collect").resolve() == first.dir.resolve()
    ckpt = tmp_path / "train" / "r" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    links = point_latest(tmp_path, latest_targets({"collect": str(second.dir / "_manifest.json")}, str(ckpt)))
    assert (tmp_path / "latest" / "collect").resolve() == second.dir.resolve()
    assert (tmp_path / "latest" / "train").resolve() == ckpt.resolve()
    assert not os.path.isabs(os.readlink(links["collect"]))  # relative: the work dir can move
    assert sorted(p.name for p in (tmp_path / "latest").iterdir()) == ["collect", "train"]  # no temp links left
    assert len(committed_datasets(tmp_path)) == 2  # both fingerprint dirs stay; `latest` is not a dataset
    # a later run up to collect only (`--until collect`): latest/ shows that run alone, no train of the one before
    point_latest(tmp_path, latest_targets({"collect": str(first.dir / "_manifest.json")}, None), only=True)
    assert sorted(p.name for p in (tmp_path / "latest").iterdir()) == ["collect"]
    assert (tmp_path / "latest" / "collect").resolve() == first.dir.resolve()


def test_lineage_doc_prints_the_directory_name_and_the_hash(tmp_path, capsys):
    ref = make_collect(tmp_path, [docs_table(["one document"])])
    capsys.readouterr()
    assert main(["lineage", "doc", "d0", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"[datasets/collect/{ref.dir.name}, sha256 {ref.sha256[:12]}]" in out
    assert main(["lineage", "doc", "d0", "--workdir", str(tmp_path), "--json"]) == 0
    (event,) = json.loads(capsys.readouterr().out)["events"]
    assert event["dataset_dir"] == ref.dir.name and event["dataset_sha256"] == ref.sha256
