"""Privacy scrub: replace personal data and secrets with typed placeholders and count them, per type and document.

Types (each switchable in ScrubConfig, each counted in an int32 `pii_<type>` column and a stats counter; the
values themselves are never logged), detectors in tasks/data/scrub/detectors.py:
- email: a regex close to datatrove's `formatters/pii.py` one, but the domain must end in a letter TLD, so
  version pins such as `pkg@1.2.3` are not e-mail addresses.
- ipv4: four dotted decimal octets, each 0-255, not part of a longer dotted token (`1.2.3.4.5`, `1.2.3.4.tar`).
  As datatrove does (`only_remove_public_ips=True`), only globally routable addresses are replaced
  (`ipaddress.IPv4Address.is_global`): loopback, private, link-local, `0.0.0.0` and the documentation ranges
  identify nobody, and documentation is full of them. Also left alone: a version pin written against a name or
  operator (`novas-3.1.1.3`, `==1.2.3.4`, `v1.2.3.4`), and a quad that numbers a division of the text or a
  release: after Section/Table/Figure/Example/Chapter/Appendix/clause/§/version/release... (directly or through a
  list: "Sections 4.4.6.4 and 8.12.1.4"), or opening a numbered heading (`detectors.numbers_a_division`).
- ipv6: colon-hex candidates with at least 3 groups, validated by `ipaddress.IPv6Address`; global only by default.
- phone: `phonenumbers.PhoneNumberMatcher` with leniency VALID, once per configured region (numbers written
  with `+` and a country code are found whatever the region). The matcher alone, run over Python's docs,
  finds only false positives (2**31-1, bpo issue numbers, the digits of pi, an ISBN, timestamps), so a match
  is dropped when it is part of a longer number, a decimal, one bare run of digits (unless
  `phone_bare_digits`: people format the numbers they write down; programs print integers), or an ISBN.
- credit_card: 13-19 digits, bare or grouped, issuer digit 2-6, Luhn-valid.
- iban: per-country length and the ISO 7064 mod-97 checksum.
- ssn: US AAA-GG-SSSS outside the never-issued ranges (area 000/666/9xx, group 00, serial 0000).
- aws_key: access key ids (AKIA/ASIA + 16) and 40-character secret keys after an aws_secret_access_key word.
- github_token: ghp_/gho_/ghu_/ghs_/ghr_ and github_pat_ tokens.
- private_key: PEM `-----BEGIN ... PRIVATE KEY-----` blocks through their END line.
- secret: a value after password=/secret:/token=/api_key... that is long and random (Shannon entropy).
Overlapping spans go to the type first in `PRIORITY`; a recognised look-alike (private IP, Luhn-failing card,
bad-checksum IBAN) is left as it is but still shields its digits from the phone matcher.
Hashes, UUIDs, dates, versions and ISBNs are left alone; tests/data/test_scrub_eval.py measures this on a generated,
labelled evaluation set.

Every document is kept with its PII replaced, as datatrove's PIIFormatter does: a page that lists its maintainers'
addresses loses the addresses, not the page. Dropping PII-dense pages is opt-in: with `max_pii_per_doc` set (Dolma
drops pages with more than 5), a document with more replacements is rejected with reason `too_much_pii` (detail:
the counts per type). A disabled type's column is null, so "not scanned" never reads as "none found".

Metadata is scrubbed too: the same detectors run over `source`, `url` and every string value inside the `meta`
JSON (an author's e-mail, a token in a query string), and their replacements are counted in the stats as
`metadata_pii_<type>`; they do not count towards `max_pii_per_doc` nor the per-document columns, which describe
the text. `doc_id` and `source_id` are kept as they are: they are the keys that lineage and deletion requests use.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Literal

import phonenumbers
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lifecycle.core.dataset import (
    StageStats, rejected_table,
)
from lifecycle.core.shards import PerFileStage, map_tables
from lifecycle.tasks.data.scrub.detectors import DETECTORS, PRIORITY, shield_spans

NAME = "scrub"
# column order: the original three first (the flow and the lineage CLI read them), then the newer types
PII_TYPES = ("email", "ipv4", "phone", "ipv6", "credit_card", "iban", "ssn", "aws_key", "github_token",
             "private_key", "secret")
REJECT_REASON = "too_much_pii"


class ScrubConfig(BaseModel):
    """Which PII types to replace, with what, and how phone numbers are recognised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    email: bool = Field(True, description="Replace e-mail addresses.")
    ipv4: bool = Field(True, description="Replace IPv4 addresses (see ipv4_public_only).")
    phone: bool = Field(True, description="Replace phone numbers recognised by the phonenumbers library.")
    placeholder: str = Field("<{kind}>", description=(
        "Replacement text; `{kind}` becomes the upper-cased type: <EMAIL>, <IPV4>, <PHONE>, <CREDIT_CARD>..."))
    ipv4_public_only: bool = Field(True, description=(
        "Replace only globally routable addresses (datatrove PIIFormatter.only_remove_public_ips). False "
        "replaces 127.0.0.1, 192.168.x.x, 0.0.0.0 and documentation addresses too."))
    phone_regions: tuple[str, ...] = Field(("US", "GB", "DE", "FR"), description=(
        "ISO 3166 regions whose national formats are tried (e.g. '020 7946 0958' for GB). International "
        "numbers ('+44 20 7946 0958') are found with any region; an empty tuple finds only those."))
    phone_leniency: Literal["POSSIBLE", "VALID", "STRICT_GROUPING", "EXACT_GROUPING"] = Field("VALID", description=(
        "phonenumbers.Leniency for the matcher. VALID: the number must be valid for its region."))
    phone_bare_digits: bool = Field(False, description=(
        "Also replace a national number written as one bare digit run (6502530000). Off by default: in technical "
        "text such runs are integers (2147483647) far more often than phone numbers."))
    ipv6: bool = Field(True, description="Replace IPv6 addresses (see ipv6_public_only).")
    ipv6_public_only: bool = Field(True, description=(
        "Replace only globally routable IPv6 addresses: fe80::/10, fc00::/7 and 2001:db8::/32 stay. Addresses "
        "with fewer than 3 groups (::1, fe80::1) are never replaced: `a[1::2]` is a slice."))
    credit_card: bool = Field(True, description="Replace Luhn-valid payment card numbers (13-19 digits).")
    iban: bool = Field(True, description="Replace IBANs whose length and mod-97 checksum are right.")
    ssn: bool = Field(True, description="Replace US social security numbers written AAA-GG-SSSS.")
    aws_key: bool = Field(True, description=(
        "Replace AWS access key ids (AKIA/ASIA...) and secret access keys after an aws_secret_access_key word."))
    github_token: bool = Field(True, description="Replace GitHub tokens (ghp_, gho_, ghu_, ghs_, ghr_, github_pat_).")
    private_key: bool = Field(True, description="Replace PEM private-key blocks, BEGIN line to END line.")
    secret: bool = Field(True, description=(
        "Replace high-entropy values after key words (password=, secret:, token=, api_key...); the key word stays."))
    secret_min_length: int = Field(16, ge=1, description="Shortest value after a key word that counts as a secret.")
    secret_min_entropy: float = Field(3.5, ge=0, description=(
        "Least Shannon entropy, bits per character, of a value after a key word (random base62 of 16+ "
        "characters: about 3.8-5; identifiers and words: below 3.5)."))
    max_pii_per_doc: int | None = Field(None, ge=0, description=(
        "Reject a document with more replacements than this, all types together, with reason too_much_pii "
        "(opt-in; Dolma drops pages with more than 5). None (the default, as datatrove's PIIFormatter): every "
        "document is kept with its PII replaced and counted."))

    @field_validator("placeholder")
    @classmethod
    def _placeholder(cls, v: str) -> str:
        try:
            out = v.format(kind="EMAIL")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"placeholder {v!r} must be a format string using only {{kind}}: {e}") from e
        if not out:
            raise ValueError("placeholder must not render empty: a scrubbed value would vanish without a trace")
        return v

    @field_validator("phone_regions")
    @classmethod
    def _regions(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [r for r in v if r not in phonenumbers.SUPPORTED_REGIONS]
        if bad:
            raise ValueError(f"phone_regions: unknown region code(s) {bad}; use ISO 3166 codes such as 'US', 'GB'")
        return v


def scrub_text(text: str, cfg: ScrubConfig) -> tuple[str, dict[str, int]]:
    """(scrubbed text, replacements per enabled type, in PII_TYPES order)."""
    taken: list[tuple[int, int]] = list(shield_spans(text))  # ISBNs: never PII, never re-read as numbers
    chosen: list[tuple[int, int, str]] = []
    counts = {kind: 0 for kind in PII_TYPES if getattr(cfg, kind)}
    for kind in PRIORITY:
        if kind not in counts:
            continue
        for start, end, replace in DETECTORS[kind](text, cfg):
            if any(start < b and a < end for a, b in taken):
                continue  # inside a higher-priority match
            taken.append((start, end))
            if replace:
                chosen.append((start, end, kind))
                counts[kind] += 1
    if not chosen:
        return text, counts
    parts, pos = [], 0
    for start, end, kind in sorted(chosen):
        parts += [text[pos:start], cfg.placeholder.format(kind=kind.upper())]
        pos = end
    parts.append(text[pos:])
    return "".join(parts), counts


METADATA_COLUMNS = ("source", "url", "meta")  # scrubbed like the text; `meta` value by value (it is JSON)


def _scrub_json(value, cfg: ScrubConfig, counts: Counter):
    if isinstance(value, str):
        clean, found = scrub_text(value, cfg)
        counts.update(found)
        return clean
    if isinstance(value, list):
        return [_scrub_json(v, cfg, counts) for v in value]
    if isinstance(value, dict):
        return {k: _scrub_json(v, cfg, counts) for k, v in value.items()}
    return value


def scrub_metadata(table: pa.Table, cfg: ScrubConfig, stats: StageStats) -> pa.Table:
    """`source`, `url` and the string values of `meta` with PII replaced; a `meta` value is re-serialised
    only when something in it was replaced, so clean rows keep their bytes."""
    for name in METADATA_COLUMNS:
        if name not in table.column_names:
            continue
        counts: Counter = Counter()
        out = []
        for value in table.column(name).to_pylist():
            if value is None:
                out.append(None)
            elif name != "meta":
                out.append(_scrub_json(value, cfg, counts))
            else:
                before = sum(counts.values())
                parsed = _scrub_json(json.loads(value), cfg, counts)
                out.append(value if sum(counts.values()) == before else json.dumps(parsed, ensure_ascii=False))
        for kind, n in counts.items():
            if n:
                stats.counters[f"metadata_pii_{kind}"] += n
        idx = table.schema.get_field_index(name)
        table = table.set_column(idx, table.schema.field(idx), pa.array(out, type=table.schema.field(idx).type))
    return table


def scrub_table(table: pa.Table, cfg: ScrubConfig) -> tuple[pa.Table, pa.Table, StageStats]:
    """(kept rows, text scrubbed, plus an int32 `pii_<type>` count per type (null: type disabled); rejected rows
    (reason too_much_pii, only with max_pii_per_doc set); stats). Counters count every scanned document, rejected
    ones included."""
    clash = [f"pii_{k}" for k in PII_TYPES if f"pii_{k}" in table.column_names]
    if clash:
        raise ValueError(f"{NAME}: input already has column(s) {clash}; was it scrubbed already?")
    stats = StageStats(rows_in=table.num_rows)
    keep, texts, cols, rejected = [], [], {k: [] for k in PII_TYPES}, []
    doc_ids, source_ids = table.column("doc_id").to_pylist(), table.column("source_id").to_pylist()
    for i, (doc_id, text) in enumerate(zip(doc_ids, table.column("text").to_pylist())):
        if text is None:
            raise ValueError(f"{NAME}: row doc_id={doc_id!r} has a null text")
        clean, counts = scrub_text(text, cfg)
        stats.bytes_in += len(text.encode("utf-8"))
        for kind, n in counts.items():
            if n:  # Counter's + drops zeros anyway: merged stats hold only the types found
                stats.counters[f"pii_{kind}"] += n
        total = sum(counts.values())
        stats.counters["docs_with_pii"] += total > 0
        if cfg.max_pii_per_doc is not None and total > cfg.max_pii_per_doc:
            stats.rejected[REJECT_REASON] += 1
            detail = {"pii_total": total, "max_pii_per_doc": cfg.max_pii_per_doc,
                      **{k: n for k, n in counts.items() if n}}  # counts only, never the values
            rejected.append({"doc_id": doc_id, "source_id": source_ids[i], "reason": REJECT_REASON,
                             "detail": json.dumps(detail, sort_keys=True)})
            continue
        keep.append(i)
        texts.append(clean)
        stats.bytes_out += len(clean.encode("utf-8"))
        for kind in PII_TYPES:
            cols[kind].append(counts.get(kind))
    stats.rows_kept = len(keep)
    out = table.take(pa.array(keep, type=pa.int64())) if len(keep) < table.num_rows else table
    idx = out.schema.get_field_index("text")
    out = out.set_column(idx, out.schema.field(idx), pa.array(texts, type=pa.string()))
    for kind in PII_TYPES:
        out = out.append_column(pa.field(f"pii_{kind}", pa.int32()), pa.array(cols[kind], type=pa.int32()))
    return scrub_metadata(out, cfg, stats), rejected_table(rejected, NAME), stats


# --------------------------------------------------------------------------------------------------
# stage entry (no Prefect, no MLflow)


def scrub_shard(cfg: ScrubConfig, files: list[str], writer) -> StageStats:
    return map_tables(files, writer, lambda table: scrub_table(table, cfg))


STAGE = PerFileStage(NAME, __package__, scrub_shard)
run_scrub = STAGE.run  # scrub every kept file of a parent into a committed `scrub` dataset, here
