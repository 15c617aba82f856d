"""bench.recipe's arithmetic: an `ARM@LR` arm's config changes, and the tokens a validation curve takes to reach a
target loss (linear between evaluations)."""

from bench.recipe import arm_changes, relative_tokens, tokens_to


def test_an_arm_at_a_learning_rate_sets_the_field_its_optimizer_reads():
    assert arm_changes("base@0.006") == {"optimizer": {"lr": 0.006}}
    assert arm_changes("muon@0.01")["optimizer"] == {"name": "muon", "grad_clip": 0.0, "muon_lr": 0.01}
    assert arm_changes("tfixup")["model"] == {"init": "tfixup", "norm": "none"}


def test_tokens_to_a_target_interpolate_between_evaluations():
    curve = [[10, 6.0], [20, 5.0], [30, 4.5]]
    assert tokens_to(curve, 100, 6.5) == 10 * 100  # reached at the first evaluation
    assert tokens_to(curve, 100, 5.5) == 15 * 100  # halfway from 6.0 at step 10 to 5.0 at step 20
    assert tokens_to(curve, 100, 4.0) is None


def test_relative_tokens_compare_each_seed_with_the_reference_of_that_seed():
    ref = {"model": "demo", "arm": "base", "steps": 30, "tokens_per_step": 100}
    rows = [{**ref, "seed": 0, "val_loss": 5.0}, {**ref, "seed": 1, "val_loss": 4.0},
            {**ref, "arm": "fast", "seed": 0, "curve": [[10, 5.5], [20, 4.5]]},
            {**ref, "arm": "fast", "seed": 1, "curve": [[10, 5.5], [20, 4.5]]}]
    assert relative_tokens(rows, "base") == {"demo fast": [15 / 30, None]}
