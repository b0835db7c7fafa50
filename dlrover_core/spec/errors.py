"""Errors of the job spec."""

from __future__ import annotations

import difflib
from typing import Iterable


class SpecError(ValueError):
    """A job spec is invalid. The message names the key, the bad value and what is
    allowed; ``key`` is the dotted key (``roles.trainer.total``)."""

    def __init__(self, key: str, value: object, allowed: str, detail: str = "") -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        msg = f"{key}: {value!r} is invalid"
        if detail:
            msg += f" ({detail})"
        msg += f"; allowed: {allowed}"
        super().__init__(msg)


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """``"did you mean 'max_steps'?"`` for the candidate nearest to ``word`` (difflib's
    ``get_close_matches``, ratio >= 0.6), or ``""`` when none is near."""
    near = difflib.get_close_matches(word, [str(c) for c in candidates], n=1, cutoff=0.6)
    return f"did you mean {near[0]!r}?" if near else ""
