"""Privacy scrub: each PII type replaced and counted, lookalikes left alone, and the stage on disk."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from pydantic import ValidationError

from lifecycle.core.dataset import DOC_SCHEMA
from lifecycle.tasks.data.scrub.stage import PII_TYPES, ScrubConfig, run_scrub, scrub_table, scrub_text
from tests.conftest import docs_table, make_collect

CFG = ScrubConfig()
ZERO = {k: 0 for k in PII_TYPES}


def found(counts: dict) -> dict:
    """The non-zero counts only."""
    return {k: n for k, n in counts.items() if n}


# --------------------------------------------------------------------------------------------------
# each type is replaced and counted


def test_email():
    text = "Write to guido.van-rossum+py@mail.python.org or <fdrake@acm.org>."
    assert scrub_text(text, CFG) == ("Write to <EMAIL> or <<EMAIL>>.", {**ZERO, "email": 2})


def test_public_ipv4():
    out, counts = scrub_text("resolver 8.8.8.8, mirror at 151.101.0.223:443.", CFG)
    assert out == "resolver <IPV4>, mirror at <IPV4>:443."
    assert counts["ipv4"] == 2


@pytest.mark.parametrize(
    "number",
    [
        "+1 (650) 253-0000",  # international, any region finds it
        "(650) 253-0000",  # US national
        "650.253.0000",
        "+44 20 7946 0958",
        "020 7946 0958",  # GB national
        "030 901820",  # DE national
        "01 42 68 53 00",  # FR national
        "+33 1 42 68 53 00",
    ],
)
def test_phone_numbers(number):
    out, counts = scrub_text(f"Call {number} today.", CFG)
    assert out == "Call <PHONE> today."
    assert counts["phone"] == 1


def test_counts_several_types_in_one_text():
    text = "Ping 8.8.4.4, mail ops@example.com, call +1 650-253-0000, or ops2@example.com."
    out, counts = scrub_text(text, CFG)
    assert out == "Ping <IPV4>, mail <EMAIL>, call <PHONE>, or <EMAIL>."
    assert found(counts) == {"email": 2, "ipv4": 1, "phone": 1}


def test_higher_priority_match_shields_its_digits():
    # the phone number inside the address is part of the e-mail, counted once, as an e-mail
    out, counts = scrub_text("sales.650-253-0000@example.com", CFG)
    assert (out, counts) == ("<EMAIL>", {**ZERO, "email": 1})


@pytest.mark.parametrize(
    "kind, value",
    [
        ("ipv6", "2a00:1450:4009:80b::200e"),
        ("ipv6", "2001:4860:4860:0000:0000:0000:0000:8888"),
        ("ipv6", "::ffff:8.8.8.8"),
        ("credit_card", "4111 1111 1111 1111"),  # Visa test number
        ("credit_card", "5500-0000-0000-0004"),  # Mastercard
        ("credit_card", "378282246310005"),  # Amex, bare
        ("credit_card", "3782 822463 10005"),  # Amex 4-6-5
        ("iban", "DE89 3704 0044 0532 0130 00"),
        ("iban", "GB82WEST12345698765432"),
        ("iban", "FR14 2004 1010 0505 0001 3M02 606"),
        ("ssn", "123-45-6789"),
        ("aws_key", "AKIAIOSFODNN7EXAMPLE"),
        ("aws_key", "ASIAY34FZKBOKMUTVV7A"),
        ("github_token", "ghp_" + "A1b2C3d4E5" * 3 + "f6G7h8"),
        ("github_token", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ0123456789abcdefghijklm"),
        ("private_key", "-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\n"
                        "AAAAAAAAABAAAAMwAAAAtzc2gtZWQyNTUxOQ==\n-----END OPENSSH PRIVATE KEY-----"),
    ],
)
def test_new_types(kind, value):
    out, counts = scrub_text(f"Use {value} here.", CFG)
    assert (out, found(counts)) == (f"Use <{kind.upper()}> here.", {kind: 1})


@pytest.mark.parametrize(
    "text, expected",
    [
        ("aws_secret_access_key = wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "aws_secret_access_key = <AWS_KEY>"),
        ('"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"', '"AWS_SECRET_ACCESS_KEY": "<AWS_KEY>"'),
        ("password=Xk9mQ2vLp8sR4tZw", "password=<SECRET>"),
        ("api_key: 'a8f5f167f44f4964e6c998dee827110c'", "api_key: '<SECRET>'"),
        ("export GITLAB_TOKEN=glpat-x7Yq2ZrT9vKp3LmN8sWd, then", "export GITLAB_TOKEN=<SECRET>, then"),
    ],
)
def test_secrets_after_key_words_keep_the_key_word(text, expected):
    assert scrub_text(text, CFG)[0] == expected


# --------------------------------------------------------------------------------------------------
# lookalikes are left alone


@pytest.mark.parametrize(
    "text",
    [
        "Python 3.11.2 was released on 2023-02-08 at 14:30:45.",
        "sys.maxsize on 32-bit builds is 2147483647; 10,000,000 and 1,234,567,890 are integers.",
        "math.pi is 3.14159265359 and 1/7 is 0.142857143.",
        "Dates: 07/02/2023, 2023-02-07T21:27:03.994956, Feb 7 2023.",
        "ISBN 0-596-00797-3, port 8080, bpo-16499, gh-101234.",
        "loopback 127.0.0.1, LAN 192.168.0.1, any 0.0.0.0, docs 192.0.2.1 and 203.0.113.7",
        "a five-part version 1.2.3.4.5 and a tarball pkg-1.2.3.4.tar.gz",
        "pins: novas-3.1.1.3 novas==3.1.1.3 v1.2.3.4",
        "requirements: pkg@1.2.3, a decorator @property and a matrix a @ b",
        "call 6502530000",  # an unformatted digit run reads as an integer (see phone_bare_digits)
        "card 4111 1111 1111 1112 fails Luhn, so does 5500-0000-0000-0005",
        "ISBN 978-0-596-00797-3 and ISBN-13: 9780596007973, or bare 0-596-00797-3",
        "https://web.archive.org/web/20180410025338/http://example.org and build 20180410025338",
        "bad checksum DE89 3704 0044 0532 0130 01, GB00WEST12345698765432",
        "never issued: 000-12-3456, 666-12-3456, 912-12-3456, 123-00-4567, 123-45-0000",
        "uuid 123e4567-e89b-12d3-a456-426614174000, git 3f786850e387550fdab836ed7e6dc881de23001b",
        "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 and ab12cd3",
        "times 14:30:45, MAC 00:1a:2b:3c:4d:5e, slice a[1::2], std::vector, loopback ::1, fe80::1, 2001:db8::1",
        "token = tokens[0]; password = getpass.getpass(); secret: see secrets.token_hex(16)",
        "password=hunter2 and token=aaaaaaaaaaaaaaaa1",  # short, or not random
    ],
)
def test_lookalikes_untouched(text):
    assert scrub_text(text, CFG) == (text, ZERO)


@pytest.mark.parametrize(
    "text",
    [
        "constants discussed in Section 4.1.2.7. The constant is",  # the PostgreSQL manual's cross-references
        "(see\n        Section 25.1.5.1).",
        "the standard's section 4.4.3.2 or the alternative format",
        "DSDT   Section 5.2.11.1 (signature == \"DSDT\")",  # the ACPI table notes of the kernel docs
        "Streams are defined in sections 4.4.6.4 and 8.12.1.4 of the USB 3.0 spec",  # a list after one word
        "as in Table 36.1.2.3, Figure 8.4.7.1 and Example 9.16.2.2; see \u00a7 5.8.1.2 and chapter 13.15.2.3",
        "Version 1.9.4.1\n---------------\n* Bug fixes.",  # a changelog heading
        "the database was created using version 1.2.3.4, but the system provides version 2.3.4.5",
        "\n2.1.1.2 Timestamp types\n~~~~~~~~~~~~~~~~~~~~~~~\n",  # a numbered reStructuredText heading
        "4.1.2.7. Constants of Other Types\n",  # a DocBook heading: a dot after the number
        "## 4.1.2.7 Constants\n",  # a Markdown heading
    ],
)
def test_section_and_release_numbers_are_not_addresses(text):
    assert scrub_text(text, CFG) == (text, ZERO)


@pytest.mark.parametrize(
    "text, scrubbed",
    [
        ("ping 8.8.8.8 (see Section 4.2)", "ping <IPV4> (see Section 4.2)"),  # the word comes after it
        ("Table 3 lists 8.8.8.8 as the resolver", "Table 3 lists <IPV4> as the resolver"),  # not a list of numbers
        ("resolvers:\n1.1.1.1 Cloudflare\n8.8.8.8 Google", "resolvers:\n<IPV4> Cloudflare\n<IPV4> Google"),
        ("mount //9.53.216.11/e$ /mnt", "mount //<IPV4>/e$ /mnt"),
    ],
)
def test_addresses_beside_numbering_words_are_still_replaced(text, scrubbed):
    assert scrub_text(text, CFG)[0] == scrubbed


# --------------------------------------------------------------------------------------------------
# options


def test_private_addresses_are_replaced_when_asked():
    out, counts = scrub_text("bind 127.0.0.1 and 192.168.0.1", ScrubConfig(ipv4_public_only=False))
    assert out == "bind <IPV4> and <IPV4>"
    assert counts["ipv4"] == 2


def test_bare_digits_option():
    out, counts = scrub_text("call 6502530000 now", ScrubConfig(phone_bare_digits=True))
    assert (out, counts["phone"]) == ("call <PHONE> now", 1)


def test_regions_decide_national_formats():
    intl_only = ScrubConfig(phone_regions=())
    assert scrub_text("+44 20 7946 0958", intl_only)[0] == "<PHONE>"
    assert scrub_text("020 7946 0958", intl_only)[0] == "020 7946 0958"
    assert scrub_text("020 7946 0958", ScrubConfig(phone_regions=("GB",)))[0] == "<PHONE>"


def test_disabled_types_are_left_and_not_counted():
    text = "mail a@example.com, ping 8.8.8.8, call +1 650-253-0000"
    only_ipv4 = ScrubConfig(**{k: k == "ipv4" for k in PII_TYPES})
    out, counts = scrub_text(text, only_ipv4)
    assert out == "mail a@example.com, ping <IPV4>, call +1 650-253-0000"
    assert counts == {"ipv4": 1}


def test_public_only_ipv6_option():
    text = "bind fe80::1:2 and 2001:db8::8:1, not ::1 (fewer than 3 groups: read as a slice, never an address)"
    assert scrub_text(text, CFG)[0] == text
    out, counts = scrub_text(text, ScrubConfig(ipv6_public_only=False))
    assert counts["ipv6"] == 2
    assert out == "bind <IPV6> and <IPV6>, not ::1 (fewer than 3 groups: read as a slice, never an address)"


def test_secret_thresholds_are_configurable():
    text = "password=Xk9mQ2vLp8sR4tZw"
    assert scrub_text(text, ScrubConfig(secret_min_length=17))[0] == text
    assert scrub_text(text, ScrubConfig(secret_min_entropy=4.5))[0] == text
    assert scrub_text("password=hunter22", ScrubConfig(secret_min_length=6, secret_min_entropy=2.5))[0] == \
        "password=<SECRET>"


def test_custom_placeholder():
    assert scrub_text("a@example.com", ScrubConfig(placeholder="[{kind}]"))[0] == "[EMAIL]"


def test_config_is_validated_frozen_and_closed():
    with pytest.raises(ValidationError, match="placeholder"):
        ScrubConfig(placeholder="<{type}>")
    with pytest.raises(ValidationError, match="placeholder"):
        ScrubConfig(placeholder="")
    with pytest.raises(ValidationError, match="XX"):
        ScrubConfig(phone_regions=("US", "XX"))
    with pytest.raises(ValidationError):
        ScrubConfig(phone_leniency="LOOSE")
    with pytest.raises(ValidationError, match="max_pii_per_doc"):
        ScrubConfig(max_pii_per_doc=-1)
    with pytest.raises(ValidationError):
        ScrubConfig(emails=True)
    with pytest.raises(ValidationError):
        CFG.email = False
    assert all(f.description for f in ScrubConfig.model_fields.values())


# --------------------------------------------------------------------------------------------------
# table function and the stage


def test_scrub_table_keeps_every_row_and_adds_counts():
    texts = ["mail a@example.com and b@example.org", "nothing here but 3.11.2", "ping 8.8.8.8, call +44 20 7946 0958"]
    out, rejected, stats = scrub_table(docs_table(texts), CFG)
    assert rejected.num_rows == 0
    assert out.column_names == DOC_SCHEMA.names + [f"pii_{k}" for k in PII_TYPES]
    assert out.column_names[len(DOC_SCHEMA):len(DOC_SCHEMA) + 3] == ["pii_email", "pii_ipv4", "pii_phone"]
    assert out.schema.field("pii_email").type == pa.int32()
    assert out.column("doc_id").to_pylist() == ["d0", "d1", "d2"]
    assert out.column("text").to_pylist() == [
        "mail <EMAIL> and <EMAIL>", "nothing here but 3.11.2", "ping <IPV4>, call <PHONE>"]
    assert out.column("pii_email").to_pylist() == [2, 0, 0]
    assert out.column("pii_ipv4").to_pylist() == [0, 0, 1]
    assert out.column("pii_phone").to_pylist() == [0, 0, 1]
    assert (stats.rows_in, stats.rows_kept, stats.rows_rejected) == (3, 3, 0)
    assert dict(stats.counters) == {"pii_email": 2, "pii_ipv4": 1, "pii_phone": 1, "docs_with_pii": 2}
    assert stats.bytes_in == sum(len(t.encode()) for t in texts)
    assert stats.bytes_out == sum(len(t.encode()) for t in out.column("text").to_pylist())


def test_pii_dense_document_is_kept_and_redacted_by_default():
    """A page listing its maintainers' addresses loses the addresses, not the page (datatrove's PIIFormatter)."""
    maintainers = "Maintainers:\n" + "\n".join(f"M: Dev {i} <dev{i}@example.com>" for i in range(8))
    out, rejected, stats = scrub_table(docs_table([maintainers, "plain"]), CFG)
    assert CFG.max_pii_per_doc is None and rejected.num_rows == 0 and stats.rejected == {}
    assert out.column("doc_id").to_pylist() == ["d0", "d1"]
    assert out.column("text")[0].as_py() == "Maintainers:\n" + "\n".join(f"M: Dev {i} <<EMAIL>>" for i in range(8))
    assert out.column("pii_email").to_pylist() == [8, 0]  # still counted per type
    assert stats.counters["pii_email"] == 8 and stats.counters["docs_with_pii"] == 1


def test_pii_dense_document_is_rejected_with_counts_only_when_asked():
    dense = "contacts: " + ", ".join(f"user{i}@example.com" for i in range(5)) + ", call +1 650-253-0000"
    texts = ["five is fine: " + ", ".join(f"u{i}@example.com" for i in range(5)), dense, "plain"]
    out, rejected, stats = scrub_table(docs_table(texts), ScrubConfig(max_pii_per_doc=5))  # Dolma's threshold
    assert out.column("doc_id").to_pylist() == ["d0", "d2"]
    assert out.column("pii_email").to_pylist() == [5, 0]
    assert rejected.column("doc_id").to_pylist() == ["d1"]
    assert rejected.column("source_id").to_pylist() == ["src-d1"]
    assert rejected.column("stage").to_pylist() == ["scrub"]
    assert rejected.column("reason").to_pylist() == ["too_much_pii"]
    detail = json.loads(rejected.column("detail")[0].as_py())
    assert detail == {"pii_total": 6, "max_pii_per_doc": 5, "email": 5, "phone": 1}
    assert "example.com" not in rejected.column("detail")[0].as_py()  # counts only, never values
    assert (stats.rows_in, stats.rows_kept, stats.rows_rejected) == (3, 2, 1)
    assert stats.rejected == {"too_much_pii": 1}
    assert stats.counters["pii_email"] == 10 and stats.counters["docs_with_pii"] == 2
    assert stats.bytes_out == sum(len(t.encode()) for t in out.column("text").to_pylist())

    out, rejected, _ = scrub_table(docs_table(texts), ScrubConfig(max_pii_per_doc=None))
    assert out.num_rows == 3 and rejected.num_rows == 0
    out, rejected, _ = scrub_table(docs_table(texts), ScrubConfig(max_pii_per_doc=0))
    assert out.column("doc_id").to_pylist() == ["d2"] and rejected.num_rows == 2


def test_disabled_type_column_is_null_not_zero():
    out, _, _ = scrub_table(docs_table(["a@example.com"]), ScrubConfig(email=False))
    assert out.column("pii_email").to_pylist() == [None]
    assert out.column("pii_ipv4").to_pylist() == [0]


def test_scrubbing_twice_is_an_error():
    once, _, _ = scrub_table(docs_table(["a@example.com"]), CFG)
    with pytest.raises(ValueError, match="pii_email"):
        scrub_table(once, CFG)


def test_run_scrub_keeps_every_row_and_reuses(tmp_path):
    parent = make_collect(tmp_path, [
        docs_table(["mail a@example.com", "plain text"], prefix="a"),
        docs_table(["call +1 650-253-0000 or 8.8.8.8"], prefix="b"),
    ])
    ref = run_scrub(parent, CFG, str(tmp_path))
    assert not ref.reused
    manifest = ref.manifest()
    assert ref.num_rows == parent.num_rows == 3
    assert manifest["num_rejected"] == 0 and manifest["rejected"] == []
    assert manifest["stats"]["counters"] == {"docs_with_pii": 2, "pii_email": 1, "pii_ipv4": 1, "pii_phone": 1}
    table = ref.read()
    assert table.column("text").to_pylist() == ["mail <EMAIL>", "plain text", "call <PHONE> or <IPV4>"]

    strict = run_scrub(parent, ScrubConfig(max_pii_per_doc=0), str(tmp_path))
    m = strict.manifest()
    assert strict.num_rows == 1 and m["num_rejected"] == 2
    assert m["stats"]["rows_in"] == 3 and m["stats"]["rejected_by_reason"] == {"too_much_pii": 2}
    assert sorted(strict.read_rejected().column("doc_id").to_pylist()) == ["a0", "b0"]

    again = run_scrub(parent, CFG, str(tmp_path))
    assert again.reused and again.path == ref.path and again.sha256 == ref.sha256
    assert run_scrub(parent, ScrubConfig(ipv4=False), str(tmp_path)).path != ref.path


def test_no_planted_value_survives_the_stage(tmp_path):
    """A stage-level canary: values of every type go in, and no kept text, rejected row or manifest holds one."""
    values = ["canary.7f3a@example.com", "81.2.69.160", "+44 20 7946 0958", "2a00:1450:4009:80b::200e",
              "4111 1111 1111 1111", "DE89 3704 0044 0532 0130 00", "123-45-6789", "AKIAIOSFODNN7EXAMPLE",
              "ghp_" + "Zq8" * 12, "MIIEowIBAAKCAQEAcanary", "Xk9mQ2vLp8sR4tZwcanary"]
    texts = [f"one: {values[0]}, {values[1]}, {values[2]}",
             f"two: {values[3]}; {values[4]}; {values[5]}; {values[6]}",
             f"three: {values[7]} token={values[8]}\n-----BEGIN PRIVATE KEY-----\n{values[9]}\n"
             f"-----END PRIVATE KEY-----\npassword={values[10]}",
             "dense: " + ", ".join(values)]  # 11 hits: rejected (max_pii_per_doc=5), and its counts only recorded
    ref = run_scrub(make_collect(tmp_path, [docs_table(texts)]), ScrubConfig(max_pii_per_doc=5), str(tmp_path))
    kept, rejected = ref.read(), ref.read_rejected()
    assert kept.column("doc_id").to_pylist() == ["d0", "d1", "d2"]
    assert rejected.column("reason").to_pylist() == ["too_much_pii"]
    everything = "\n".join(kept.column("text").to_pylist() + rejected.column("detail").to_pylist())
    everything += ref.manifest_path.read_text()
    assert [v for v in values if v in everything] == []
    counters = ref.manifest()["stats"]["counters"]
    # the dense page's bare key body and bare random string are not secrets without their BEGIN line / key word
    assert counters["pii_private_key"] == 1 and counters["pii_secret"] == 1 and counters["pii_email"] == 2
    assert json.loads(rejected.column("detail")[0].as_py())["pii_total"] == 9

    by_default = run_scrub(make_collect(tmp_path, [docs_table(texts)]), CFG, str(tmp_path))  # kept, redacted
    assert by_default.read().column("doc_id").to_pylist() == ["d0", "d1", "d2", "d3"]
    kept_text = "\n".join(by_default.read().column("text").to_pylist())
    assert [v for v in values if v in kept_text] == values[9:]  # the bare key body and string of the dense page


def test_detector_module_is_part_of_the_code_version():
    """Editing a detector must invalidate committed scrub outputs: the scrub folder's code version covers it."""
    from lifecycle.core.code import source_files

    files = source_files("lifecycle.tasks.data.scrub")
    assert files["lifecycle.tasks.data.scrub/detectors.py"].name == "detectors.py"
    assert "lifecycle.tasks.data.scrub/stage.py" in files
