"""Privacy scrub: each PII type replaced and counted, lookalikes left alone, and the stage on disk."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pydantic import ValidationError

from lifecycle.dataset import DOC_SCHEMA, StageStats, materialize
from tasks.scrub import ScrubConfig, run_scrub, scrub_table, scrub_text

CFG = ScrubConfig()


def docs_table(texts: list[str], prefix: str = "d") -> pa.Table:
    n = len(texts)
    return pa.table(
        {
            "doc_id": [f"{prefix}{i}" for i in range(n)],
            "source_id": [f"src-{prefix}{i}" for i in range(n)],
            "text": texts,
            "source": ["test"] * n,
            "url": [None] * n,
            "meta": ["{}"] * n,
        },
        schema=DOC_SCHEMA,
    )


# --------------------------------------------------------------------------------------------------
# each type is replaced and counted


def test_email():
    text = "Write to guido.van-rossum+py@mail.python.org or <fdrake@acm.org>."
    assert scrub_text(text, CFG) == ("Write to <EMAIL> or <<EMAIL>>.", {"email": 2, "ipv4": 0, "phone": 0})


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
    assert counts == {"email": 2, "ipv4": 1, "phone": 1}


def test_higher_priority_match_shields_its_digits():
    # the phone number inside the address is part of the e-mail, counted once, as an e-mail
    out, counts = scrub_text("sales.650-253-0000@example.com", CFG)
    assert (out, counts) == ("<EMAIL>", {"email": 1, "ipv4": 0, "phone": 0})


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
    ],
)
def test_lookalikes_untouched(text):
    assert scrub_text(text, CFG) == (text, {"email": 0, "ipv4": 0, "phone": 0})


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
    out, counts = scrub_text(text, ScrubConfig(email=False, phone=False))
    assert out == "mail a@example.com, ping <IPV4>, call +1 650-253-0000"
    assert counts == {"ipv4": 1}


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
    with pytest.raises(ValidationError):
        ScrubConfig(emails=True)
    with pytest.raises(ValidationError):
        CFG.email = False
    assert all(f.description for f in ScrubConfig.model_fields.values())


# --------------------------------------------------------------------------------------------------
# table function and the stage


def test_scrub_table_keeps_every_row_and_adds_counts():
    texts = ["mail a@example.com and b@example.org", "nothing here but 3.11.2", "ping 8.8.8.8, call +44 20 7946 0958"]
    out, stats = scrub_table(docs_table(texts), CFG)
    assert out.column_names == DOC_SCHEMA.names + ["pii_email", "pii_ipv4", "pii_phone"]
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


def test_disabled_type_column_is_null_not_zero():
    out, _ = scrub_table(docs_table(["a@example.com"]), ScrubConfig(email=False))
    assert out.column("pii_email").to_pylist() == [None]
    assert out.column("pii_ipv4").to_pylist() == [0]


def test_scrubbing_twice_is_an_error():
    once, _ = scrub_table(docs_table(["a@example.com"]), CFG)
    with pytest.raises(ValueError, match="pii_email"):
        scrub_table(once, CFG)


def make_collect(workdir, tables: list[pa.Table]):
    def build(writer):
        for t in tables:
            writer.write_table(t)
        n = sum(t.num_rows for t in tables)
        return {"stats": StageStats(rows_in=n, rows_kept=n)}

    return materialize(workdir, "collect", {"fixture": "test_scrub"}, "test", build)


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

    again = run_scrub(parent, CFG, str(tmp_path))
    assert again.reused and again.path == ref.path and again.sha256 == ref.sha256
    assert run_scrub(parent, ScrubConfig(ipv4=False), str(tmp_path)).path != ref.path
