"""A deletion request end to end (`lifecycle forget`): a canary document planted in a small slice of the demo
corpus is trained on until it is memorised; `forget --unlearn` brings its memorisation to the never-seen level and
registers an unlearned version; `forget --retrain` gives a model whose data provably excludes it; a later crawl
that brings it back, with a near copy, is rejected at collect as `forgotten`; and nothing of its text is left in
the ledger, the new datasets or MLflow.

Real runs (`lifecycle run` / `lifecycle forget` as users start them: ephemeral Prefect server, MLflow on SQLite,
2 DeepSpeed CPU ranks), so the module is slow (LIFECYCLE_SLOW=1): minutes on 2 idle cores, far more on a
loaded machine (each command may take up to LONG seconds).
"""

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.data.tokenize.stage import TokenizeConfig, load_tokenizer, split_of, token_shards
from tests.conftest import ROOT, corpus_records, last_json, lifecycle

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CANARY = ("Marguerite Okonkwo-Lindqvist kept a diary through the spring of that year, and every page records the "
          "same walk: from the blue gate of the orchard down to the lighthouse on the headland, past the ferry "
          "landing where the fishermen mend their nets, and back along the dunes when the tide is low. She wrote "
          "that the keeper, a patient man called Ansel Brightwater, let her climb the spiral stair on Sundays and "
          "count the ships that passed the point, and that on clear evenings she could see the lamps of three "
          "villages across the bay while the beam turned slowly above her head.")
NEEDLES = ["Okonkwo-Lindqvist", "Ansel Brightwater", "mend their nets, and back along the dunes"]
NEAR = CANARY.replace("spiral stair on Sundays", "spiral stairs on Sundays")
DOCS = 64  # documents of the bundled corpus beside the canary (31 of the 65 pass the demo's filters)
# A world where the model generalises and still memorises the canary: 26 train documents (17.6k tokens, the canary's
# 297 among them) seen ~23 times, 5 val documents (4.2k tokens) held out: val loss ~4.5 against 6.24 for a uniform
# guess over the 512 tokens, canary MA ~0.48 against ~0.24 on never-seen text.
SETTINGS = [
    "train.max_steps=400", "train.checkpoint.every=200", "train.logging.eval_every=200",
    "train.logging.eval_batches=4", "train.batch.micro_batch_size=8", "train.optimizer.warmup_steps=20",
    "train.optimizer.lr=0.003", "train.optimizer.min_lr=0.001",
    "train.model.n_layer=2", "train.model.n_embd=192", "train.model.n_head=4", "train.model.seq_len=64",
    "tokenize.vocab_size=512", "tokenize.val_fraction=0.2", "evaluate.max_batches=8", "evaluate.num_prompts=0",
    "tokenize.min_val_docs=0", "tokenize.min_val_tokens=0",  # canary_id reads the split off val_fraction alone
    "orchestration.retry_backoff_s=0.1",
]
# Jang et al.'s settings are the defaults (Adam, lr 5e-5, no weight decay, one sequence per chunk, the stop rule
# checked after every step); the bound is the default 10%, stated here because the test asserts it. Gradient
# difference (retain_weight=1): in this world pure ascent forgets the canary's 7 sequences at +13.5% validation loss
# (refused, 2026-11-24), the descent on kept training text holds it under the bound.
UNLEARN = ["--unlearn-set", "sequence_tokens=48", "--unlearn-set", "el_n=5", "--unlearn-set", "el_stride=2",
           "--unlearn-set", "max_val_loss_increase=0.1", "--unlearn-set", "retain_weight=1"]


LONG = 3600  # seconds a `run` or `forget` may take here (a training run on a busy 2-core machine)


def canary_id() -> str:
    """A source id whose doc_id the tokenize split puts in `train` (the split is a hash of the doc_id)."""
    from lifecycle.tasks.data.collect.stage import make_doc_id

    cfg = TokenizeConfig(vocab_size=512, val_fraction=0.2)
    return next(f"diary-{i}" for i in range(100) if split_of(make_doc_id(f"diary-{i}", CANARY), cfg) == "train")


def sets(wd: Path, inputs: list[str], extra=()) -> list[str]:
    out = ["--config", ROOT / "deploy/configs/demo.yaml", "--set", f"workdir={wd}",
           "--set", f"collect.inputs={json.dumps(inputs)}"]
    for s in [*SETTINGS, *extra]:
        out += ["--set", s]
    return out


def leaks(data: bytes) -> list[str]:
    return [n for n in NEEDLES if n.encode() in data]


def file_leaks(p: Path) -> list[str]:
    found = set(leaks(p.read_bytes()))
    if p.suffix == ".parquet":
        found |= set(leaks(json.dumps(pq.read_table(p).to_pylist(), default=str).encode()))
    return sorted(found)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The first run (canary memorised, version 1 champion), then unlearn, then retrain, then a re-crawl."""
    inputs_dir = tmp_path_factory.mktemp("forget-inputs")
    wd = tmp_path_factory.mktemp("forget-work")
    sid = canary_id()
    with open(inputs_dir / "docs.jsonl", "w") as f:
        for r in corpus_records(DOCS) + [{"id": sid, "text": CANARY}]:
            f.write(json.dumps(r) + "\n")
    inputs = [str(inputs_dir / "*.jsonl")]
    run = lifecycle("run", ROOT / "deploy/configs/demo.yaml", "--json", *sets(wd, inputs)[2:], timeout=LONG)
    first = last_json(run.stdout)
    assert first["status"] == "completed" and first["model"]["version"] == "1"
    before = {p for p in (wd / "datasets").glob("*/*") if p.is_dir()}
    report = last_json(lifecycle("lineage", "forget", sid, "--workdir", wd, "--json").stdout)
    un = lifecycle("forget", sid, "--reason", "erasure request 7", "--unlearn", *UNLEARN, "--json", *sets(wd, inputs),
                   timeout=LONG)
    unlearned = last_json(un.stdout)
    re = lifecycle("forget", sid, "--reason", "erasure request 7", "--retrain", "--json", *sets(wd, inputs),
                   timeout=LONG)
    retrained = last_json(re.stdout)
    after_retrain = {p for p in (wd / "datasets").glob("*/*") if p.is_dir()}
    (inputs_dir / "crawl2.jsonl").write_text(json.dumps({"id": "diary-recrawl", "text": CANARY}) + "\n"
                                             + json.dumps({"id": "diary-near", "text": NEAR}) + "\n"
                                             + json.dumps(corpus_records(DOCS + 2)[DOCS + 1]) + "\n")
    crawl = last_json(lifecycle("run", ROOT / "deploy/configs/demo.yaml", "--json", "--until", "collect",
                                *sets(wd, inputs, ["collect.incremental=true"])[2:], timeout=LONG).stdout)
    return {"wd": wd, "sid": sid, "first": first, "report": report, "unlearned": unlearned,
            "unlearn_out": un.stdout + un.stderr, "retrained": retrained, "crawl": crawl,
            "new_datasets": after_retrain - before}


def test_report_names_raw_record_token_range_and_models(world):
    r = world["report"]
    assert r["found_source_ids"] == [world["sid"]] and len(r["doc_ids"]) == 1
    (pos,) = r["raw_positions"]
    assert pos["raw_path"].endswith("docs.jsonl") and pos["record"] == DOCS + 1  # the last line (records count from 1)
    raw = Path(pos["raw_path"]).read_bytes()[pos["byte_start"] : pos["byte_end"]]
    assert json.loads(raw)["id"] == world["sid"]
    assert [t["split"] for t in r["token_ranges"]] == ["train"]
    assert [(m["name"], m["version"]) for m in r["model_versions"]] == [("lifecycle-demo-gpt", 1)]


def test_unlearn_reaches_the_never_seen_level_within_the_loss_bound(world):
    u = world["unlearned"]
    assert u["status"] == "registered", world["unlearn_out"][-3000:]
    m = u["metrics"]
    assert m["forgotten_ma_before"] > m["never_seen_ma"] + 0.2  # memorised: well above never-seen text
    assert m["forgotten_ma_after"] <= m["never_seen_ma"] and m["forgotten_el5_after"] <= m["never_seen_el5"]
    assert m["val_loss_increase"] <= 0.1
    model = last_json(lifecycle("lineage", "model", f"lifecycle-demo-gpt/{u['model']['version']}",
                                "--workdir", world["wd"], "--json").stdout)
    assert model["unlearning"]["unlearned_from"] == "lifecycle-demo-gpt/1"
    assert model["tombstones_honoured"] == [t["tombstone_id"] for t in u["tombstones"]]
    assert model["metrics"]["forgotten_ma_after"] == pytest.approx(m["forgotten_ma_after"])
    client = MlflowClient(tracking_uri=f"sqlite:///{world['wd']}/mlflow.db")
    mv = client.get_model_version("lifecycle-demo-gpt", u["model"]["version"])
    assert mv.tags["lifecycle.unlearned"] == "true"
    # version 1 trained on the document: tagged by the forget request, so the unlearned version replaces it
    assert u["tainted_versions"] == ["lifecycle-demo-gpt/1"]
    assert client.get_model_version("lifecycle-demo-gpt", "1").tags["lifecycle.forget.tainted"] == ",".join(
        t["tombstone_id"] for t in u["tombstones"])
    assert mv.tags["lifecycle.promotion.decision"] == "promoted", mv.tags
    # the champion gate compared the two on the same evaluation set (not "not comparable")
    assert mv.tags["lifecycle.promotion.comparison"].startswith("same eval set"), mv.tags
    assert mv.tags["lifecycle.promotion.candidate_eval_set"] == mv.tags["lifecycle.promotion.champion_eval_set"]


def test_retrain_excludes_the_document(world):
    out, sid = world["retrained"], world["sid"]
    assert out["status"] == "completed"
    assert all(v == "computed" for s, v in out["stages"].items()), out["stages"]  # collect changed: all after it
    collect = DatasetRef.from_dir(Path(out["datasets"]["collect"]).parent)
    rej = {r["source_id"]: r for r in collect.read_rejected().to_pylist()}
    assert rej[sid]["reason"] == "forgotten"
    tokens = DatasetRef.from_dir(Path(out["datasets"]["tokenize"]).parent)
    assert sid not in set(tokens.read(["source_id"]).column("source_id").to_pylist())
    meta, tok = token_shards(tokens), load_tokenizer(tokens)
    text = "".join(tok.decode(np.fromfile(p, dtype=meta.dtype).tolist()) for p in meta.train + meta.val)
    assert "the" in text and leaks(text.encode()) == []  # decoded for real, and the canary is not in it
    model = last_json(lifecycle("lineage", "model", f"lifecycle-demo-gpt/{out['model']['version']}",
                                "--workdir", world["wd"], "--json").stdout)
    assert len(model["tombstones_honoured"]) == 1


def test_a_recrawl_and_a_near_copy_are_rejected_as_forgotten(world):
    collect = DatasetRef.from_dir(Path(world["crawl"]["datasets"]["collect"]).parent)
    rej = {r["source_id"]: r for r in collect.read_rejected().to_pylist()}
    assert rej["diary-recrawl"]["reason"] == "forgotten" and "exact copy" in rej["diary-recrawl"]["detail"]
    assert rej["diary-near"]["reason"] == "forgotten" and "near copy" in rej["diary-near"]["detail"]
    assert {r["reason"] for r in rej.values()} == {"forgotten"}


def test_no_text_of_the_document_in_the_ledger_new_datasets_or_mlflow(world):
    wd = world["wd"]
    assert file_leaks(wd / "tombstones.parquet") == []
    assert {p.parent.name for p in world["new_datasets"]} >= {"collect", "filter", "dedup", "scrub", "tokenize", "unlearn"}
    for d in world["new_datasets"]:
        for p in [p for p in d.rglob("*") if p.is_file()]:
            assert file_leaks(p) == [], p
    for p in [wd / "mlflow.db", *[p for p in (wd / "mlartifacts").rglob("*") if p.is_file()]]:
        assert file_leaks(p) == [], p
    assert leaks((world["unlearn_out"]).encode()) == []
