"""Arithmetic problems written as text: ``"57+08="`` -> ``"065."``.

Operands are integers in ``[0, 10**digits)``; a prompt is ``"<a>+<b>="`` with both
operands written with ``digits`` digits (zero-padded), and an answer is the sum with
``digits + 1`` digits followed by ``.``, so every character has a fixed position
(as in a column sum on paper). The held-out set is
``heldout(n)``: ``n`` problems from a fixed seed, never used for training (training
problems that collide with it are drawn again).

Tokens: one per character of :data:`VOCAB`, int64.
"""

from __future__ import annotations

import random
from functools import lru_cache

import torch

VOCAB = " 0123456789+=."
STOI = {c: i for i, c in enumerate(VOCAB)}
PAD, EOS = STOI[" "], STOI["."]
HELDOUT_SEED = 20_240_205


def prompt_len(digits: int) -> int:
    """Characters of a padded prompt: two operands, ``+`` and ``=``."""
    return 2 * digits + 2


def answer_len(digits: int) -> int:
    """Most answer characters: ``digits + 1`` digits of the sum and ``.``."""
    return digits + 2


def encode(text: str) -> list[int]:
    try:
        return [STOI[c] for c in text]
    except KeyError as exc:
        raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary {VOCAB!r}") from None


def decode(tokens) -> str:
    return "".join(VOCAB[int(t)] for t in tokens)


def prompt_text(a: int, b: int, digits: int) -> str:
    return f"{a:0{digits}d}+{b:0{digits}d}="


def answer_text(a: int, b: int, digits: int) -> str:
    return f"{a + b:0{digits + 1}d}."


@lru_cache(maxsize=8)
def heldout(n: int, digits: int) -> tuple[tuple[int, int], ...]:
    """``n`` distinct held-out problems ``(a, b)`` (fixed seed)."""
    rng = random.Random(HELDOUT_SEED + digits)
    seen: dict[tuple[int, int], None] = {}
    while len(seen) < n:
        seen[(rng.randrange(10 ** digits), rng.randrange(10 ** digits))] = None
    return tuple(seen)


class Problems:
    """Training problems that avoid the held-out set of ``heldout_n`` problems."""

    def __init__(self, digits: int, heldout_n: int, seed: int) -> None:
        self.digits = digits
        self.blocked = set(heldout(heldout_n, digits))
        self.seed = seed

    def by_id(self, pid: int) -> tuple[int, int]:
        """The problem with id ``pid`` (the same in every process)."""
        rng = random.Random(self.seed * 1_000_003 + pid)
        while True:
            ab = (rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits))
            if ab not in self.blocked:
                return ab

    def sample(self, n: int, rng: random.Random) -> list[tuple[int, int]]:
        out = []
        while len(out) < n:
            ab = (rng.randrange(10 ** self.digits), rng.randrange(10 ** self.digits))
            if ab not in self.blocked:
                out.append(ab)
        return out


def prompts_tensor(problems, digits: int) -> torch.Tensor:
    """``[B, prompt_len]`` int64 prompt tokens."""
    return torch.tensor([encode(prompt_text(a, b, digits)) for a, b in problems],
                        dtype=torch.int64)


def sft_batch(problems, digits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``x`` and targets ``y`` ``[B, L - 1]`` for next-token training on whole
    problems (``L = prompt_len + answer_len``, answers padded with spaces); targets
    outside the answer are ``-100`` (ignored), so only the answer is learnt."""
    p, r = prompt_len(digits), answer_len(digits)
    seqs, tgts = [], []
    for a, b in problems:
        ans = answer_text(a, b, digits)
        s = encode(prompt_text(a, b, digits) + ans.ljust(r))
        t = [-100] * (p - 1) + encode(ans) + [-100] * (r - len(ans)) + [-100]
        seqs.append(s)
        tgts.append(t[: p + r - 1])
    x = torch.tensor(seqs, dtype=torch.int64)
    return x[:, :-1], torch.tensor(tgts, dtype=torch.int64)


def parse_answer(tokens) -> int | None:
    """The integer before the first ``.`` of a response, or ``None`` when the response
    has no ``.`` or is not a plain decimal number."""
    text = decode(tokens)
    if "." not in text:
        return None
    head = text.split(".", 1)[0]
    return int(head) if head.isdigit() else None
