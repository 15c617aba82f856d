"""Canary: unique secrets planted in the raw input (JSONL, HTML, plain text; in the text and in the metadata) never
reach the tokenized shards, the scrubbed dataset, the rejected rows, the lineage catalog or anything MLflow holds.

The real flow runs through `tokenize` (`lifecycle run --until tokenize`: ephemeral Prefect server, MLflow on
SQLite). Every canary sits inside a real English paragraph that passes the quality filter, and the tests check
that those documents were kept (scrubbed, not merely filtered out) before they search for the canaries.
The same run has secrets in its environment (where settings come from): none of them may reach any file or log.
One run serves every test here; it is also the test of `--until`.
"""

import json
import os
import random
import string
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from mlflow import MlflowClient

from lifecycle.core.dataset import DatasetRef
from lifecycle.tasks.data.tokenize.stage import load_tokenizer, token_shards
from tests.conftest import corpus_records, last_json, lifecycle

pytestmark = pytest.mark.e2e

_rng = random.Random(20240611)


def _pick(alphabet: str, n: int) -> str:
    return "".join(_rng.choice(alphabet) for _ in range(n))


def _luhn_card() -> str:
    body = "4" + _pick(string.digits, 14)
    total = 0
    for i, ch in enumerate(reversed(body)):  # the check digit will sit right of body: double the odd positions
        d = int(ch) * (2 if i % 2 == 0 else 1)
        total += d - 9 if d > 9 else d
    return body + str((10 - total % 10) % 10)


def _iban_de() -> str:
    bban = _pick(string.digits, 18)
    check = 98 - int("".join(str(int(c, 36)) for c in bban + "DE00")) % 97
    return f"DE{check:02d}{bban}"


def _grouped(s: str, n: int = 4) -> str:
    return " ".join(s[i : i + n] for i in range(0, len(s), n))


B64 = string.ascii_letters + string.digits + "+/"
ALNUM = string.ascii_letters + string.digits
CARD, IBAN = _luhn_card(), _iban_de()
PEM_BODY = [_pick(B64, 48), _pick(B64, 48)]
# type -> the planted value as written; NEEDLES below adds the forms a leak could take (digits only, ...)
CANARIES = {
    "email": f"ivo.canary{_pick(string.digits, 4)}@orchardmail.org",
    "email_html": f"mira.canary{_pick(string.digits, 4)}@lanternpost.net",
    "email_meta": f"otto.canary{_pick(string.digits, 4)}@quillbox.com",
    "phone": f"+44 20 7946 0{_pick(string.digits, 3)}",
    "phone_html": f"+1 650-253-0{_pick(string.digits, 3)}",
    "ipv4": f"81.2.{_rng.randint(70, 250)}.{_rng.randint(10, 250)}",
    "ipv6": f"2a00:1450:4001:{_pick('0123456789abcdef', 4)}::{_pick('0123456789abcdef', 4)}",
    "credit_card": _grouped(CARD),
    "iban": _grouped(IBAN),
    "ssn": f"{_rng.randint(100, 599)}-{_rng.randint(10, 99)}-{_rng.randint(1000, 9999)}",
    "aws_key": "AKIA" + _pick(string.ascii_uppercase + string.digits, 16),
    "aws_secret": _pick(ALNUM + "/+", 40),
    "github_token": "ghp_" + _pick(ALNUM, 36),
    "private_key": PEM_BODY[0],
    "secret": _pick(ALNUM, 22),
    "dense_email": f"uma.canary{_pick(string.digits, 4)}@brightfern.org",
    "dense_ssn": f"{_rng.randint(100, 599)}-{_rng.randint(10, 99)}-{_rng.randint(1000, 9999)}",
}
NEEDLES = {k: {v} for k, v in CANARIES.items()}
NEEDLES["credit_card"].add(CARD)
NEEDLES["iban"].add(IBAN)
NEEDLES["private_key"].add(PEM_BODY[1])
for k in ("phone", "phone_html"):
    NEEDLES[k].add("".join(c for c in CANARIES[k] if c.isdigit()))
    NEEDLES[k].add(CANARIES[k][-8:])  # the subscriber part, however the number is re-spaced

GARDEN = (
    "The community garden on the east side of the river opened its gates again this spring, and the volunteers "
    "have been busy repairing the raised beds, the tool shed and the old greenhouse that the storm damaged in "
    "the winter. We are looking for people who can give a few hours each week to water the seedlings, turn the "
    "compost and show the children from the local school how the bees move between the flowers. If you would "
    "like to join the rota, please write to {email} or call {phone} on a weekday evening, and we will send you "
    "the timetable together with a map of the plots and the rules for borrowing the tools."
)
MIGRATION = (
    "The reading group will move its shared catalogue to a new server at the end of the month, because the old "
    "machine in the library basement has become too slow and too noisy for the room. The new server will answer "
    "at {ipv4} from the first of the month, and the old address will stop working a week later. The librarian "
    "who set it up left the access key {aws_key} and the configuration line aws_secret_access_key = {aws_secret} "
    "in the handover notes, which is exactly the kind of thing that should never be copied into a public page. "
    "Members do not need to change anything on their own computers, and the reading lists will stay the same."
)
ONBOARDING = (
    "New volunteers who help with the website of the historical society should read the short guide in the "
    "shared folder before they change anything on the pages about the old mill and the canal. Last year one of "
    "the helpers pasted the deploy token {github_token} into a message board, and another one attached a "
    "private key that began with these lines:\n-----BEGIN RSA PRIVATE KEY-----\n{pem0}\n{pem1}\n"
    "-----END RSA PRIVATE KEY-----\nBoth had to be replaced the same afternoon. Please keep such things out of "
    "the documents and the e-mails, and ask the coordinator if you are not sure where a file belongs."
)
BENEFITS = (
    "The office manager reminds everyone that the forms for the winter heating allowance must be handed in "
    "before the end of the month, and that the payroll service will not accept forms that are incomplete. One "
    "form that came back last week still showed the social security number {ssn} in the margin, and the note "
    "attached to it said password: {secret} in plain letters. Please remember that the office will never ask "
    "for a password by post, and that a number like that should only be written in the box that is meant for "
    "it. If you have questions about the allowance, the office is open every morning except on public holidays."
)
CONCERT = (
    "Tickets for the autumn concert in the town hall are now on sale, and the choir has added a second evening "
    "because the first one sold out within a single day. If you have questions about the seats, the parking or "
    "the access for wheelchairs, write to {email_html} or call {phone_html} during office hours. The booking "
    "page is served from {ipv6} until the end of the month, and the choir will post a confirmation to every "
    "person who books before then. The programme includes music by local composers and a short piece written "
    "by the children of the primary school, who have been rehearsing with the choir since the summer."
)
INVOICE = (
    "Dear members of the rowing club, the annual fee for the coming season is due at the end of next month, and "
    "the treasurer would like to thank all of you who have already paid. One member sent the fee with a card "
    "whose number, {credit_card}, was written on the back of the envelope, and another wrote the bank account "
    "{iban} on a postcard. Please do not send such details through the post: pay at the boat house, where the "
    "treasurer is present on Saturday mornings, or ask for the transfer form. The club will use the money to "
    "repair the landing stage and to buy two new boats for the junior crews before the spring regatta."
)
DENSE = (
    "This paragraph is a list of contact details that someone pasted into the newsletter by mistake, and it "
    "should never appear in the training data. The first contact was {dense_email}, the second contact wrote "
    "from {email} and gave the number {phone}, the third used the address {ipv4} for the shared printer, "
    "and the form also showed {dense_ssn} and {ssn} next to each other. The editor has removed the list from "
    "the web site and apologised to the people who were named in it, and the committee has agreed on new rules "
    "for the newsletter so that it cannot happen again in the future."
)
# settings from the environment (never config): a key for an object store, a database password
AWS_SECRET, DB_PASSWORD = "canaryAWSsecret" + _pick(ALNUM, 16), "canaryDBpw" + _pick(ALNUM, 12)
ENV_SECRETS = {"AWS_SECRET_ACCESS_KEY": AWS_SECRET,
               "LIFECYCLE_DATABASE_URL": f"postgresql://lifecycle:{DB_PASSWORD}@db:5432/prefect"}
KEPT_SOURCES = {"canary-garden", "canary-migration", "canary-onboarding", "canary-benefits"}  # + html, txt
DENSE_SOURCE = "canary-dense"


def _fill(template: str) -> str:
    return template.format(**CANARIES, pem0=PEM_BODY[0], pem1=PEM_BODY[1])


@pytest.fixture(scope="module")
def raw_inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("canary-inputs")
    records = [
        {"id": "canary-garden", "text": _fill(GARDEN), "contact": CANARIES["email_meta"]},  # a canary in `meta`
        {"id": "canary-migration", "text": _fill(MIGRATION)},
        {"id": "canary-onboarding", "text": _fill(ONBOARDING)},
        {"id": "canary-benefits", "text": _fill(BENEFITS)},
        {"id": DENSE_SOURCE, "text": _fill(DENSE)},  # more than max_pii_per_doc=5 hits: rejected by scrub (opt-in)
    ]
    with open(d / "docs.jsonl", "w") as f:
        for r in corpus_records(40) + records:
            f.write(json.dumps(r) + "\n")
        f.write('{"id": "canary-broken", "text": "' + CANARIES["email"] + '"\n')  # not JSON: quarantined
    (d / "concert.html").write_text(
        "<!doctype html><html><head><title>Autumn concert</title></head><body><nav><a href='/'>Home</a></nav>"
        f"<article><h1>Autumn concert</h1><p>{_fill(CONCERT)}</p><p>{_fill(CONCERT.split('. ')[-1])}</p>"
        "</article><footer>Town hall choir</footer></body></html>")
    (d / "invoice.txt").write_text(_fill(INVOICE) + "\n")
    return d


@pytest.fixture(scope="module")
def run(raw_inputs, tmp_path_factory):
    wd = tmp_path_factory.mktemp("canary-work")
    inputs = [str(raw_inputs / "*.jsonl"), str(raw_inputs / "*.html"), str(raw_inputs / "*.txt")]
    proc = lifecycle("run", "--json", "--until", "tokenize", "--set", f"workdir={wd}",
                     "--set", f"collect.inputs={json.dumps(inputs)}", "--set", "tokenize.vocab_size=400",
                     "--set", "tokenize.val_fraction=0.3", "--set", "scrub.max_pii_per_doc=5",
                     env={**os.environ, **ENV_SECRETS})
    out = last_json(proc.stdout)
    assert out["status"] == "completed"
    out["stdio"] = proc.stdout + proc.stderr
    return wd, out, raw_inputs


def ref(out, stage) -> DatasetRef:
    return DatasetRef.from_dir(Path(out["datasets"][stage]).parent)


def leaks(blob: bytes | str) -> list[str]:
    """The canary types any of whose needles occur in `blob`."""
    data = blob.encode("utf-8", "surrogatepass") if isinstance(blob, str) else blob
    return sorted(k for k, ns in NEEDLES.items() if any(n.encode() in data for n in ns))


def file_leaks(path: Path) -> list[str]:
    """Leaks in a file's bytes and, for Parquet (whose pages may be compressed), in its decoded rows."""
    found = set(leaks(path.read_bytes()))
    if path.suffix == ".parquet":
        found |= set(leaks(json.dumps(pq.read_table(path).to_pylist(), default=str)))
    return sorted(found)


def test_canaries_are_unique_and_were_really_planted(raw_inputs):
    """The needles occur nowhere in the filler corpus, and all of them occur in the raw input files."""
    filler = json.dumps(corpus_records(40))
    assert leaks(filler) == []
    raw = b"".join(p.read_bytes() for p in raw_inputs.iterdir())
    assert leaks(raw) == sorted(NEEDLES)


def test_canary_documents_were_kept_and_scrubbed_not_filtered(run):
    """Every canary document but the PII-dense one reaches the token shards; the dense one is rejected by scrub
    with counts only in `detail`; the scrubbed texts hold the typed placeholders."""
    wd, out, raw = run
    scrub = ref(out, "scrub")
    kept = {r["source_id"]: r for r in scrub.read().to_pylist()}
    planted = KEPT_SOURCES | {str(raw / "concert.html"), str(raw / "invoice.txt")}
    assert planted <= set(kept), sorted(planted - set(kept))
    tokens = {r["source_id"] for r in ref(out, "tokenize").read().to_pylist()}
    assert planted <= tokens
    rejected = {r["source_id"]: r for r in scrub.read_rejected().to_pylist()}
    assert rejected[DENSE_SOURCE]["reason"] == "too_much_pii"
    assert json.loads(rejected[DENSE_SOURCE]["detail"])["pii_total"] > 5
    counts = {k: sum(r[f"pii_{k}"] or 0 for sid, r in kept.items() if sid in planted)
              for k in ("email", "phone", "ipv4", "ipv6", "credit_card", "iban", "ssn", "aws_key", "github_token",
                        "private_key", "secret")}
    assert counts == {"email": 2, "phone": 2, "ipv4": 1, "ipv6": 1, "credit_card": 1, "iban": 1, "ssn": 1,
                      "aws_key": 2, "github_token": 1, "private_key": 1, "secret": 1}
    text = " ".join(kept[s]["text"] for s in planted)
    for placeholder in ("<EMAIL>", "<PHONE>", "<IPV4>", "<IPV6>", "<CREDIT_CARD>", "<IBAN>", "<SSN>", "<AWS_KEY>",
                        "<GITHUB_TOKEN>", "<PRIVATE_KEY>", "<SECRET>"):
        assert placeholder in text
    assert "the access for wheelchairs" in text and "the rowing club" in text  # HTML and .txt bodies are here


def test_no_canary_in_the_scrubbed_dataset(run):
    """Neither the kept Parquet of the scrub stage (text, url, meta, every column) nor its rejected rows."""
    wd, out, _ = run
    scrub = ref(out, "scrub")
    files = scrub.files() + scrub.files("rejected")
    assert files and all(p.suffix == ".parquet" for p in files)
    for path in files:
        assert file_leaks(path) == [], path


def test_no_canary_in_the_token_shards(run):
    """Decode every token shard with the saved tokenizer; also search the raw bytes of every file of the token
    dataset (shards, side tables, tokenizer vocabulary and merges, manifest)."""
    wd, out, _ = run
    tok = ref(out, "tokenize")
    meta, tokenizer = token_shards(tok), load_tokenizer(tok)
    decoded = []
    for path in meta.train + meta.val:
        ids = np.fromfile(path, dtype=meta.dtype).tolist()
        decoded.append(tokenizer.decode(ids, skip_special_tokens=False))
    text = "\n".join(decoded)
    assert leaks(text) == []
    assert "<EMAIL>" in text and "community garden" in text  # the decode is real: the scrubbed docs are there
    files = [p for p in tok.dir.rglob("*") if p.is_file()]
    assert any(p.name == "tokenizer.json" for p in files) and any(p.suffix == ".bin" for p in files)
    for p in files:
        assert file_leaks(p) == [], p


def _strings_of(obj) -> str:
    return json.dumps(obj, default=lambda o: getattr(o, "__dict__", str(o)), sort_keys=True)


def test_no_canary_in_mlflow(run, tmp_path):
    """Every run of every experiment: params, tags, metric names, dataset names/sources/profiles/tags, every
    artifact file (downloaded); the registry; and the bytes of the SQLite store and the artifact root."""
    wd, out, _ = run
    uri = f"sqlite:///{wd}/mlflow.db"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    stages = {r.data.tags.get("lifecycle.stage") for r in runs}
    assert {"collect", "filter", "dedup", "scrub", "tokenize"} <= stages  # the stages really logged here
    artifacts = 0
    for r in runs:
        assert leaks(_strings_of([r.data.params, r.data.tags, sorted(r.data.metrics), r.info.run_name])) == [], r.info
        for d in r.inputs.dataset_inputs:
            ds = d.dataset
            assert leaks(_strings_of([ds.name, ds.digest, ds.source, ds.profile, ds.schema,
                                      [(t.key, t.value) for t in d.tags]])) == [], ds.name
        local = Path(client.download_artifacts(r.info.run_id, "", str(tmp_path / r.info.run_id)))
        for p in [p for p in local.rglob("*") if p.is_file()]:
            artifacts += 1
            assert leaks(p.read_bytes()) == [], p
    assert artifacts >= 2  # config.json on the parent, raw_inputs.json on collect
    assert leaks(_strings_of([m.__dict__ for m in client.search_registered_models()])) == []
    for p in [wd / "mlflow.db", *[p for p in (wd / "mlartifacts").rglob("*") if p.is_file()]]:
        assert leaks(p.read_bytes()) == [], p
    assert leaks(out["stdio"]) == []


def test_no_canary_in_rejected_rows_or_the_lineage_catalog(run):
    """`detail` (and every other column) of every stage's rejected rows, and every catalog table an auditor
    queries, except the kept rows of the stages before scrub, which hold the raw text by design."""
    from lifecycle.lineage import catalog

    wd, out, _ = run
    con = catalog.connect(wd)
    rejected = catalog.query(con, "SELECT * FROM rejected")
    assert {r["stage"] for r in rejected} >= {"collect", "scrub"}  # the broken line and the dense document
    assert any(r["reason"] == "invalid_json" for r in rejected)
    assert leaks(_strings_of(rejected)) == []
    for table in ("datasets", "parents", "raw_inputs", "drops", "tokens", "checkpoints", "models"):
        assert leaks(_strings_of(catalog.query(con, f"SELECT * FROM {table}"))) == [], table
    scrub_path = str(Path(out["datasets"]["scrub"]).parent)
    assert leaks(_strings_of(catalog.query(con, "SELECT * FROM kept WHERE dataset_path = ?", [scrub_path]))) == []


def test_no_canary_anywhere_but_the_raw_stages(run):
    """Every byte the run left in the work dir (Prefect's database and results, the MLflow store, the dedup index,
    every dataset) except the collect, filter and dedup datasets, which keep the raw text for lineage."""
    wd, out, _ = run
    raw_stages = {str(Path(out["datasets"][s]).parent) for s in ("collect", "filter", "dedup")}
    files = [p for p in wd.rglob("*") if p.is_file() and not any(str(p).startswith(d + "/") for d in raw_stages)]
    assert any(p.suffix == ".db" and "prefect" in p.name for p in files)
    assert file_leaks(ref(out, "dedup").files()[-1])  # the search works: the raw stages do hold them
    for p in files:
        assert file_leaks(p) == [], p


def test_until_stops_after_its_stage(run):
    wd, out, _ = run
    assert list(out["stages"]) == list(out["datasets"]) == ["collect", "filter", "dedup", "scrub", "tokenize"]
    assert out["checkpoint"] is None and out["model"] is None and out["metrics"] == {}
    assert sorted(p.name for p in (wd / "datasets").iterdir()) == ["collect", "dedup", "dedup-signatures", "filter",
                                                                   "scrub", "tokenize"]
    assert not (wd / "train").exists()


def test_environment_secrets_reach_no_file_and_no_log(run):
    """Every byte the run left (the MLflow store and artifacts, Prefect's database and logs, datasets, results)
    and everything it printed."""
    wd, out, _ = run
    files = [p for p in wd.rglob("*") if p.is_file()]
    assert any(p.name == "mlflow.db" for p in files) and any(p.suffix == ".db" and "prefect" in p.name for p in files)
    secrets = [AWS_SECRET.encode(), DB_PASSWORD.encode()]
    for p in files:
        data = p.read_bytes()
        assert not [s for s in secrets if s in data], f"an environment secret leaked into {p}"
    assert not [s for s in secrets if s in out["stdio"].encode()]


def test_metadata_is_scrubbed_like_the_text():
    """A canary in `url`, `source` or a `meta` value is replaced and counted; ids and clean meta keep their bytes."""
    import pyarrow as pa

    from lifecycle.tasks.data.scrub.stage import ScrubConfig, scrub_table

    meta = json.dumps({"contact": CANARIES["email_meta"], "tags": ["x", {"key": CANARIES["github_token"]}], "n": 3})
    table = pa.table({"doc_id": ["a", "b"], "source_id": ["s-a", "s-b"], "text": [_fill(GARDEN), _fill(INVOICE)],
                      "source": [f"mailto:{CANARIES['email']}", "feed"],
                      "url": [f"https://example.org/u?ip={CANARIES['ipv4']}", None],
                      "meta": [meta, '{"title":  "Rowing"}']})
    kept, _, stats = scrub_table(table, ScrubConfig())
    rows = kept.to_pylist()
    assert leaks(json.dumps(rows)) == []
    assert json.loads(rows[0]["meta"]) == {"contact": "<EMAIL>", "tags": ["x", {"key": "<GITHUB_TOKEN>"}], "n": 3}
    assert rows[0]["source"] == "mailto:<EMAIL>" and rows[0]["url"] == "https://example.org/u?ip=<IPV4>"
    assert rows[1]["meta"] == '{"title":  "Rowing"}' and [r["source_id"] for r in rows] == ["s-a", "s-b"]
    assert {k: v for k, v in stats.counters.items() if k.startswith("metadata_")} == {
        "metadata_pii_email": 2, "metadata_pii_github_token": 1, "metadata_pii_ipv4": 1}
    assert rows[0]["pii_email"] == 1  # the per-document columns count the text only
