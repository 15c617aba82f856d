"""METEOR: nltk's implementation over Debian's WordNet 3.0 reproduces nltk's own published figures (its docstring
and meteor.doctest, computed with nltk_data's WordNet 3.0), synonyms count only with WordNet, and a missing
WordNet is an error that names the package. `pytest -s -k reference` prints the table of both figures."""

import pytest

from lifecycle.tasks.eval.evaluate.metrics_text import WordNetMissing, meteor, scale_of, with_scale, wordnet_reader

H1 = "It is a guide to action which ensures that the military always obeys the commands of the party"
R1 = "It is a guide to action that ensures that the military will forever heed Party commands"
R2 = "It is the guiding principle which guarantees the military forces always being under the command of the Party"
R3 = "It is the practical guide for the army always to heed the directions of the party"

# (references, hypothesis, nltk's published figure rounded to 4 places, where nltk publishes it)
REFERENCE = [
    ([R1], H1, 0.6944, "nltk.translate.meteor_score.single_meteor_score docstring"),
    ([R1, R2, R3], H1, 0.6944, "nltk.translate.meteor_score.meteor_score docstring"),
    (["this is a cat"], "non matching hypothesis", 0.0, "meteor_score docstring"),
    (["The candidate has no alignment to any of the references"], "John loves Mary", 0.0, "meteor.doctest"),
    (["The cat sat on the mat"], "on the mat sat the cat", 0.5, "meteor.doctest (Wikipedia example)"),
    (["The cat sat on the mat"], "The cat was sat on the mat", 0.9654, "meteor.doctest (Wikipedia example)"),
    (["create or update a vm set"], "creates or updates a virtual machine scale set", 0.7806,
     "meteor.doctest (issue #2751)"),
]


def test_meteor_matches_nltk_reference_figures():
    from nltk.translate.meteor_score import meteor_score

    wn = wordnet_reader()
    print(f"\n{'reference figure':>16} {'ours':>8}  source")
    for refs, hyp, published, source in REFERENCE:
        ours = meteor_score([r.split() for r in refs], hyp.split(), wordnet=wn)
        print(f"{published:>16.4f} {ours:>8.4f}  {source}")
        assert round(ours, 4) == published, source
    # the whole-sentence case of meteor.doctest: 0.9977 within 1e-2 there; exact value here
    assert meteor_score(["The cat sat on the mat".split()], "The cat sat on the mat".split(), wordnet=wn) \
        == pytest.approx(0.9977, abs=1e-4)


def test_synonyms_come_from_wordnet_and_none_scores_exact_and_stem_only():
    gen, ref = ["the car is red"], ["the auto is red"]
    assert meteor(gen, ref)["gen_meteor"] == pytest.approx(0.9922, abs=1e-4)  # car~auto: a WordNet 3.0 synonym
    assert meteor(gen, ref, synonyms="none")["gen_meteor_nosyn"] == pytest.approx(0.6389, abs=1e-4)
    assert "auto" in {lemma.name() for s in wordnet_reader().synsets("car") for lemma in s.lemmas()}
    # nltk runs the synonym pass on the Porter stems left by the stem pass: "large" is "larg" by then, so
    # this synonym pair is not found (documented in docs/evaluation.md)
    assert meteor(["a large house"], ["a big house"])["gen_meteor"] == \
        meteor(["a large house"], ["a big house"], synonyms="none")["gen_meteor_nosyn"]
    # the stem pass works without WordNet
    assert meteor(["the dogs"], ["the dog"], synonyms="none")["gen_meteor_nosyn"] > \
        meteor(["the cats"], ["the dog"], synonyms="none")["gen_meteor_nosyn"]


def test_missing_wordnet_is_an_error_naming_the_package(tmp_path):
    with pytest.raises(WordNetMissing, match="apt-get install wordnet-base.*meteor_synonyms: none"):
        wordnet_reader(str(tmp_path))
    with pytest.raises(ValueError, match="meteor_synonyms"):
        meteor(["a"], ["a"], synonyms="verbnet")


def test_every_printed_bleu_carries_its_scale():
    assert with_scale("gen_bleu", 12.345) == "gen_bleu=12.35 [0-100]"
    assert with_scale("robust_typo_gen_bleu_drop", 1.5).endswith("[BLEU points (0-100 scale)]")
    assert scale_of("robust_typo_bpb_increase").startswith("bits per UTF-8 byte, perturbed")
    assert with_scale("gen_prompts", 16) == "gen_prompts=16"
