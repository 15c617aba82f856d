"""The funnel chart's axis ends at a round number near the largest bar (issue 24: 2,130 documents drew to 4,000)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from lifecycle.lineage.charts import funnel_png, funnel_rows, nice_bound


@pytest.mark.parametrize("x,bound", [(2130, 2500), (2300.4, 2500), (1000, 1000), (1001, 1200), (7, 7), (7.5, 8), (64.8, 70), (0.3, 0.3),
                                     (95, 100), (0, 1.0)])
def test_nice_bound(x, bound):
    assert nice_bound(x) == pytest.approx(bound)


def test_the_funnel_axis_ends_near_the_largest_count(tmp_path, monkeypatch):
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    stats = lambda n_in, n_kept, **why: {"stats": {"rows_in": n_in, "rows_kept": n_kept, "rejected_by_reason": why}}
    manifests = {"collect": stats(2130, 2130), "filter": stats(2130, 1604, gopher_short_doc=526),
                 "dedup": stats(1604, 1590, duplicate=14), "scrub": stats(1590, 1590)}
    path = funnel_png(manifests, tmp_path / "funnel.png")
    assert path.stat().st_size > 1000
    (ax,) = figures[0].axes
    assert ax.get_xlim() == (0, 2500)
    assert max(ax.get_xticks()) <= 2500
    assert any("-526 gopher_quality" in t.get_text() for t in ax.texts)  # filter: cost per rule


def test_steps_that_drop_nothing_still_show_what_they_did(tmp_path, monkeypatch):
    """Paragraph and substring dedup cut bytes, quality and perplexity score, decontamination checks: each is on the
    funnel beside its bar even when no document is dropped."""
    figures = []
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))
    stats = lambda n, **counters: {"rows_in": n, "rows_kept": n, "rejected_by_reason": {}, "counters": counters}
    manifests = {
        "dedup": {"stats": stats(679, paragraphs_cut=72, paragraph_bytes_cut=15048, substrings_cut=38,
                                 substring_bytes_cut=7563)},
        "decontaminate": {"stats": stats(678), "config": {"sets": ["humaneval", "mine"]}},
        "quality": {"stats": stats(678), "score_column": "quality_fasttext"},
        "perplexity": {"stats": stats(678, scored_docs=670, unscored_docs=8), "score_column": "quality_perplexity"},
        "scrub": {"stats": stats(678)},
    }
    rows = {r["stage"]: r["notes"] for r in funnel_rows(manifests)}
    assert rows == {"dedup": ["cut 15,048 B: 72 paragraphs (bloom)", "cut 7,563 B: 38 spans (suffix array)"],
                    "scrub": [], "decontaminate": ["checked against humaneval, mine"],
                    "quality": ["scored 678 (quality_fasttext)"], "perplexity": ["scored 670 (quality_perplexity)"]}
    funnel_png(manifests, tmp_path / "funnel.png")
    texts = [t.get_text() for t in figures[0].axes[0].texts]
    assert any("cut 7,563 B: 38 spans (suffix array)" in t.replace("\n", " ") for t in texts)
