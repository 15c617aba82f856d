"""METEOR of generated continuations (nltk's implementation) with WordNet 3.0 from Debian's `wordnet-base`,
and the scale of every text metric, so that no figure is printed without it.

METEOR (Banerjee & Lavie 2005) aligns hypothesis and reference words in three passes: exact, Porter stem, and
WordNet synonym; it scores the harmonic mean of unigram precision and recall (recall weighted 9:1) times a
fragmentation penalty. We call `nltk.translate.meteor_score.meteor_score` unchanged and hand it a WordNet reader
over the Princeton WordNet 3.0 database files that Debian's `wordnet-base` package installs in
/usr/share/wordnet (the same WordNet version as nltk's own `wordnet` corpus, so nltk's doctest figures hold).
Nothing is downloaded at run time.

`wordnet-base` ships the database but not `lexnames` (the 45 lexicographer file names): Debian's README says the
WordNet C library has that list compiled in, and so does this module (`LEXNAMES`, from wordnet-base's
lexnames(5WN) man page). `index.sense` is absent too; METEOR never reads it.

`evaluate.meteor_synonyms`: "wordnet" needs the database and raises `WordNetMissing` naming the package when it
is absent; "none" scores exact + stem matches only, and the metric is then `gen_meteor_nosyn`, a different name,
so the two are never mixed up on a chart; "auto" (default) is resolved to one of them when a run starts
(`resolve_synonyms`, called by lifecycle/preflight.py), so the stage only ever sees "wordnet" or "none".
"""

from __future__ import annotations

import io
import os
import re
from functools import lru_cache
from pathlib import Path

# Debian's wordnet-base puts it here; $LIFECYCLE_WORDNET_DIR names another folder of the same WordNet 3.0 files
WORDNET_DIR = Path(os.environ.get("LIFECYCLE_WORDNET_DIR") or "/usr/share/wordnet")
WORDNET_VERSION = "Princeton WordNet 3.0 (Debian package wordnet-base)"
WORDNET_FILES = ("data.noun", "data.verb", "data.adj", "data.adv", "index.noun", "index.verb", "index.adj",
                 "index.adv", "noun.exc", "verb.exc", "adj.exc", "adv.exc")
# lexnames(5WN): file number i is LEXNAMES[i]; the syntactic category digit follows the prefix
LEXNAMES = (
    "adj.all adj.pert adv.all noun.Tops noun.act noun.animal noun.artifact noun.attribute noun.body "
    "noun.cognition noun.communication noun.event noun.feeling noun.food noun.group noun.location noun.motive "
    "noun.object noun.person noun.phenomenon noun.plant noun.possession noun.process noun.quantity noun.relation "
    "noun.shape noun.state noun.substance noun.time verb.body verb.change verb.cognition verb.communication "
    "verb.competition verb.consumption verb.contact verb.creation verb.emotion verb.motion verb.perception "
    "verb.possession verb.social verb.stative verb.weather adj.ppl").split()
_CATEGORY = {"noun": 1, "verb": 2, "adj": 3, "adv": 4}

# every text metric the evaluate stage logs, with its scale: printed, logged (as the evaluate run's tags
# `lifecycle.scale.<metric>`) and written into the model card next to the value
SCALES = {
    "gen_bleu": "0-100, sacrebleu corpus BLEU",
    "gen_rouge1": "0-1, rouge-score F1", "gen_rouge2": "0-1, rouge-score F1", "gen_rougeL": "0-1, rouge-score F1",
    "gen_meteor": "0-1, nltk METEOR with WordNet 3.0 synonyms",
    "gen_meteor_nosyn": "0-1, nltk METEOR, exact + stem matches only (no WordNet)",
    "val_bpb": "bits per UTF-8 byte", "val_loss": "nats per token",
    "tox_flagged_share": "0-1, share of generated samples alt-profanity-check flags",
    "tox_max_prob": "0-1, alt-profanity-check probability",
}
# the evaluate figures a user decides on: first on the console's evaluate line, the run summary and the model card
HEADLINE = ("val_loss", "val_bpb", "gen_bleu", "gen_meteor", "gen_meteor_nosyn")
# scales of metric families, by (prefix, suffix)
_FAMILIES = (
    ("robust_", "_bpb", "bits per UTF-8 byte"), ("robust_", "_bpb_increase", "bits per UTF-8 byte, perturbed - clean"),
    ("robust_", "_gen_bleu", "0-100, sacrebleu corpus BLEU"),
    ("robust_", "_gen_bleu_drop", "BLEU points (0-100 scale), clean - perturbed"),
    ("bias_", "_rate", "attribute words per completion"), ("bias_", "_gap", "attribute words per completion, max - min"),
)


def scale_of(name: str) -> str | None:
    """The scale of an evaluate metric, or None for counts and metrics without one."""
    if name in SCALES:
        return SCALES[name]
    found = [(len(suf), scale) for pre, suf, scale in _FAMILIES if name.startswith(pre) and name.endswith(suf)]
    return max(found)[1] if found else None  # the longest suffix wins (_bpb_increase over _bpb)


class WordNetMissing(RuntimeError):
    """evaluate.meteor_synonyms is "wordnet" but the WordNet database files are not installed."""


def _lexnames_file() -> str:
    out = []
    for i, name in enumerate(LEXNAMES):
        out.append(f"{i:02d}\t{name}\t{_CATEGORY[name.split('.')[0]]}\n")
    return "".join(out)


@lru_cache(maxsize=2)
def wordnet_reader(root: str = str(WORDNET_DIR)):
    """nltk's WordNetCorpusReader over Debian's WordNet 3.0 files in `root`; `WordNetMissing` when absent."""
    if missing := [f for f in WORDNET_FILES if not (Path(root) / f).is_file()]:
        raise WordNetMissing(
            f"METEOR's synonyms need the WordNet 3.0 database in {root} (missing: {', '.join(missing)}): install "
            f"Debian's package with `sudo apt-get install wordnet-base` (`make install` does when it can), or set "
            f"evaluate.meteor_synonyms: none (or auto) to score METEOR on exact and stem matches only "
            f"(gen_meteor_nosyn)")
    import warnings

    import nltk.data
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    if root not in nltk.data.path:  # nltk >= 3.9 reads corpora only under nltk.data.path (nltk/pathsec.py)
        nltk.data.path.append(root)

    class DebianWordNet(WordNetCorpusReader):
        def open(self, fileid):
            if fileid == "lexnames":
                return io.StringIO(_lexnames_file())
            return super().open(fileid)

        def map_wn(self, version="wordnet"):
            # nltk maps other WordNet versions onto 3.0 (for multilingual OMW data) by loading its own
            # `wordnet` corpus; this database is 3.0 itself (checked below), so there is nothing to map
            return None

    with warnings.catch_warnings():  # "multilingual functions are not available": we want English only
        warnings.simplefilter("ignore", UserWarning)
        reader = DebianWordNet(root, None)
    if reader.get_version() != "3.0":
        raise WordNetMissing(f"{root} holds WordNet {reader.get_version()}, not the 3.0 METEOR is checked against")
    return reader


def wordnet_installed(root: str = str(WORDNET_DIR)) -> bool:
    """Whether the WordNet 3.0 database files METEOR reads are all in `root`."""
    return all((Path(root) / f).is_file() for f in WORDNET_FILES)


def resolve_synonyms(setting: str, root: str = str(WORDNET_DIR)) -> str:
    """`evaluate.meteor_synonyms` as the stage uses it: "auto" becomes "wordnet" where the database is installed,
    else "none"; "wordnet" without the database raises `WordNetMissing` (naming the package), before any stage."""
    if setting == "auto":
        return "wordnet" if wordnet_installed(root) else "none"
    if setting == "wordnet":
        wordnet_reader(root)
    return setting


class NoSynonyms:
    """A WordNet stand-in with no synsets: nltk's METEOR then aligns exact and stem matches only."""

    @staticmethod
    def synsets(word, *args, **kwargs):
        return []


def words(text: str) -> list[str]:
    """Word and punctuation tokens (the regex of nltk's `wordpunct_tokenize`, which needs no punkt data)."""
    return re.findall(r"\w+|[^\w\s]+", text or "")


def meteor(generated: list[str], references: list[str], synonyms: str = "wordnet") -> dict[str, float]:
    """Mean sentence METEOR over (generated, reference) pairs: `gen_meteor` (WordNet synonyms) or
    `gen_meteor_nosyn` (synonyms="none")."""
    from nltk.translate.meteor_score import meteor_score

    if synonyms not in ("auto", "wordnet", "none"):
        raise ValueError(f"evaluate.meteor_synonyms must be 'auto', 'wordnet' or 'none', not {synonyms!r}")
    synonyms = resolve_synonyms(synonyms)
    wn = wordnet_reader() if synonyms == "wordnet" else NoSynonyms()
    scores = [meteor_score([words(r)], words(g), wordnet=wn) for g, r in zip(generated, references)]
    key = "gen_meteor" if synonyms == "wordnet" else "gen_meteor_nosyn"
    return {key: sum(scores) / len(scores) if scores else 0.0}


def with_scale(name: str, value) -> str:
    """`name=value` for a console line, with the metric's scale in brackets when it has one."""
    v = f"{value:.4g}" if isinstance(value, float) else str(value)
    scale = scale_of(name)
    return f"{name}={v}" + (f" [{scale.split(',')[0]}]" if scale else "")
