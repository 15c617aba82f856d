"""PII detectors of the scrub stage: each yields (start, end, replace?) spans over a text.

A span with replace=False is a look-alike that was recognised and rejected (a private IPv4 address, a
card-shaped number that fails Luhn, an IBAN-shaped string that fails mod-97): it is not replaced, but it
still shields its characters from lower-priority detectors, so its digits are not re-read as a phone number.
Detectors read options from the stage's ScrubConfig (duck-typed: this module does not import it).
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections import Counter

import phonenumbers

# --------------------------------------------------------------------------------------------------
# e-mail, IPv4, phone (see tasks/scrub.py's docstring for the look-alike rules)

_EMAIL = re.compile(
    r"(?<![\w.%+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z]{2,63}\b"
)
_OCTET = r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)"
_IPV4 = re.compile(rf"(?<![\w.])({_OCTET}(?:\.{_OCTET}){{3}})(?![\w]|\.\w)")
_VERSION_CUE = re.compile(r"(?:[A-Za-z]-|[=<>!~]=|(?:^|\W)[vV])$")  # novas-3.1.1.3, ==3.1.1.3, v3.1.1.3
# A dotted quad that numbers a division of a text or a release is not an address. datatrove (formatters/pii.py)
# replaces every public quad, and Presidio's IpRecognizer scores a bare one 0.6 and raises it when a context word
# ("ip", "ipv4") comes before it; neither has the opposite, a word before it that says it is not an address, which
# reference text needs (the PostgreSQL manual: "see Section 4.1.2.7"; ACPI notes: "Section 5.2.11.1"). So a quad
# is left alone when, within the 80 characters before it, such a word precedes it, directly or through a list of
# numbers ("Sections 4.4.6.4 and 8.12.1.4"), or when it opens a numbered heading (`_HEADING`).
_NUMBERING_WORDS = (
    "sections?", "sect", "secs?", "chapters?", "chap", "ch", "tables?", "figures?", "figs?", "examples?", "appendix",
    "appendices", "annex(?:es)?", "clauses?", "paragraphs?", "paras?", "steps?", "equations?", "eqs?", "listings?",
    "versions?", "vers?", "releases?", "revisions?", "revs?", "firmware", "builds?",
)
_NUMBERING_CUE = re.compile(
    rf"(?:(?<!\w)(?:{'|'.join(_NUMBERING_WORDS)})\.?|§§?)[\s(\"'\u201c*_]*"
    r"(?:\d+(?:\.\d+)*[.)\"'\u201d*_]*\s*(?:,|and|or|to|through|&|-|\u2013)\s*)*$",
    re.I,
)
# A numbered heading: the quad starts its line (after spaces or an opening quote) and a capitalised title follows
# it, and the line is marked as a heading: Markdown's '#'s before it, a dot after the number ("4.1.2.7. Constants",
# as DocBook numbers them), or a reStructuredText underline on the next line ("2.1.1.2 Timestamp types" over
# "~~~~"). A host list ("1.1.1.1 Cloudflare") has none of those marks.
_HEADING_BEFORE = re.compile(r"(?:^|\n)[ \t]*(#+[ \t]*)?[\"'\u201c]?$")
_HEADING_AFTER = re.compile(r"(\.)?[ \t]+[A-Z][^\n]*(\n[ \t]*([^\w\s])\3{2,}[ \t]*(?:\n|$))?")


def numbers_a_division(text: str, start: int, end: int) -> bool:
    """Whether the dotted quad text[start:end] is a section, table, heading or release number, not an address."""
    before = text[max(0, start - 80) : start]
    if _NUMBERING_CUE.search(before):
        return True
    head, title = _HEADING_BEFORE.search(before), _HEADING_AFTER.match(text, end)
    return bool(head and title and (head.group(1) or title.group(1) or title.group(2)))
_DECIMAL = re.compile(r"\d+[.,]\d+")
_ISBN = re.compile(r"ISBN(?:-1[03])?:?\s*$")


def _pattern_spans(pattern: re.Pattern, *cues: str):
    """A detector that replaces every match of `pattern`; the regex runs only when the text holds a cue."""

    def spans(text: str, cfg):
        if cues and not any(c in text for c in cues):
            return
        for m in pattern.finditer(text):
            yield m.start(), m.end(), True

    return spans


email_spans = _pattern_spans(_EMAIL, "@")


def ipv4_spans(text: str, cfg):
    for m in _IPV4.finditer(text):
        if _VERSION_CUE.search(text[max(0, m.start() - 2) : m.start()]) or numbers_a_division(text, *m.span(1)):
            continue
        replace = not cfg.ipv4_public_only or ipaddress.IPv4Address(m.group(1)).is_global
        yield m.start(), m.end(), replace


def phone_spans(text: str, cfg):
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


# --------------------------------------------------------------------------------------------------
# IPv6: a colon-hex candidate, validated by ipaddress. At least 3 non-empty groups, so slices such as
# `a[1::2]` and C++ scopes are not addresses; clock times (14:30:45) and MACs fail validation.

_IPV6 = re.compile(r"(?<![\w:.])[0-9A-Fa-f]{0,4}(?::[0-9A-Fa-f]{0,4}){2,7}(?:\.\d{1,3}){0,3}(?![\w.:]?\w)")


def ipv6_spans(text: str, cfg):
    if "::" not in text and text.count(":") < 7:
        return
    for m in _IPV6.finditer(text):
        cand, end = m.group(0), m.end()
        if cand.endswith(":") and not cand.endswith("::"):
            cand, end = cand[:-1], end - 1
        if sum(1 for g in re.split(r"[:.]", cand) if g) < 3:
            continue
        try:
            addr = ipaddress.IPv6Address(cand)
        except ValueError:
            continue
        yield m.start(), end, not cfg.ipv6_public_only or addr.is_global


# --------------------------------------------------------------------------------------------------
# payment cards: 13-19 digits, bare or in groups split by one kind of separator (4-4-4-4, 4-6-5, 4-4-4-4-3,
# 4-4-4-1), an issuer prefix whose length fits (Visa 4: 13/16/19; Mastercard 51-55 and 2221-2720: 16; Amex 34/37:
# 15; Diners 30/36/38: 14-16; JCB 35, Maestro 50/56-59, Discover/UnionPay 6: 16-19), Luhn-valid. ISBN-13s start
# with 9, Wayback/compact timestamps (20180410025338) with 19/20 and 14 digits, so neither fits. Not inside a URL
# path or a longer grouped number. A card-shaped number that fails stays and shields its digits.

_CARD = re.compile(r"(?<![\w.,+/-])(?:\d{13,19}|\d{4}([ -])\d{3,6}(?:\1\d{3,6}){0,2}\1\d{1,6})(?![\w/]|[.,-]\d|\1\d)")


def issuer_ok(d: str) -> bool:
    n = len(d)
    if d[0] == "4":
        return n in (13, 16, 19)
    if d[:2] in ("51", "52", "53", "54", "55") or 2221 <= int(d[:4]) <= 2720:
        return n == 16
    if d[:2] in ("34", "37"):
        return n == 15
    if d[:2] in ("30", "36", "38"):
        return 14 <= n <= 16
    return (d[:2] in ("35", "50", "56", "57", "58", "59") or d[0] == "6") and n >= 16


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def card_spans(text: str, cfg):
    for m in _CARD.finditer(text):
        digits = re.sub(r"\D", "", m.group(0))
        if not 13 <= len(digits) <= 19:
            continue
        if _ISBN.search(text[max(0, m.start() - 12) : m.start()]):
            continue
        yield m.start(), m.end(), issuer_ok(digits) and luhn_ok(digits)


# --------------------------------------------------------------------------------------------------
# IBAN: country code, 2 check digits, BBAN; compact or in groups of 4; length per country (ISO 13616
# registry) and mod-97 == 1. An IBAN-shaped string with a bad checksum stays and shields.

IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BR": 29, "BY": 28,
    "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DK": 18, "DO": 28, "EE": 20, "EG": 29, "ES": 24, "FI": 18,
    "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23, "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22,
    "IL": 23, "IQ": 23, "IS": 26, "IT": 27, "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20,
    "LU": 20, "LV": 21, "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MR": 27, "MT": 31, "MU": 30, "NL": 18, "NO": 15,
    "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "SA": 24, "SC": 31, "SE": 24, "SI": 19,
    "SK": 24, "SM": 27, "ST": 25, "SV": 28, "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20,
}
_IBAN_START = re.compile(r"(?<![A-Za-z0-9])([A-Z]{2})\d{2}(?=[ ]?[A-Z0-9])")


def iban_ok(iban: str) -> bool:
    s = iban[4:] + iban[:4]
    return int("".join(str(int(c, 36)) for c in s)) % 97 == 1


def iban_spans(text: str, cfg):
    for m in _IBAN_START.finditer(text):
        want = IBAN_LENGTHS.get(m.group(1))
        if want is None:
            continue
        chars, i = [], m.start()
        while i < len(text) and len(chars) < want:
            c = text[i]
            if c.isascii() and (c.isupper() or c.isdigit()):
                chars.append(c)
            elif not (c == " " and len(chars) % 4 == 0 and i + 1 < len(text) and text[i + 1] != " "):
                break  # spaces only between groups of 4
            i += 1
        if len(chars) != want or (i < len(text) and text[i].isalnum()):
            continue
        yield m.start(), i, iban_ok("".join(chars))


# --------------------------------------------------------------------------------------------------
# US SSN: AAA-GG-SSSS; area 000, 666 and 900-999, group 00 and serial 0000 are never issued (SSA). A
# never-issued one stays but shields its digits (the phone matcher would read 052-00-2608 as a number).

_SSN_SHAPE = re.compile(r"(?<![\w-])\d{3}-\d{2}-\d{4}(?![\w]|-\d)")
_SSN_VALID = re.compile(r"(?!000|666|9\d\d)\d{3}-(?!00)\d{2}-(?!0000)\d{4}")


def ssn_spans(text: str, cfg):
    for m in _SSN_SHAPE.finditer(text):
        yield m.start(), m.end(), bool(_SSN_VALID.fullmatch(m.group(0)))


# --------------------------------------------------------------------------------------------------
# ISBNs are never PII but look like phone and card numbers: a checksum-valid ISBN-10 written with hyphens
# or an ISBN-13 (978/979) shields its digits from every detector (scrub_text runs shields first).

_ISBN_CAND = re.compile(r"(?<![\w-])(?:97[89]-?\d{1,5}-?\d{1,7}-?\d{1,7}-?\d|\d{1,5}-\d{1,7}-\d{1,7}-[\dX])(?![\w-])")


def isbn_ok(s: str) -> bool:
    d = s.replace("-", "")
    if len(d) == 10 and d[:9].isdigit():
        return sum((10 - i) * (10 if c == "X" else int(c)) for i, c in enumerate(d)) % 11 == 0
    if len(d) == 13 and d.isdigit() and d[:3] in ("978", "979"):
        return sum(int(c) * (3 if i % 2 else 1) for i, c in enumerate(d)) % 10 == 0
    return False


def shield_spans(text: str):
    for m in _ISBN_CAND.finditer(text):
        if isbn_ok(m.group(0)):
            yield m.start(), m.end()


# --------------------------------------------------------------------------------------------------
# secrets

_PEM = re.compile(
    r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY-----"
    r"(?:.*?-----END (?:[A-Z0-9]+ )*PRIVATE KEY-----|(?:\s*[A-Za-z0-9+/=:,-]{16,})*)",  # truncated: its body
    re.S,
)
_AWS_ID = re.compile(r"(?<![A-Za-z0-9])(?:AKIA|ASIA)[A-Z0-9]{16}(?![A-Za-z0-9])")
_AWS_SECRET = re.compile(
    r"(?i:aws_?secret(?:_?access)?_?key|secret_?access_?key)[\"']?\s*[:=]\s*[\"']?([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+])"
)
_GITHUB = re.compile(
    r"(?<![A-Za-z0-9_])(?:gh[pousr]_[A-Za-z0-9]{36,255}|github_pat_[A-Za-z0-9_]{22,255})(?![A-Za-z0-9_])"
)
_SECRET_KW = re.compile(
    r"(?i:(?:password|passwd|pwd|passphrase|secret|token|api[_-]?key|access[_-]?key|auth[_-]?key|credentials?)"
    r"[\w-]*)[\"']?\s*(?:[:=]|=>)\s*[\"']?([A-Za-z0-9+/=_.~!#$%^&*-]+)"
)


private_key_spans = _pattern_spans(_PEM, "PRIVATE KEY-----")


def aws_key_spans(text: str, cfg):
    for m in _AWS_ID.finditer(text):
        yield m.start(), m.end(), True
    for m in _AWS_SECRET.finditer(text):
        yield m.start(1), m.end(1), True


github_token_spans = _pattern_spans(_GITHUB, "gh", "github_pat_")


def shannon_entropy(s: str) -> float:
    """Bits per character of the string's own character distribution."""
    n = len(s)
    return -sum(c / n * math.log2(c / n) for c in Counter(s).values()) if n else 0.0


def secret_spans(text: str, cfg):
    """The value after a key word (password=, secret:, token=, api_key...) when it looks random: long enough,
    entropy at least `secret_min_entropy` (detect-secrets style), letters mixed with digits or with upper and lower
    case mixed throughout (a quarter to three quarters upper case, so CamelCaseNames and CONSTANTS are not)."""
    for m in _SECRET_KW.finditer(text):
        value = m.group(1).rstrip(".,;")
        letters = [c for c in value if c.isalpha()]
        upper = sum(c.isupper() for c in letters) / len(letters) if letters else 0.0
        if (len(value) >= cfg.secret_min_length and letters and (re.search(r"\d", value) or 0.25 <= upper <= 0.75)
                and shannon_entropy(value) >= cfg.secret_min_entropy):
            yield m.start(1), m.start(1) + len(value), True


DETECTORS = {
    "email": email_spans, "ipv4": ipv4_spans, "phone": phone_spans, "ipv6": ipv6_spans,
    "credit_card": card_spans, "iban": iban_spans, "ssn": ssn_spans, "aws_key": aws_key_spans,
    "github_token": github_token_spans, "private_key": private_key_spans, "secret": secret_spans,
}
# Overlaps go to the earlier type: a key block or token before anything found inside it, an e-mail before the
# digits in it, IPv6 before the IPv4 it embeds, cards/IBANs/SSNs before the phone matcher.
PRIORITY = ("private_key", "aws_key", "github_token", "secret", "email", "ipv6", "ipv4", "iban", "credit_card",
            "ssn", "phone")
