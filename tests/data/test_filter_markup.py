"""Gopher repetition on reStructuredText and Markdown: markup lines left out when asked (the techdocs preset asks),
and every drop's detail naming its value, its limit and, for n-gram rules, the n-gram."""

from __future__ import annotations

import pytest

from lifecycle.config import load_config
from lifecycle.tasks.data.filter.gopher_quality import GopherQualityConfig
from lifecycle.tasks.data.filter.gopher_repetition import GopherRepetitionConfig
from lifecycle.tasks.data.filter.rule import beyond
from lifecycle.tasks.data.filter.stage import FilterConfig, document_verdict
from tests import conftest

TECHDOCS = conftest.ROOT / "deploy" / "configs" / "techdocs.yaml"
SENTENCES = [
    "The scheduler picks the next task to run on each processor, and the rules below decide how long it may run.",
    "Each tunable lives in a file under the proc directory, and writing a number to it changes the behaviour at once.",
    "A lower latency target makes interactive programs respond faster but costs throughput on busy machines.",
    "Set the value with echo as root, then read it back to confirm that the kernel accepted the new setting.",
    "Values outside the documented range are rejected with an error, and the old value stays in force until reboot.",
    "Changes made this way are lost at the next boot unless a configuration file sets them again on start-up.",
]
RST = ("=============\nKernel tuning\n=============\n\n"
       + "".join(f"{title}\n{ch * len(title)}\n\n{s}\n\n"
                 for title, ch, s in zip(("Overview", "Tunables", "Latency", "Examples"), "==--", SENTENCES)))
MARKDOWN = "# Kernel tuning\n\n" + "\n\n* * *\n\n".join(SENTENCES) + "\n\n| a | b |\n|---|:-:|\n| 1 | 2 |\n"
TECHDOCS_REP = dict(dup_line_frac=0.7, dup_line_char_frac=0.3, top_ngram_char_frac=((2, 0.3), (3, 0.3), (4, 0.3)))


def test_heading_underlines_drop_a_well_formed_page_unless_markup_lines_are_skipped():
    assert GopherRepetitionConfig(**TECHDOCS_REP).reason(RST) == (
        "gopher_top_3_gram", 'top_3_gram_char_frac=0.3091 > 0.3, ngram="= = ="')
    assert GopherRepetitionConfig(**TECHDOCS_REP, skip_markup_lines=True).reason(RST) is None
    assert GopherRepetitionConfig(skip_markup_lines=True).reason(RST) is None  # Gopher's own limits too


def test_underline_characters_are_not_words_of_the_quality_rules_when_markup_lines_are_skipped():
    assert GopherQualityConfig().reason(RST) == ("gopher_alpha_ratio", "alpha_words=0.6194 < 0.8")
    assert GopherQualityConfig(skip_markup_lines=True).reason(RST) is None
    # the stage splits the text the rule reads: the same verdict as the rule's own split
    cfg = FilterConfig(rules=("language", "gopher_quality"),  # language splits nothing; gopher_quality the stage
                       gopher_quality=GopherQualityConfig(skip_markup_lines=True, min_alpha_words_ratio=0.99))
    assert document_verdict(RST, cfg)[0] == ("gopher_alpha_ratio", "alpha_words=0.9222 < 0.99")


def test_markdown_rules_and_table_rules_are_markup_lines():
    assert GopherRepetitionConfig().reason(MARKDOWN) == ("gopher_dup_para_frac", "dup_para_frac=0.3077 > 0.3")
    assert GopherRepetitionConfig(skip_markup_lines=True).reason(MARKDOWN) is None


def test_repeated_text_still_drops_with_markup_lines_skipped():
    spam = "Title\n=====\n\n" + "Buy cheap watches now, best prices online today.\n" * 10
    assert GopherRepetitionConfig(skip_markup_lines=True).reason(spam)[0] == "gopher_dup_line_frac"
    words = "Title\n=====\n\n" + " ".join(["buy cheap watches"] * 10 + SENTENCES[:1])
    code, detail = GopherRepetitionConfig(skip_markup_lines=True).reason(words)
    assert code == "gopher_top_2_gram" and detail.endswith(', ngram="buy cheap"'), detail
    assert GopherRepetitionConfig(skip_markup_lines=True).reason("=====\n----\n") == ("gopher_rep_empty", "empty text")


def test_the_techdocs_preset_keeps_restructuredtext_and_skips_its_markup():
    cfg = load_config(str(TECHDOCS), []).filter
    assert cfg.gopher_repetition.skip_markup_lines and cfg.gopher_quality.skip_markup_lines
    assert document_verdict(RST, cfg)[0] is None


def test_dup_ngram_detail_names_the_most_frequent_ngram():
    text = " ".join(["one two three four five"] * 3 + ["six seven eight nine ten eleven twelve"])
    cfg = GopherRepetitionConfig(top_ngram_char_frac=())
    code, detail = cfg.reason(text)
    assert code == "gopher_dup_5_grams"
    assert detail == 'dup_5_gram_char_frac=0.3455 > 0.15, ngram="one two three four five"'


@pytest.mark.parametrize("value, op, limit, shown", [
    (0.1503, ">", 0.15, "x=0.1503 > 0.15"),
    (0.15000004, ">", 0.15, "x=0.15000004 > 0.15"),  # 4 digits would print 0.15: more until it differs
    (10.02, ">", 10, "x=10.02 > 10"),  # printed as 10 before issue 41
    (0.79999, "<", 0.8, "x=0.79999 < 0.8"),
    (1 / 3, ">", 0.3, "x=0.3333 > 0.3"),
    (49, "<", 50, "x=49 < 50"),
])
def test_a_drop_detail_prints_enough_digits_to_show_the_comparison(value, op, limit, shown):
    assert beyond("x", value, op, limit) == shown
