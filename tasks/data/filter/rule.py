"""What every filter rule is: a frozen, closed pydantic config section that answers one question.

A rule's `reason(text, words)` returns the (reason code, detail) of the first check `text` fails, or None when it
passes (datatrove's `filter(doc) -> bool | (False, reason)`, with our own reason codes). `words` is
`split_words(text)`, handed in so that consecutive rules split a text once; None makes the rule split it itself
when it needs words. A rule that rewrites the text it keeps (C4 drops lines) overrides `edit`; the rules after it
see the edited text. The stage (stage.py) applies the rules listed in `filter.rules`, in that order.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict

Verdict = tuple[str, str] | None  # (reason code, detail), None: the text passes


class Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    uses_words: ClassVar[bool] = True  # False: the stage does not split for it (it splits itself, when it needs to)

    def reason(self, text: str, words: list[str] | None = None) -> Verdict:
        raise NotImplementedError(f"{type(self).__name__}.reason")

    def edit(self, text: str) -> str:
        """The text this rule keeps of a `text` it passed; most rules keep it whole."""
        return text
