"""A manifest or training config the catalog cannot read is left out with one warning naming its file, once per
process (issue 44, 6: 8c6205f failed the whole update, and a run printed the same warning after each of its five
commits without the file)."""

import json
import logging

from lifecycle.lineage import catalog
from tests.conftest import make_collect
from tests.lineage.test_audit_catalog import docs


def test_an_unreadable_manifest_is_named_once_and_the_rest_catalogued(tmp_path, caplog):
    wd = tmp_path / "w"
    good = make_collect(str(wd), [docs("a")], fixture="good")
    bad = make_collect(str(wd), [docs("b")], fixture="bad")
    m = json.loads(bad.manifest_path.read_text())
    del m["stage"]
    bad.manifest_path.write_text(json.dumps(m))
    run = wd / "train" / "r1"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / "COMMITTED.json").write_text('{"step": 4}')
    (run / "config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="lifecycle"):
        for _ in range(5):  # a run updates the catalog after every commit
            state = catalog.update(wd, with_models=False)
    said = [r.getMessage() for r in caplog.records if "audit catalog" in r.getMessage()]
    assert said == [f"audit catalog: {bad.manifest_path.resolve()} left out (missing field 'stage'); the other "
                    "datasets are catalogued",
                    f"audit catalog: {(run / 'config.json').resolve()} left out (JSONDecodeError: Expecting property "
                    "name enclosed in double quotes: line 1 column 2 (char 1)); the other datasets are catalogued"]
    assert list(state["datasets"]) == [good.manifest_path.resolve().as_posix()]
    con = catalog.connect(wd, with_models=False)
    assert catalog.query(con, "SELECT count(*) AS n FROM kept") == [{"n": 2}]
