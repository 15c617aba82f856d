"""tokenize's train/val overlap gate on real corpora: clean splits, and splits with a planted leak.

    python -m bench.split_overlap DATASET [DATASET ...] [--seeds 0,1,2] [--leaks 0.1,0.2] [--sweep 40]
                                  [--set FIELD=JSON] [--json]

DATASET is a committed document dataset that tokenize reads, e.g. `<workdir>/datasets/scrub/<fingerprint>` of
`lifecycle run deploy/configs/techdocs.yaml --set workdir=<workdir> --set 'collect.inputs=[...]' --until scrub`.
Every figure comes from the tokenize stage itself (`run_tokenize`, default `TokenizeConfig` but for the seed,
`--set` fields and `max_contamination=1.0`, so the figures are read instead of raising): the gate's verdict is
then whether the near-copy rate is above the configured `max_contamination`. The first run trains the BPE; the
others reuse its `tokenizer.json` (`tokenizer_file`), which changes no split here (the token floor is met by the
documents floor).

- clean: the corpus as it is, one split per seed; `all n-grams`: the first seed with every n-gram counted
  (`contamination_boilerplate_docs=None`). `old rule` is the share of val documents sharing any 13-gram with
  train, which the gate used before issue 41.
- sweep: the near-copy rate of `--sweep` clean splits (seeds 0..N-1), from the split and the check alone.
- leak: copies of a share of the first seed's val documents are added as new documents, each its own source file whose
  group hashes to train (checked: the val split is unchanged). Forms: `copy` (verbatim), `edit2` / `edit5` (2% /
  5% of the words replaced by a word from another val document), `embed` (the val text inserted in the middle of
  a train document: a copy inside a longer page). `flagged` is how many planted val documents the gate counts as
  near copies; `share` the median share of their n-grams found in train.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

import pyarrow as pa

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lifecycle.core import dataset as ds  # noqa: E402
from lifecycle.tasks.data.tokenize import checks  # noqa: E402
from lifecycle.tasks.data.tokenize import split as valsplit  # noqa: E402
from lifecycle.tasks.data.tokenize.split import group_key, split_key  # noqa: E402
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, iter_docs, run_tokenize  # noqa: E402

FORMS = ("copy", "edit2", "edit5", "embed")


def edit(text: str, rate: float, pool: list[str], rng: random.Random) -> str:
    w = text.split(" ")
    for i in rng.sample(range(len(w)), max(1, round(rate * len(w)))):
        w[i] = rng.choice(pool)
    return " ".join(w)


def planted(form: str, text: str, host: str, pool: list[str], rng: random.Random) -> str:
    if form == "copy":
        return text
    if form == "embed":
        cut = len(host) // 2
        return f"{host[:cut]}\n\n{text}\n\n{host[cut:]}"
    return edit(text, {"edit2": 0.02, "edit5": 0.05}[form], pool, rng)


def leak_row(i: int, source_id: str, text: str, cfg: TokenizeConfig) -> dict:
    """A planted document, its own source file, whose split group lands past every split rule (key > 0.9)."""
    for j in range(1000):
        row = {"doc_id": f"leak{i:04d}-{j}", "source_id": f"leak/{source_id}", "source": f"leak-{i}-{j}.txt",
               "text": text, "url": None, "meta": None}
        if split_key(group_key(row["doc_id"], row, cfg.split_by), cfg) > 0.9:
            return row
    raise AssertionError("no key above 0.9 in 1000 tries")


def with_leak(parent: ds.DatasetRef, work: Path, form: str, share: float, val: list[str], cfg: TokenizeConfig):
    rows = parent.read([f.name for f in ds.DOC_SCHEMA]).to_pylist()
    by_id = {r["doc_id"]: r for r in rows}
    rng = random.Random(0)
    chosen = sorted(rng.sample(sorted(val), max(1, round(share * len(val)))))
    pool = [w for d in sorted(val) if d not in chosen for w in by_id[d]["text"].split()]
    hosts = [r for r in rows if r["doc_id"] not in val]
    leak = [leak_row(i, by_id[d]["source_id"], planted(form, by_id[d]["text"], rng.choice(hosts)["text"], pool, rng),
                     cfg) for i, d in enumerate(chosen)]
    table = pa.Table.from_pylist(rows + leak, schema=ds.DOC_SCHEMA)
    ref = ds.materialize(work, "scrub", {"leak": form, "share": share, "of": parent.fingerprint}, "bench",
                         lambda w: (w.write_table(table), {})[1])
    return ref, chosen


def tokenize(parent: ds.DatasetRef, work: Path, cfg: TokenizeConfig, **update) -> tuple[dict, list[str], dict]:
    ref = run_tokenize(parent, cfg.model_copy(update={"max_contamination": 1.0, **update}), str(work))
    side = ref.read(["doc_id", "split"]).to_pylist()
    report = json.loads((ref.dir / checks.REPORT).read_text())
    return ref.manifest()["contamination"], sorted(r["doc_id"] for r in side if r["split"] == "val"), report


def row(name: str, m: dict, cfg: TokenizeConfig) -> dict:
    return {"run": name, "val_docs": m["contamination_eval_docs"], "old_rule": m["contamination_doc_rate"],
            "near_copies": m["contamination_near_copy_docs"], "near_copy_rate": m["contamination_near_copy_rate"],
            "gate": "FAIL" if m["contamination_near_copy_rate"] > cfg.max_contamination else "pass"}


def sweep(parent: ds.DatasetRef, cfg: TokenizeConfig, n: int) -> dict:
    """Near-copy rates of `n` clean splits (seeds 0..n-1), from the split and the check alone (no tokenizer: the
    token floor is left out, which these corpora meet with the documents floor)."""
    rows = parent.read(["doc_id", "source_id", "text"]).to_pylist()

    def batches():
        yield [r["doc_id"] for r in rows], [r["source_id"] for r in rows], [r["text"] for r in rows]

    rates = []
    for s in range(n):
        c = cfg.model_copy(update={"seed": s})
        rates.append(checks.train_val_overlap(batches, valsplit.docs_floor(parent.files(), c, iter_docs).val, c)[0][
            "contamination_near_copy_rate"])
    return {"splits": n, "median": statistics.median(rates), "max": max(rates),
            "above_max_contamination": sum(r > cfg.max_contamination for r in rates)}


def corpus(path: str, cfg: TokenizeConfig, seeds: list[int], leaks: list[float], work: Path) -> list[dict]:
    parent = ds.DatasetRef.from_dir(path)
    m, val0, _ = tokenize(parent, work, cfg, seed=seeds[0])
    tok = str(next((work / "datasets" / "tokenize").glob("*/tokenizer.json")))
    cfg = cfg.model_copy(update={"tokenizer_file": tok, "seed": seeds[0]})
    out = [row(f"clean seed {seeds[0]}", m, cfg)]
    for s in seeds[1:]:
        out.append(row(f"clean seed {s}", tokenize(parent, work, cfg, seed=s)[0], cfg))
    m = tokenize(parent, work, cfg, contamination_boilerplate_docs=None)[0]
    out.append(row("clean all n-grams", m, cfg))
    for form in FORMS:
        for share in leaks:
            leaked, chosen = with_leak(parent, work, form, share, val0, cfg)
            m, val, report = tokenize(leaked, work, cfg)
            assert val == val0, "the planted documents moved the val split"
            listed = {r["val_doc_id"]: r for r in report["closest_val_docs"]}
            r = row(f"leak {form} {share:.0%}", m, cfg)
            r["planted"], r["flagged"] = len(chosen), sum(listed.get(d, {}).get("near_copy", False) for d in chosen)
            r["planted_share_median"] = statistics.median(listed[d]["share"] if d in listed else 0.0 for d in chosen)
            out.append(r)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("datasets", nargs="+", help="committed document datasets (tokenize's input)")
    ap.add_argument("--seeds", default="0,1,2", help="split seeds of the clean runs (the first also for leaks)")
    ap.add_argument("--leaks", default="0.1,0.2", help="shares of val documents copied into train")
    ap.add_argument("--sweep", type=int, default=40, help="clean splits whose near-copy rate is counted (0: none)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=JSON", help="a TokenizeConfig field")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    leaks = [float(s) for s in a.leaks.split(",")]
    cfg = TokenizeConfig(**{k: json.loads(v) for k, v in (s.split("=", 1) for s in a.set)})
    results, sweeps = {}, {}
    for path in a.datasets:
        with tempfile.TemporaryDirectory() as tmp:
            results[path] = corpus(path, cfg, seeds, leaks, Path(tmp))
        if a.sweep:
            sweeps[path] = sweep(ds.DatasetRef.from_dir(path), cfg, a.sweep)
    if a.json:
        print(json.dumps({"runs": results, "sweeps": sweeps}, indent=2))
        return
    print(f"gate: {checks.rule(cfg)}; fails above max_contamination={cfg.max_contamination}")
    for path, rows in results.items():
        print(f"\n{path}")
        print(f"{'run':<18}{'val':>5}{'old rule':>10}{'near':>6}{'rate':>7}{'gate':>6}{'flagged':>10}{'share':>7}")
        for r in rows:
            flagged = f"{r['flagged']}/{r['planted']}" if "planted" in r else ""
            share = f"{r['planted_share_median']:.2f}" if "planted" in r else ""
            print(f"{r['run']:<18}{r['val_docs']:>5}{r['old_rule']:>10.1%}{r['near_copies']:>6}"
                  f"{r['near_copy_rate']:>7.1%}{r['gate']:>6}{flagged:>10}{share:>7}")
        if path in sweeps:
            w = sweeps[path]
            print(f"{w['splits']} clean splits (seeds 0..{w['splits'] - 1}): near-copy rate median {w['median']:.1%}, "
                  f"max {w['max']:.1%}; above max_contamination: {w['above_max_contamination']}")


if __name__ == "__main__":
    main()
