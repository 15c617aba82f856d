"""Filter rules: each Gopher quality rule on both sides of its threshold, disabled rules, language ID, Gopher
repetition, C4 and FineWeb on literal text, the ordered rules list and its config, and the stage on disk."""

from __future__ import annotations

import itertools
import re

import pyarrow as pa
import pytest

from tests import conftest
from pydantic import ValidationError

from lifecycle.config import ConfigError, load_config
from lifecycle.core.dataset import DOC_SCHEMA
from lifecycle.tasks.data.filter.gopher_quality import GopherQualityConfig
from lifecycle.tasks.data.filter.stage import FilterConfig, document_verdict, filter_table, run_filter
from lifecycle.tasks.data.filter.words import split_words

ROOT = conftest.ROOT
FINEWEB_ORDER = ("language", "gopher_repetition", "gopher_quality", "c4", "fineweb")
CFG = GopherQualityConfig()
# the Gopher quality rules alone (the literal documents below are repetitive on purpose)
GQ = FilterConfig(rules=("gopher_quality",))


def doc(n: int) -> str:
    """n words that pass every rule: mean length 4.5, two distinct stop words, all alphabetic, one line."""
    return " ".join(itertools.islice(itertools.cycle(["the", "house", "with", "garden"]), n))


def gopher_reason(text: str, cfg: GopherQualityConfig) -> tuple[str, str] | None:
    return cfg.reason(text, split_words(text))


def reason(text: str, cfg: GopherQualityConfig = CFG) -> str | None:
    verdict = cfg.reason(text)  # words=None: the rule splits the text itself
    return None if verdict is None else verdict[0]


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
# word splitting (expected tokens are spaCy 3.8 blank("en") output, which datatrove uses for English)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "Don't call os.path.join() -- it's e.g. 3.11.2, see https://docs.python.org/3/ (and foo-bar).",
            ["Do", "n't", "call", "os.path.join", "(", ")", "--", "it", "'s", "e.g.", "3.11.2", ",", "see",
             "https://docs.python.org/3/", "(", "and", "foo", "-", "bar", ")", "."],
        ),
        (
            'He said: "I can\'t!" U.S.A. costs $5 or 10% more... def f(x):',
            ["He", "said", ":", '"', "I", "ca", "n't", "!", '"', "U.S.A.", "costs", "$", "5", "or", "10", "%", "more",
             "...", "def", "f(x", "):"],
        ),
        (":func:`repr` and ``x``", [":", "func:`repr", "`", "and", "`", "`", "x", "`", "`"]),
    ],
)
def test_split_words_matches_spacy_english(text, expected):
    assert split_words(text) == expected


# --------------------------------------------------------------------------------------------------
# each rule, both sides


def test_passing_document_is_kept():
    assert gopher_reason(doc(50), CFG) is None


def test_short_doc():
    assert gopher_reason(doc(49), CFG) == ("gopher_short_doc", "words=49 < 50")
    assert reason(doc(50)) is None
    # punctuation tokens are not words (datatrove counts only words with a non-punctuation character)
    assert gopher_reason(doc(49) + " ." * 5, CFG) == ("gopher_short_doc", "words=49 < 50")


def test_long_doc():
    cfg = GopherQualityConfig(max_doc_words=60)
    assert gopher_reason(doc(61), cfg) == ("gopher_long_doc", "words=61 > 60")
    assert reason(doc(60), cfg) is None


def test_below_avg_word_length():
    base = ["the", "with"] + ["abc"] * 47
    assert reason(" ".join(base + ["xy"])) is None  # mean exactly 3.0 passes
    assert gopher_reason(" ".join(base + ["x"]), CFG) == ("gopher_below_avg_word_len", "avg_word_len=2.98 < 3")


def test_above_avg_word_length():
    base = ["the", "with"] + ["abcdefghij"] * 47  # 3 + 4 + 470 letters
    assert reason(" ".join(base + ["a" * 23])) is None  # 500 / 50 = 10.0 passes
    assert gopher_reason(" ".join(base + ["a" * 24]), CFG) == ("gopher_above_avg_word_len", "avg_word_len=10.02 > 10")
    assert reason(" ".join(base + ["a" * 30])) == "gopher_above_avg_word_len"


def test_symbol_ratio_hashes():
    # each "#" is also a (symbol) word: 6 / 56 > 0.1, 5 / 55 <= 0.1
    assert gopher_reason(doc(50) + " #" * 6, CFG) == ("gopher_symbol_ratio", "hash_ratio=0.1071 > 0.1")
    assert reason(doc(50) + " #" * 5) is None


def test_symbol_ratio_ellipsis():
    # ellipses at the start of the line, so the line does not end with one
    assert gopher_reason("... " * 6 + doc(50), CFG) == ("gopher_symbol_ratio", "ellipsis_ratio=0.1071 > 0.1")
    assert reason("… " * 5 + doc(50)) is None
    assert reason("… " * 6 + doc(50)) == "gopher_symbol_ratio"


def test_bullet_lines():
    bullets = [f"- {doc(6)}" for _ in range(10)]
    assert gopher_reason("\n".join(bullets), CFG) == ("gopher_bullet_lines", "bullet_lines=1 > 0.9")
    assert reason("\n".join(bullets[:9] + [doc(6)])) is None  # 0.9 is not > 0.9
    assert reason("\n".join(f"• {doc(6)}" for _ in range(10))) == "gopher_bullet_lines"
    starred = "\n".join(f"* {doc(6)}" for _ in range(10))
    assert reason(starred) is None  # '*' is not a bullet by default (datatrove: '•' and '-')
    assert reason(starred, GopherQualityConfig(bullet_prefixes=("*",))) == "gopher_bullet_lines"


def test_ellipsis_lines():
    lines = [doc(6) + (" ..." if i < 4 else "") for i in range(10)]
    assert gopher_reason("\n".join(lines), CFG) == ("gopher_ellipsis_lines", "ellipsis_lines=0.4 > 0.3")
    lines = [doc(6) + (" …" if i < 3 else "") for i in range(10)]
    assert reason("\n".join(lines)) is None  # 0.3 is not > 0.3
    lines = [doc(6) + (" ...  " if i < 4 else "") for i in range(10)]  # trailing blanks do not hide it
    assert reason("\n".join(lines)) == "gopher_ellipsis_lines"


def test_alpha_ratio():
    assert gopher_reason(doc(50) + " 123" * 13, CFG) == ("gopher_alpha_ratio", "alpha_words=0.7937 < 0.8")
    assert reason(doc(50) + " 123" * 12) is None  # 50 / 62 = 0.806
    # punctuation tokens count in the denominator, as in datatrove
    assert reason(doc(50) + " ;" * 13) == "gopher_alpha_ratio"


def test_stop_words_are_distinct_and_case_sensitive():
    assert gopher_reason(" ".join(["the", "house"] * 25), CFG) == ("gopher_stop_words", "stop_words=1 < 2")
    assert reason(" ".join(["The", "house", "With", "garden"] * 13)) == "gopher_stop_words"
    assert reason(" ".join(["the", "house", "of", "garden"] * 13)) is None
    assert reason(" ".join(["the", "house"] * 25), GopherQualityConfig(min_stop_words=1)) is None


def test_first_failing_rule_is_the_reason():
    text = "x " * 10  # short, too few stop words, mean word length 1
    assert reason(text) == "gopher_short_doc"
    assert reason(text, GopherQualityConfig(min_doc_words=None)) == "gopher_below_avg_word_len"
    assert reason(text, GopherQualityConfig(min_doc_words=None, min_avg_word_length=None)) == "gopher_stop_words"


@pytest.mark.parametrize(
    "field, text",
    [
        ("min_doc_words", doc(10)),
        ("max_doc_words", doc(100_001)),
        ("min_avg_word_length", " ".join(["the", "with"] + ["ab"] * 48)),
        ("max_avg_word_length", " ".join(["the", "with"] + ["abcdefghijklmnop"] * 48)),
        ("max_bullet_lines_ratio", "\n".join(f"- {doc(6)}" for _ in range(10))),
        ("max_ellipsis_lines_ratio", "\n".join(f"{doc(10)} ..." for _ in range(5))),
        ("min_alpha_words_ratio", doc(50) + " 7" * 20),
        ("min_stop_words", " ".join(["house", "garden"] * 25)),
    ],
)
def test_disabled_rule_does_not_fire(field, text):
    assert reason(text) is not None
    assert reason(text, GopherQualityConfig(**{field: None})) is None


def test_disabled_symbol_rule_does_not_fire():
    text = "# " * 6 + doc(50)
    assert reason(text) == "gopher_symbol_ratio"
    assert reason(text, GopherQualityConfig(max_symbol_word_ratio=None)) is None


def test_all_rules_disabled_keeps_even_empty_text():
    off = FilterConfig(language={"languages": None, "min_score": None},
                       gopher_quality={k: None for k, f in GopherQualityConfig.model_fields.items()
                                       if f.default is not None and not isinstance(f.default, (tuple, bool))})
    assert off.rules == FilterConfig().rules and off.gopher_quality.min_stop_words is None
    assert document_verdict("", off)[0] is None
    assert document_verdict("", FilterConfig(rules=()))[0] is None
    assert reason("", GopherQualityConfig(min_doc_words=None)) == "gopher_alpha_ratio"  # no words: ratio 0, no crash


# --------------------------------------------------------------------------------------------------
# config


def test_config_is_validated_frozen_and_closed():
    with pytest.raises(ValidationError, match="min_doc_words"):
        GopherQualityConfig(min_doc_words=100, max_doc_words=10)
    with pytest.raises(ValidationError, match="min_avg_word_length"):
        GopherQualityConfig(min_avg_word_length=12)
    with pytest.raises(ValidationError, match="min_stop_words"):
        GopherQualityConfig(min_stop_words=3, stop_words=("the", "of"))
    with pytest.raises(ValidationError):
        GopherQualityConfig(max_bullet_lines_ratio=1.5)
    with pytest.raises(ValidationError):
        GopherQualityConfig(max_non_alpha_words_ratio=0.8)  # datatrove's name is not accepted silently
    with pytest.raises(ValidationError):
        CFG.min_doc_words = 3
    with pytest.raises(ValidationError):
        FilterConfig().gopher_quality.min_doc_words = 3
    # the section's own checks run when the whole filter config is built, and name the field
    with pytest.raises(ValidationError, match="min_doc_words"):
        FilterConfig(gopher_quality={"min_doc_words": 100, "max_doc_words": 10})
    with pytest.raises(ValidationError, match="gopher_quality.max_non_alpha_words_ratio"):
        FilterConfig(gopher_quality={"max_non_alpha_words_ratio": 0.8})
    with pytest.raises(ValidationError, match="min_doc_words"):
        FilterConfig(min_doc_words=3)  # the flat field paths of before are not accepted silently
    sections = [FilterConfig, *(type(s) for s in FilterConfig().active()),
                *(FilterConfig.model_fields[r].annotation for r in FINEWEB_ORDER)]
    assert all(f.description for model in sections for f in model.model_fields.values())


def test_rules_are_known_names_listed_once():
    assert FilterConfig().rules == ("language", "gopher_quality")
    with pytest.raises(ValidationError, match="rules"):
        FilterConfig(rules=("language", "gopher_qualty"))
    with pytest.raises(ValidationError, match="gopher_quality more than once"):
        FilterConfig(rules=("gopher_quality", "language", "gopher_quality"))


def test_overrides_reach_each_rule_section(tmp_path):
    demo = ROOT / "deploy" / "configs" / "demo.yaml"
    cfg = load_config(demo, [f"workdir={tmp_path}", "filter.gopher_quality.min_doc_words=null",
                             "filter.c4.min_sentences=3", "filter.rules=[c4, language]",
                             "filter.language.languages=[en, de]"])
    assert cfg.filter.rules == ("c4", "language")
    assert cfg.filter.gopher_quality.min_doc_words is None and cfg.filter.c4.min_sentences == 3
    assert cfg.filter.language.languages == ("en", "de")
    with pytest.raises(ConfigError, match="`filter.min_doc_words`"):
        load_config(demo, ["filter.min_doc_words=null"])
    with pytest.raises(ConfigError, match="`filter.fineweb.newline_ratio`"):
        load_config(demo, ["filter.fineweb.newline_ratio=-1"])


# --------------------------------------------------------------------------------------------------
# table function and the stage


def test_filter_table_splits_rows_and_counts():
    texts = [doc(50), doc(5), doc(50) + " 123" * 20, doc(60)]
    kept, rejected, stats = filter_table(docs_table(texts), GQ)
    assert kept.schema.names == DOC_SCHEMA.names + ["lang", "lang_score"]
    assert kept.column("lang").to_pylist() == ["en", "en"]
    assert kept.column("doc_id").to_pylist() == ["d0", "d3"]
    assert rejected.column("doc_id").to_pylist() == ["d1", "d2"]
    assert rejected.column("source_id").to_pylist() == ["src-d1", "src-d2"]
    assert rejected.column("stage").to_pylist() == ["filter", "filter"]
    assert rejected.column("reason").to_pylist() == ["gopher_short_doc", "gopher_alpha_ratio"]
    assert rejected.column("detail").to_pylist()[0] == "words=5 < 50"
    assert (stats.rows_in, stats.rows_kept, dict(stats.rejected)) == (
        4, 2, {"gopher_short_doc": 1, "gopher_alpha_ratio": 1})
    assert stats.bytes_in == sum(len(t.encode()) for t in texts)
    assert stats.bytes_out == len(texts[0].encode()) + len(texts[3].encode())


def test_filter_table_rejects_null_text_by_name():
    table = docs_table([doc(50)]).set_column(2, "text", pa.array([None], pa.string()))
    with pytest.raises(ValueError, match="doc_id='d0'"):
        filter_table(table, GQ)


def make_collect(workdir, tables: list[pa.Table]):
    return conftest.make_collect(workdir, tables, "test_filter")


def test_run_filter_accounts_for_every_row_and_reuses(tmp_path):
    parent = make_collect(tmp_path, [
        docs_table([doc(50), doc(3), "é" + doc(55)], prefix="a"),
        docs_table([doc(2), doc(4)], prefix="b"),  # every row of this file is dropped
    ])
    ref = run_filter(parent, GQ, str(tmp_path))
    assert not ref.reused
    manifest = ref.manifest()
    assert len(manifest["files"]) == 2  # one kept file per input file, even an empty one
    kept, rejected = ref.read(), ref.read_rejected()
    assert sorted(kept.column("doc_id").to_pylist()) == ["a0", "a2"]
    assert sorted(rejected.column("doc_id").to_pylist()) == ["a1", "b0", "b1"]
    assert set(rejected.column("reason").to_pylist()) == {"gopher_short_doc"}
    assert ref.num_rows + rejected.num_rows == parent.num_rows == 5
    assert manifest["stats"]["rows_in"] == 5
    assert manifest["stats"]["rejected_by_reason"] == {"gopher_short_doc": 3}
    assert manifest["parents"][0]["sha256"] == parent.sha256

    again = run_filter(parent, GQ, str(tmp_path))
    assert again.reused and again.path == ref.path and again.sha256 == ref.sha256

    other = run_filter(parent, FilterConfig(rules=("gopher_quality",), gopher_quality={"min_doc_words": 3}),
                       str(tmp_path))
    assert not other.reused and other.path != ref.path
    assert other.num_rows == 4


# --------------------------------------------------------------------------------------------------
# language ID, Gopher repetition, C4, FineWeb: each rule firing and not firing on literal text

from lifecycle.tasks.data.filter.c4 import count_sentences  # noqa: E402
from lifecycle.tasks.data.filter.gopher_repetition import dup_ngram_chars, top_ngram_chars  # noqa: E402

EN = ("The committee met on Tuesday to discuss the budget for the coming year. It agreed that the library "
      "should receive additional funding for new books. Longer opening hours in winter were approved as well. "
      "Volunteers will help with the reading programme for children. The mayor thanked everyone for coming.")
DE = ("Der Ausschuss traf sich am Dienstag, um den Haushalt für das kommende Jahr zu besprechen. Er beschloss, "
      "dass die Bibliothek zusätzliche Mittel für neue Bücher erhalten soll.")


def only(rule: str, **fields) -> FilterConfig:
    """`rule` alone, its section's `fields` set."""
    return FilterConfig(rules=(rule,), **{rule: fields})


def verdict(text, cfg):
    v = document_verdict(text, cfg)[0]
    return None if v is None else v[0]


def test_language_id_rules_and_columns():
    ONLY_LANG = only("language", languages=("en",), min_score=0.65)
    assert verdict(EN, ONLY_LANG) is None
    assert verdict(DE, ONLY_LANG) == "lang_not_kept"
    assert verdict(DE, only("language", languages=("en", "de"))) is None
    assert verdict(DE, only("language", languages=None)) is None
    assert verdict(EN, only("language", min_score=1.0)) == "lang_low_score"
    _, _, lang, score = document_verdict(DE, ONLY_LANG)
    assert lang == "de" and 0.9 < score <= 1.0
    assert ONLY_LANG.language.reason(DE) == ("lang_not_kept", f"lang=de not in ['en'], score={score:.3f}")
    code, detail = only("language", min_score=1.0).language.reason(EN)
    assert code == "lang_low_score" and re.fullmatch(r"lang=en, score=0\.9+\d* < 1\.0", detail), detail
    # the language is detected and stored even when no language rule is listed
    assert document_verdict(DE, FilterConfig(rules=()))[1:] == (DE, lang, score)


def test_gopher_duplicate_lines_and_paragraphs():
    cfg = only("gopher_repetition")
    paras = ["The river rose overnight after heavy rain.", "Farmers moved their cattle to higher fields.",
             "A bridge on the northern road was closed.", "Schools opened late on Monday morning.",
             "Volunteers filled sandbags near the old mill.", "The mayor asked residents to stay calm.",
             "Forecasters expect drier weather by Thursday.", "Insurance claims are likely to rise sharply.",
             "Trains between the two towns were cancelled.", "Shops in the market square reopened at noon."]
    assert verdict("\n\n".join(paras), cfg) is None
    # 4 of 10 paragraphs repeat an earlier one: 0.4 > 0.3
    rep = paras[:6] + [paras[0]] * 4
    assert verdict("\n\n".join(rep), cfg) == "gopher_dup_para_frac"
    assert verdict("\n\n".join(rep), only("gopher_repetition", dup_para_frac=None)) == "gopher_dup_para_char_frac"
    lines = "\n".join(paras[:6] + [paras[0]] * 4)  # single newlines: lines, not paragraphs
    assert verdict(lines, cfg) == "gopher_dup_line_frac"
    assert verdict(lines, only("gopher_repetition", dup_line_frac=None)) == "gopher_dup_line_char_frac"
    assert verdict(lines, only("gopher_repetition", dup_line_frac=None, dup_line_char_frac=None,
                               top_ngram_char_frac=(), dup_ngram_char_frac=())) is None


def test_gopher_top_and_duplicated_ngrams():
    assert top_ngram_chars("a b a b a b".split(), 2) == len("a b") * 3
    assert dup_ngram_chars("x y z x y z".split(), 3) == len("xyz")
    cfg = only("gopher_repetition")
    text = "cheap shoes " * 12 + EN
    assert verdict(text, cfg) == "gopher_top_2_gram"
    assert verdict(text, only("gopher_repetition", top_ngram_char_frac=((2, 0.9), (3, 0.9), (4, 0.9)))) \
        == "gopher_dup_5_grams"
    assert verdict(EN, cfg) is None


def test_c4_rules():
    cfg = only("c4")
    assert verdict(EN, cfg) is None
    assert verdict(EN + "\nLorem ipsum dolor sit amet, consectetur.", cfg) == "c4_lorem_ipsum"
    assert verdict(EN + "\nThe dict {'a': 1} is built here.", cfg) == "c4_curly_bracket"
    assert verdict(EN + "\nThe dict {'a': 1} is built here.", only("c4", curly_bracket=False)) is None
    four = "One sentence here. Two sentences here. Three sentences here. Four sentences here."
    assert verdict(four, cfg) == "c4_too_few_sentences"
    assert verdict(four + " Five now.", cfg) is None
    # removed lines do not count towards sentences, and are cut from the kept text
    noisy = four + "\nPlease enable JavaScript to view this page. Really. Now.\nShort line.\nOur privacy policy applies."
    assert verdict(noisy, cfg) == "c4_too_few_sentences"
    _, text, _, _ = document_verdict(EN + "\nPlease enable JavaScript to continue.\nMenu\nSee our privacy policy here.",
                                     cfg)
    assert text == EN
    assert verdict(four + "\nNo end punctuation here five", only("c4", terminal_punct=True)) \
        == "c4_too_few_sentences"
    assert count_sentences(split_words("Hi there. How are you? Fine!")) == 3
    assert count_sentences(split_words("Version 3.11.2 is out.")) == 1


def test_fineweb_rules():
    cfg = only("fineweb")
    long_lines = [f"This is line number {w} of a document that ends properly." for w in "abcdefgh"]
    assert verdict("\n".join(long_lines), cfg) is None
    no_punct = [line.rstrip(".") for line in long_lines]
    assert verdict("\n".join(no_punct), cfg) == "fineweb_line_punct_ratio"  # 0 / 8 < 0.12
    assert verdict("\n".join(no_punct[:7] + long_lines[:1]), cfg) is None  # 1 / 8 = 0.125
    short = ["Short one.", "Tiny.", "Small line."] * 2 + long_lines[:2]
    assert verdict("\n".join(short), only("fineweb", char_dup_ratio=None)) \
        == "fineweb_short_line_ratio"  # 6 / 8 > 0.67
    assert verdict("\n".join(long_lines + long_lines[:1]), cfg) == "fineweb_char_dup_ratio"
    listy = "\n".join(f"Item {w}." for w in "abcdefghijkl")  # 1 newline per 3 words > 0.3
    assert verdict(listy, only("fineweb", short_line_ratio=None)) == "fineweb_list_ratio"
    assert verdict(listy, only("fineweb", short_line_ratio=None, newline_ratio=None)) is None


def load_fineweb() -> FilterConfig:
    return load_config(ROOT / "deploy" / "configs" / "fineweb.yaml").filter


def test_shipped_fineweb_config_is_fineweb_recipe():
    """deploy/configs/fineweb.yaml lists every rule in datatrove examples/fineweb.py's order, and each value it
    spells out is the code's default, which is FineWeb's (cited beside each field)."""
    fineweb = load_fineweb()
    assert fineweb.rules == FINEWEB_ORDER
    assert fineweb == FilterConfig(rules=FINEWEB_ORDER)
    assert fineweb.c4.terminal_punct is False  # C4QualityFilter(filter_no_terminal_punct=False)


def test_rule_order_follows_fineweb():
    FINEWEB = load_fineweb()
    assert "c4" not in FilterConfig().rules
    text = DE + "\n" + "{" * 3
    assert verdict(text, FINEWEB) == "lang_not_kept"  # language first, before any quality rule
    braces = EN + "\nThe dict {'a': 1} is here."
    assert verdict(braces, FINEWEB) == "c4_curly_bracket"
    assert verdict(braces, FilterConfig()) is None  # C4 is opt-in
    no_rep = FilterConfig(rules=tuple(r for r in FINEWEB.rules if r != "gopher_repetition"))
    assert verdict("The house is on the hill. {", no_rep) == "gopher_short_doc"  # Gopher quality before C4


def test_rules_run_in_the_listed_order_and_only_listed_rules_run():
    text = "The house is on the hill. {"
    assert verdict(text, FilterConfig(rules=("gopher_quality", "c4"))) == "gopher_short_doc"
    assert verdict(text, FilterConfig(rules=("c4", "gopher_quality"))) == "c4_curly_bracket"
    # a section whose rule is not listed is not applied
    assert verdict(EN, FilterConfig(rules=("language",), gopher_quality={"min_doc_words": 10_000})) is None


def test_rules_after_c4_see_its_edited_text():
    menu = EN + "\nHome\nAbout us\nContact\nMenu"
    assert verdict(menu, only("fineweb")) == "fineweb_short_line_ratio"  # 4 of 5 lines are short
    v, kept_text, _, _ = document_verdict(menu, FilterConfig(rules=("c4", "fineweb")))
    assert v is None and kept_text == EN  # C4 dropped the short lines before FineWeb judged the text
    assert verdict(menu, FilterConfig(rules=("fineweb", "c4"))) == "fineweb_short_line_ratio"
