"""evaluate says which part runs and, after an earlier evaluation in the same work dir, when it will end (issue 41
§4: 4:26 with no progress line on the kernel docs)."""

from __future__ import annotations

from lifecycle.tasks.eval.evaluate import stage


def test_parts_give_an_eta_scaled_by_this_runs_pace(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(stage.time, "time", lambda: clock[0])
    said: list[str] = []
    previous = {"validation loss": 10.0, "generation": 20.0, "robustness": 30.0, "safety and bias": 40.0}
    parts = stage.Parts(["validation loss", "generation", "robustness", "safety and bias", None], said.append, previous)
    parts.start("validation loss")
    assert said[-1] == "part 1/4: validation loss (ETA 1:40, from the last evaluation in this work dir)"
    clock[0] += 20  # twice as slow as last time: the rest is expected to take twice as long
    parts.start("generation", "16 prompts")
    assert said[-1] == "part 2/4: generation, 16 prompts (ETA 3:00, from the last evaluation in this work dir)"
    clock[0] += 40
    parts.start("robustness")
    clock[0] += 60
    parts.start("safety and bias")
    clock[0] += 80
    assert parts.finish() == {"validation loss": 20.0, "generation": 40.0, "robustness": 60.0, "safety and bias": 80.0}


def test_no_eta_without_an_earlier_evaluation(tmp_path):
    said: list[str] = []
    parts = stage.Parts(["validation loss", "robustness"], said.append, stage.previous_parts(str(tmp_path)))
    parts.start("validation loss")
    assert said == ["part 1/2: validation loss"]
