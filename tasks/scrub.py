"""Privacy scrub: replace e-mail addresses, public IPv4 addresses and phone numbers with typed placeholders.

Detection, per type:
- email: a regex close to datatrove's `formatters/pii.py` one, but the domain must end in a letter TLD, so
  version pins such as `pkg@1.2.3` are not e-mail addresses.
- ipv4: four dotted decimal octets, each 0-255, not part of a longer dotted token (`1.2.3.4.5`, `1.2.3.4.tar`).
  As datatrove does (`only_remove_public_ips=True`), only globally routable addresses are replaced
  (`ipaddress.IPv4Address.is_global`): loopback, private, link-local, `0.0.0.0` and the documentation ranges
  (192.0.2.0/24, 198.51.100.0/24, 203.0.113.0/24) identify nobody, and documentation is full of them. Also left
  alone: a version pin written against a name or operator (`novas-3.1.1.3`, `==1.2.3.4`, `v1.2.3.4`).
- phone: `phonenumbers.PhoneNumberMatcher` with leniency VALID, once per configured region (numbers written
  with `+` and a country code are found whatever the region). The matcher alone, run over Python's docs,
  finds only false positives (measured on corpus/python-docs: 2**31-1, bpo issue numbers, the digits of pi,
  an ISBN, timestamps), so a match is dropped when it is
  - part of a longer number: a digit, or `.`/`,`/`:` plus a digit, right before or after it (`3.14159265359`);
  - a decimal: digits, one `.` or `,`, digits (`0.142857143`);
  - one bare run of digits with no `+` and no separator (`2147483647`, `16499`), unless
    `phone_bare_digits` is set: people format the numbers they write down; programs print integers;
  - an ISBN (preceded by "ISBN").
Spans are resolved in priority order email > ipv4 > phone, so a phone match inside an address is not counted
twice; an IPv4 address that is left alone still shields its digits from the phone matcher.
Nothing is rejected: every row is kept, with per-type counts in `pii_<type>` columns (null when the type
is disabled, so "not scanned" never reads as "none found").
"""

from __future__ import annotations

import ipaddress
import re
import sys
from typing import Literal

import phonenumbers
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, ConfigDict, Field, field_validator

from lifecycle.dataset import DatasetRef, StageStats, code_version, materialize

STAGE = "scrub"
PII_TYPES = ("email", "ipv4", "phone")  # also the priority order when matches overlap


class ScrubConfig(BaseModel):
    """Which PII types to replace, with what, and how phone numbers are recognised."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    email: bool = Field(True, description="Replace e-mail addresses.")
    ipv4: bool = Field(True, description="Replace IPv4 addresses (see ipv4_public_only).")
    phone: bool = Field(True, description="Replace phone numbers recognised by the phonenumbers library.")
    placeholder: str = Field("<{kind}>", description=(
        "Replacement text; `{kind}` becomes the upper-cased type: <EMAIL>, <IPV4>, <PHONE>."))
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


# --------------------------------------------------------------------------------------------------
# detectors: each yields (start, end, replace?) spans over the text

_EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,63}\b"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.])({_OCTET}(?:\.{_OCTET}){{3}})(?![\w]|\.\w)")
_VERSION_CUE = re.compile(r"(?:[A-Za-z]-|[=<>!~]=|(?:^|\W)[vV])$")  # novas-3.1.1.3, ==3.1.1.3, v3.1.1.3
_DECIMAL = re.compile(r"\d+[.,]\d+")
_ISBN = re.compile(r"ISBN(?:-1[03])?:?\s*$")


def _email_spans(text: str, cfg: ScrubConfig):
    if "@" not in text:
        return
    for m in _EMAIL.finditer(text):
        yield m.start(), m.end(), True


def _ipv4_spans(text: str, cfg: ScrubConfig):
    for m in _IPV4.finditer(text):
        if _VERSION_CUE.search(text[max(0, m.start() - 2) : m.start()]):
            continue
        replace = not cfg.ipv4_public_only or ipaddress.IPv4Address(m.group(1)).is_global
        yield m.start(), m.end(), replace


def _phone_spans(text: str, cfg: ScrubConfig):
    leniency = getattr(phonenumbers.Leniency, cfg.phone_leniency)
    seen = set()
    for region in cfg.phone_regions or ("ZZ",):  # ZZ: unknown region, international numbers only
        for m in phonenumbers.PhoneNumberMatcher(text, region, leniency=leniency):
            if (m.start, m.end) in seen:
                continue
            seen.add((m.start, m.end))
            raw, before, after = m.raw_string, text[max(0, m.start - 2) : m.start], text[m.end : m.end + 2]
            if re.search(r"\d$|\d[.,:]$", before) or re.match(r"\d|[.,:]\d", after):
                continue  # a piece of a longer number
            if _DECIMAL.fullmatch(raw) or _ISBN.search(text[max(0, m.start - 12) : m.start]):
                continue
            if raw.isdigit() and not cfg.phone_bare_digits:
                continue
            yield m.start, m.end, True


_DETECTORS = {"email": _email_spans, "ipv4": _ipv4_spans, "phone": _phone_spans}


def scrub_text(text: str, cfg: ScrubConfig) -> tuple[str, dict[str, int]]:
    """(scrubbed text, replacements per enabled type)."""
    taken: list[tuple[int, int]] = []
    chosen: list[tuple[int, int, str]] = []
    counts = {}
    for kind in PII_TYPES:
        if not getattr(cfg, kind):
            continue
        counts[kind] = 0
        for start, end, replace in _DETECTORS[kind](text, cfg):
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


def scrub_table(table: pa.Table, cfg: ScrubConfig) -> tuple[pa.Table, StageStats]:
    """Every row, text scrubbed, plus int32 `pii_email`/`pii_ipv4`/`pii_phone` counts (null: type disabled)."""
    clash = [f"pii_{k}" for k in PII_TYPES if f"pii_{k}" in table.column_names]
    if clash:
        raise ValueError(f"{STAGE}: input already has column(s) {clash}; was it scrubbed already?")
    stats = StageStats(rows_in=table.num_rows, rows_kept=table.num_rows)
    texts, cols = [], {k: [] for k in PII_TYPES}
    for doc_id, text in zip(table.column("doc_id").to_pylist(), table.column("text").to_pylist()):
        if text is None:
            raise ValueError(f"{STAGE}: row doc_id={doc_id!r} has a null text")
        clean, counts = scrub_text(text, cfg)
        texts.append(clean)
        stats.bytes_in += len(text.encode("utf-8"))
        stats.bytes_out += len(clean.encode("utf-8"))
        for kind in PII_TYPES:
            cols[kind].append(counts.get(kind))
            stats.counters[f"pii_{kind}"] += counts.get(kind, 0)
        stats.counters["docs_with_pii"] += any(counts.values())
    idx = table.schema.get_field_index("text")
    out = table.set_column(idx, table.schema.field(idx), pa.array(texts, type=pa.string()))
    for kind in PII_TYPES:
        out = out.append_column(pa.field(f"pii_{kind}", pa.int32()), pa.array(cols[kind], type=pa.int32()))
    return out, stats


# --------------------------------------------------------------------------------------------------
# stage entry (no Prefect, no MLflow)


def run_scrub(parent: DatasetRef, cfg: ScrubConfig, workdir: str) -> DatasetRef:
    """Scrub every kept file of `parent`, one file at a time, into a committed `scrub` dataset."""

    def build(writer) -> dict:
        stats = StageStats()
        for path in parent.files():
            out, part = scrub_table(pq.read_table(path), cfg)
            writer.write_table(out)
            stats = stats + part
        return {"stats": stats}

    return materialize(workdir, STAGE, cfg, code_version(sys.modules[__name__]), build, parents=[parent])
