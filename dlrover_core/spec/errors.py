"""Errors of the job spec."""

from __future__ import annotations


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
