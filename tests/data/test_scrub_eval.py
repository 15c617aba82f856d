"""Scrub quality on a labelled evaluation set: generated PII and look-alikes planted in real paragraphs.

Each case is one real paragraph of the bundled corpus with one generated value inserted at a random word
boundary (fixed seed). A PII value is found when its text is gone and its type's count rose; a look-alike
is altered when its text is changed or any count rose. Goals (issue 3): recall >= 0.99 per structured type,
>= 0.95 for phones, <= 1% of look-alikes altered. `pytest -s tests/test_scrub_eval.py` prints the figures.
"""

from __future__ import annotations

import functools
import ipaddress
import random
import string
import uuid

import phonenumbers
import pytest

from lifecycle.tasks.data.scrub.detectors import IBAN_LENGTHS, luhn_ok
from lifecycle.tasks.data.scrub.stage import PII_TYPES, ScrubConfig, scrub_text
from tests.conftest import corpus_records

SEED = 20261122
PER_TYPE = 200
CFG = ScrubConfig()
ALNUM = string.ascii_letters + string.digits
B64 = ALNUM + "+/"


# --------------------------------------------------------------------------------------------------
# generators: each returns (planted text, the substring that must disappear)


def gen_email(r):
    first, last = r.choice(["jane", "li", "omar", "ana", "k", "priya"]), r.choice(["doe", "wei", "smith", "o-neil"])
    local = r.choice([f"{first}.{last}", f"{first}{r.randint(1, 999)}", f"{first}_{last}+news", first])
    domain = r.choice(["example", "mail", "uni-bonn", "acme-corp", "python"])
    domain += r.choice([".com", ".org", ".de", ".co.uk", ".io"])
    v = f"{local}@{r.choice(['', 'lists.'])}{domain}"
    return v, v


def gen_phone(r):
    region = r.choice(["US", "GB", "DE", "FR"])
    example = phonenumbers.example_number(region)
    nsn = str(example.national_number)
    while True:
        digits = nsn[:2] + "".join(r.choice(string.digits) for _ in nsn[2:])
        num = phonenumbers.parse(digits, region)
        if phonenumbers.is_valid_number(num):
            break
    fmt = r.choice([phonenumbers.PhoneNumberFormat.INTERNATIONAL, phonenumbers.PhoneNumberFormat.NATIONAL,
                    phonenumbers.PhoneNumberFormat.E164])
    v = phonenumbers.format_number(num, fmt)
    return v, v


def gen_ipv4(r):
    while True:
        a = ipaddress.IPv4Address(r.getrandbits(32))
        if a.is_global:
            return str(a), str(a)


def gen_ipv6(r):
    while True:
        a = ipaddress.IPv6Address((r.randint(0x2000, 0x3FFF) << 112) | r.getrandbits(112))
        if r.random() < 0.5:  # compressed forms with a run of zero groups
            a = ipaddress.IPv6Address(int(a) >> 64 << 64 | r.randint(1, 0xFFFF))
        if a.is_global:
            v = a.exploded if r.random() < 0.3 else a.compressed
            return v, v


def luhn_complete(body: str) -> str:
    return next(body + d for d in string.digits if luhn_ok(body + d))


CARD_PREFIXES = [("4", 16), ("4", 13), ("51", 16), ("55", 16), ("2221", 16), ("34", 15), ("37", 15),
                 ("6011", 16), ("65", 16), ("3528", 16), ("36", 14), ("62", 19)]


def card_format(r, digits: str) -> str:
    if r.random() < 0.3:
        return digits
    sep = r.choice([" ", "-"])
    if len(digits) == 15:
        return sep.join([digits[:4], digits[4:10], digits[10:]])
    return sep.join(digits[i : i + 4] for i in range(0, len(digits), 4))


def gen_card(r):
    prefix, n = r.choice(CARD_PREFIXES)
    v = card_format(r, luhn_complete(prefix + "".join(r.choice(string.digits) for _ in range(n - len(prefix) - 1))))
    return v, v


def iban_make(r, country: str, valid: bool = True) -> str:
    bban = "".join(r.choice(string.digits) for _ in range(IBAN_LENGTHS[country] - 4))
    if country in ("GB", "NL"):
        bban = "".join(r.choice(string.ascii_uppercase) for _ in range(4)) + bban[4:]
    check = 98 - int("".join(str(int(c, 36)) for c in bban + country + "00")) % 97
    if not valid:  # any other check number in 2..98 leaves a different remainder: mod 97 no longer 1
        check = r.choice([c for c in range(2, 99) if c != check])
    compact = f"{country}{check:02d}{bban}"
    return compact if r.random() < 0.4 else " ".join(compact[i : i + 4] for i in range(0, len(compact), 4))


def gen_iban(r):
    v = iban_make(r, r.choice(["DE", "GB", "FR", "NL", "ES", "IT", "CH", "AT", "BE", "PL"]))
    return v, v


def gen_ssn(r):
    area = r.choice([a for a in range(1, 900) if a != 666])
    v = f"{area:03d}-{r.randint(1, 99):02d}-{r.randint(1, 9999):04d}"
    return v, v


def gen_aws_key(r):
    if r.random() < 0.5:
        v = r.choice(["AKIA", "ASIA"]) + "".join(r.choice(string.ascii_uppercase + string.digits) for _ in range(16))
        return v, v
    secret = "".join(r.choice(B64) for _ in range(40))
    kw = r.choice(["aws_secret_access_key = ", "AWS_SECRET_ACCESS_KEY=", '"SecretAccessKey": "', "secret_access_key: "])
    return kw + secret, secret


def gen_github_token(r):
    if r.random() < 0.8:
        v = r.choice(["ghp_", "gho_", "ghu_", "ghs_", "ghr_"]) + "".join(r.choice(ALNUM) for _ in range(36))
    else:
        v = "github_pat_" + "".join(r.choice(ALNUM) for _ in range(22))
        v += "_" + "".join(r.choice(ALNUM) for _ in range(59))
    return v, v


def gen_private_key(r):
    kind = r.choice(["RSA ", "EC ", "OPENSSH ", "", "ENCRYPTED "])
    body = "\n".join("".join(r.choice(B64) for _ in range(64)) for _ in range(r.randint(2, 8)))
    v = f"-----BEGIN {kind}PRIVATE KEY-----\n{body}\n-----END {kind}PRIVATE KEY-----"
    return v, body


def gen_secret(r):
    kw = r.choice(["password", "PASSWORD", "db_password", "secret", "client_secret", "token", "auth_token",
                   "api_key", "API_KEY", "apikey", "access_token"])
    sep = r.choice(["=", ": ", " = ", '="', ": '"])
    value = "".join(r.choice(ALNUM + "-_") for _ in range(r.randint(20, 40)))
    return f"{kw}{sep}{value}", value


GENERATORS = {
    "email": gen_email, "phone": gen_phone, "ipv4": gen_ipv4, "ipv6": gen_ipv6, "credit_card": gen_card,
    "iban": gen_iban, "ssn": gen_ssn, "aws_key": gen_aws_key, "github_token": gen_github_token,
    "private_key": gen_private_key, "secret": gen_secret,
}
RECALL_GOAL = {k: 0.95 if k == "phone" else 0.99 for k in GENERATORS}
assert set(GENERATORS) == set(PII_TYPES)


def look_version(r):
    return r.choice([f"{r.randint(0, 9)}.{r.randint(0, 20)}.{r.randint(0, 30)}",
                     f"v{r.randint(1, 9)}.{r.randint(0, 9)}.{r.randint(0, 9)}.{r.randint(0, 99)}",
                     f"pkg=={r.randint(1, 3)}.{r.randint(0, 40)}.{r.randint(0, 9)}", f"Python 3.{r.randint(6, 13)}"])


def look_date(r):
    y, m, d = r.randint(1990, 2030), r.randint(1, 12), r.randint(1, 28)
    return r.choice([f"{y}-{m:02d}-{d:02d}", f"{d:02d}/{m:02d}/{y}", f"{m}/{d}/{y}", f"{d}.{m}.{y}",
                     f"{y}-{m:02d}-{d:02d}T{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}Z",
                     f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}:{r.randint(0, 59):02d}"])


def look_isbn(r):
    if r.random() < 0.5:
        body = [r.randint(0, 9) for _ in range(9)]
        c = (11 - sum((10 - i) * d for i, d in enumerate(body)) % 11) % 11
        digits = "".join(map(str, body)) + ("X" if c == 10 else str(c))
        s = f"{digits[0]}-{digits[1:4]}-{digits[4:9]}-{digits[9]}"
    else:
        body = [9, 7, r.choice([8, 9])] + [r.randint(0, 9) for _ in range(9)]
        c = (10 - sum(d * (3 if i % 2 else 1) for i, d in enumerate(body)) % 10) % 10
        digits = "".join(map(str, body)) + str(c)
        s = r.choice([digits, f"{digits[:3]}-{digits[3]}-{digits[4:7]}-{digits[7:12]}-{digits[12]}"])
    return r.choice(["ISBN ", "ISBN-13: ", "ISBN: ", ""]) + s


def look_hash(r):
    n = r.choice([7, 12, 32, 40, 64])
    h = "".join(r.choice("0123456789abcdef") for _ in range(n))
    return r.choice([h, h.upper() if n == 64 else h, f"sha256:{h}" if n == 64 else h])


def look_bad_card(r):
    prefix, n = r.choice(CARD_PREFIXES)
    good = luhn_complete(prefix + "".join(r.choice(string.digits) for _ in range(n - len(prefix) - 1)))
    bad = good[:-1] + str((int(good[-1]) + r.randint(1, 9)) % 10)
    return card_format(r, bad)


def look_bad_iban(r):
    return iban_make(r, r.choice(["DE", "GB", "FR", "NL", "ES", "IT"]), valid=False)


def look_uuid(r):
    u = str(uuid.UUID(int=r.getrandbits(128), version=4))
    return u.upper() if r.random() < 0.2 else u


def look_bad_ssn(r):
    area = r.choice(["000", "666", f"9{r.randint(0, 99):02d}", f"{r.randint(1, 665):03d}"])
    group = "00" if area.isdigit() and 0 < int(area) < 666 else f"{r.randint(1, 99):02d}"
    return f"{area}-{group}-{r.randint(1, 9999):04d}"


def look_code(r):
    return r.choice(["token = tokens[0]", "password = getpass.getpass()", "secret = secrets.token_hex(16)",
                     "api_key: str = None", "password=hunter2", "token = next(tokenize.generate_tokens(f.readline))",
                     "a[1::2]", "std::vector<int>", "MAC 00:1a:2b:3c:4d:5e", "AKIA is an AWS prefix"])


LOOKALIKES = {
    "version": look_version, "date_time": look_date, "isbn": look_isbn, "hex_hash": look_hash,
    "invalid_card": look_bad_card, "invalid_iban": look_bad_iban, "uuid": look_uuid, "invalid_ssn": look_bad_ssn,
    "code": look_code,
}


# --------------------------------------------------------------------------------------------------
# the evaluation set and its measurement


@functools.lru_cache(maxsize=1)
def paragraphs() -> list[str]:
    out = []
    for rec in corpus_records(400):
        out += [p.strip() for p in rec["text"].split("\n\n") if len(p.split()) >= 20]
    assert len(out) >= 200, "the bundled corpus should give at least 200 real paragraphs"
    return out


@functools.lru_cache(maxsize=None)
def base_counts(paragraph: str) -> dict:
    return scrub_text(paragraph, CFG)[1]


def plant(r: random.Random, paragraph: str, value: str) -> str:
    """Insert at a random word boundary, sometimes followed by punctuation."""
    spaces = [i for i, c in enumerate(paragraph) if c == " "]
    at = r.choice(spaces)
    return paragraph[:at] + " " + value + r.choice(["", "", ",", ".", ";"]) + paragraph[at:]


def measure() -> tuple[dict, dict, list]:
    r = random.Random(SEED)
    paras = paragraphs()
    recall, altered, misses = {}, {}, []
    for kind, gen in GENERATORS.items():
        hits = 0
        for _ in range(PER_TYPE):
            planted, must_go = gen(r)
            para = r.choice(paras)
            out, counts = scrub_text(plant(r, para, planted), CFG)
            ok = must_go not in out and counts[kind] > base_counts(para)[kind]
            hits += ok
            if not ok:
                i = out.find(must_go)
                misses.append((kind, out[max(0, i - 40) : i + len(must_go) + 40] if i >= 0 else planted))
        recall[kind] = hits / PER_TYPE
    for kind, gen in LOOKALIKES.items():
        changed = 0
        for _ in range(PER_TYPE):
            value = gen(r)
            para = r.choice(paras)
            text = plant(r, para, value)
            out, counts = scrub_text(text, CFG)
            bad = value not in out or counts != base_counts(para)
            changed += bad
            if bad:
                misses.append((kind, value))
        altered[kind] = changed / PER_TYPE
    return recall, altered, misses


@functools.lru_cache(maxsize=1)
def results():
    recall, altered, misses = measure()
    total_alt = sum(altered.values()) / len(altered)
    print(f"\nscrub evaluation: {PER_TYPE} planted values per type in real corpus paragraphs, seed {SEED}")
    for kind, v in recall.items():
        print(f"  recall {kind:<13} {v:.3f}  (goal >= {RECALL_GOAL[kind]})")
    for kind, v in altered.items():
        print(f"  look-alikes altered {kind:<13} {v:.3f}")
    print(f"  look-alikes altered, all {len(altered) * PER_TYPE}: {total_alt:.4f}  (goal <= 0.01)")
    for kind, value in misses[:20]:
        print(f"  miss/false hit [{kind}]: {value!r}")
    return recall, altered, total_alt


@pytest.mark.parametrize("kind", list(GENERATORS))
def test_recall_per_type(kind):
    recall, _, _ = results()
    assert recall[kind] >= RECALL_GOAL[kind], f"{kind}: recall {recall[kind]:.3f} < {RECALL_GOAL[kind]}"


def test_lookalikes_altered_at_most_one_percent():
    _, altered, total = results()
    assert total <= 0.01, f"{total:.4f} of look-alikes altered: {altered}"
    assert max(altered.values()) <= 0.03, altered  # no single family badly broken behind a good average


def test_evaluation_set_is_reproducible():
    r1, r2 = random.Random(SEED), random.Random(SEED)
    assert [gen_card(r1) for _ in range(5)] == [gen_card(r2) for _ in range(5)]
    assert all(luhn_ok(gen_card(r1)[0].replace(" ", "").replace("-", "")) for _ in range(50))
    assert not any(luhn_ok(look_bad_card(r1).replace(" ", "").replace("-", "")) for _ in range(50))


def test_real_documentation_has_no_cards_ibans_ssns_or_secrets():
    """Python's docs hold example e-mail and IP addresses but no cards, IBANs, SSNs, keys or tokens: every hit of
    those types there is a false positive (a scan of the whole bundled corpus once found a Wayback timestamp,
    20180410025338, read as a card: hence the issuer-length rule)."""
    found = {k: 0 for k in PII_TYPES}
    records = corpus_records(10_000)  # the whole first corpus file
    for rec in records:
        for kind, n in scrub_text(rec["text"], CFG)[1].items():
            found[kind] += n
    print(f"\nscrub hits on {len(records)} real documentation pages: {found}")
    structured = ("credit_card", "iban", "ssn", "aws_key", "github_token", "private_key", "secret")
    assert {k: found[k] for k in structured} == {k: 0 for k in structured}
