"""The model card leads with what a reader decides on (issue 41 §3): the model's size, the data it trained on (kept,
dropped and why), the held-out figures, intended use and limitations; the raw files are counted, not listed (a card
of 3,325 lines was nearly all a table of raw files)."""

from __future__ import annotations

from lifecycle.lineage.card import model_card


def test_the_card_opens_with_a_summary_and_counts_the_raw_files():
    raw = [{"path": f"/data/kernel/doc{i}.rst", "bytes": 100, "sha256": f"{i:064x}"} for i in range(3148)]
    lineage = {"datasets": [{"stage": "collect", "num_rows": 3148, "sha256": "c" * 64, "manifest": "m",
                             "inputs": raw}]}
    stats = {"collect": {"rows_in": 3148, "rows_kept": 3148, "rows_rejected": 0},
             "filter": {"rows_in": 3148, "rows_kept": 2000, "rows_rejected": 1148,
                        "rejected_by_reason": {"gopher_short_doc": 900, "lang_low_score": 200, "gopher_alpha": 40,
                                               "x": 8}},
             "tokenize": {"rows_in": 2000, "rows_kept": 2000, "rows_rejected": 0,
                          "counters": {"tokens_train": 1234567, "docs_train": 1900}}}
    card = model_card(name="m", version="2", run_id="r", prefect_flow_run_id="f", tags={}, lineage=lineage,
                      stage_configs={}, metrics={"val_bpb": 2.5, "val_loss": 4.25, "train_steps": 200},
                      promotion={}, examples=[], stats_by_stage=stats, params=1_310_720)
    lines = card.splitlines()
    assert len(lines) < 60, len(lines)
    assert lines[2] == ("A decoder of 1,310,720 non-embedding parameters, trained for 200 steps, on 1,234,567 tokens "
                        "of 1,900 documents, kept from 3,148 documents in 3,148 raw files.")
    assert lines[4].startswith("Held-out figures: val_loss 4.25 [nats per token]; val_bpb 2.5 [bits per UTF-8 byte]")
    assert "## Intended use and limitations" in card
    assert "| filter | 3,148 | 2,000 | 1,148 | gopher_short_doc 900, lang_low_score 200, gopher_alpha 40 |" in card
    assert "3,148 files, 314,800 bytes; each with its path, size and sha256 in the artifact `raw_inputs.json`" in card
    assert "/data/kernel/doc17.rst" not in card
    assert card.index("## Data") < card.index("## Provenance") < card.index("## Raw input files")
