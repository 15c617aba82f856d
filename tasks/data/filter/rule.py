"""What every filter rule is: a frozen, closed pydantic config section that answers one question.

A rule's `reason(text, words)` returns the (reason code, detail) of the first check `text` fails, or None when it
passes (datatrove's `filter(doc) -> bool | (False, reason)`, with our own reason codes). `words` is
`split_words(text)`, handed in so that consecutive rules split a text once; None makes the rule split it itself
when it needs words. A rule that rewrites the text it keeps (C4 drops lines) overrides `edit`; the rules after it
see the edited text. The stage (stage.py) applies the rules listed in `filter.rules`, in that order.

A rule registers itself (`@register`: its name in `filter.rules`, its config section, the prefixes of its reason
codes, what a shard worker loads once for it), so that a new rule is one module in this package and one name in a
config's `filter.rules`: `load_rules` imports every module of the package.
"""

from __future__ import annotations

import importlib
import json
import operator
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

Verdict = tuple[str, str] | None  # (reason code, detail), None: the text passes

_OPS = {">": operator.gt, "<": operator.lt}


def beyond(name: str, value: float, op: str, limit: float) -> str:
    """A drop's detail, `name=value op limit` ("top_3_gram_char_frac=0.1503 > 0.15"): the value printed with as many
    significant digits as it takes (4 at least) for the printed value to fail the limit too, so a value just past
    its limit never prints as equal to it."""
    if isinstance(value, int):
        return f"{name}={value} {op} {limit}"
    digits = 4
    while digits < 17 and not _OPS[op](float(f"{value:.{digits}g}"), limit):
        digits += 1
    return f"{name}={value:.{digits}g} {op} {limit}"


def quoted(text: str, most: int = 60) -> str:
    """`text` as a JSON string, cut to `most` characters (an ellipsis marks a cut)."""
    return json.dumps(text if len(text) <= most else text[: most - 1] + "\u2026", ensure_ascii=False)


class Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uses_words: ClassVar[bool] = True  # False: the stage does not split for it (it splits itself, when it needs to)

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__}.reason")

    def edit(self, text: str) -> str:
        """The text this rule keeps of a `text` it passed; most rules keep it whole."""
        return text

    def judged(self, text: str) -> str:
        """The text this rule reads of `text` (the stage splits this one into words); most rules read it whole."""
        return text


# A line of markup only: at least 3 of these characters, spaces between allowed. reStructuredText heading underlines
# and transitions (`=====`, `-----`, `~~~~`, `****`, `####`), Markdown rules and table rules (`---`, `* * *`,
# `|---|:--:|`), grid-table borders (`+----+====+`). split_words makes each `=` of an underline a word of its own.
_MARKUP_LINE = re.compile(r"^[ \t]*(?:[-=~^*+#_:|.'\"`][ \t]*){3,}$\n?", re.M)


class MarkupAware(Rule):
    """A rule that can judge a text without its lines of markup only (the Gopher rules; on in the techdocs preset)."""

    skip_markup_lines: bool = Field(False, description=(
        "Judge the text without its lines of markup only (at least 3 of = - ~ ^ * + # _ : | . ' \" `, spaces "
        "between allowed): reStructuredText heading underlines and transitions, Markdown and table rules, "
        "grid-table borders. Each of their characters is a word of its own, so underlines make `= = =` the top "
        "n-gram, and non-alphabetic words, of a well-formed page. The kept text is unchanged. Off: datatrove and "
        "Gopher judge the text as it is."))

    def judged(self, text: str) -> str:
        return _MARKUP_LINE.sub("", text) if self.skip_markup_lines else text

    def own_view(self, text: str, words: list[str] | None) -> tuple[str, list[str] | None]:
        """(the text this rule reads, its words): `words` when they are still the words of that text, else None."""
        seen = self.judged(text)
        return (text, words) if seen == text else (seen, None)


@dataclass(frozen=True)
class RuleInfo:
    """A registered rule: `name` in `filter.rules` and as its config section, the `Rule` subclass, the prefixes of
    its reason codes, the section's one-line doc, its place among the sections, and what a shard worker loads
    once before its shards fork (`warm`, or None)."""
    name: str
    config: type[Rule]
    reasons: tuple[str, ...]
    doc: str
    order: int
    warm: Callable[[], None] | None


_RULES: dict[str, RuleInfo] = {}


def register(name: str, *, reasons: tuple[str, ...], doc: str, order: int = 100,
             warm: Callable[[], None] | None = None):
    """Class decorator: register a `Rule` subclass as the rule `name` (see `RuleInfo`)."""
    def add(cls: type[Rule]) -> type[Rule]:
        if name in _RULES and _RULES[name].config is not cls:
            raise ValueError(f"filter rule {name!r} registered twice ({_RULES[name].config.__name__}, {cls.__name__})")
        _RULES[name] = RuleInfo(name, cls, reasons, doc, order, warm)
        return cls
    return add


def load_rules() -> dict[str, RuleInfo]:
    """Every rule of this package, imported once (each registers itself), in section order."""
    for module in pkgutil.iter_modules(importlib.import_module(__package__).__path__):
        if module.name != "stage":  # the stage calls this while it is imported
            importlib.import_module(f"{__package__}.{module.name}")
    return dict(sorted(_RULES.items(), key=lambda kv: (kv[1].order, kv[0])))
