"""Sampling and scoring answers with the character GPT of ``examples.nanogpt.model``.

Shapes: ``prompts`` ``[B, P]`` int64; responses ``[B, R]`` int64 with
``R = answer_len(digits)``; log-probabilities in nats, float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from examples.grpo_arith.task import EOS, PAD, VOCAB, answer_len, prompt_len
from examples.nanogpt.model import GPT, GPTConfig


def build_model(digits: int, n_layer: int, n_head: int, n_embd: int) -> GPT:
    block = prompt_len(digits) + answer_len(digits)
    return GPT(GPTConfig(vocab_size=len(VOCAB), block_size=block, n_layer=n_layer,
                         n_head=n_head, n_embd=n_embd))


def model_kwargs(config) -> dict:
    """``digits``, ``n_layer``, ``n_head``, ``n_embd`` from ``config.arith``."""
    c = config.arith
    return {"digits": int(c.digits), "n_layer": int(c.n_layer), "n_head": int(c.n_head),
            "n_embd": int(c.n_embd)}


@torch.no_grad()
def generate(model: GPT, prompts: torch.Tensor, max_new: int, temperature: float = 1.0,
             greedy: bool = False) -> dict[str, torch.Tensor]:
    """Sample ``max_new`` tokens after each prompt (no KV cache: sequences are short).

    Returns ``actions`` ``[B, R]``, ``logprobs`` ``[B, R]`` (of the sampling
    distribution at ``temperature``), ``mask`` ``[B, R]`` (1 up to and including the
    first ``.``), ``dones`` ``[B, R]`` (1 at that last real token).
    """
    model.eval()
    b = prompts.shape[0]
    seq = prompts
    actions, logprobs = [], []
    finished = torch.zeros(b, dtype=torch.bool)
    mask = torch.zeros(b, max_new)
    for t in range(max_new):
        logits, _ = model(seq)
        logp = F.log_softmax(logits[:, -1, :] / temperature, dim=-1)
        tok = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1).squeeze(1)
        tok = torch.where(finished, torch.full_like(tok, PAD), tok)
        mask[:, t] = (~finished).float()
        actions.append(tok)
        logprobs.append(logp.gather(1, tok[:, None]).squeeze(1))
        finished = finished | (tok == EOS)
        seq = torch.cat([seq, tok[:, None]], dim=1)
    actions_t = torch.stack(actions, 1)
    dones = torch.zeros(b, max_new)
    last = (mask.sum(1).long() - 1).clamp_min(0)
    dones[torch.arange(b), last] = 1.0
    return {"actions": actions_t, "logprobs": torch.stack(logprobs, 1) * mask, "mask": mask,
            "dones": dones}


def response_logprobs(model: GPT, prompts: torch.Tensor, actions: torch.Tensor,
                      temperature: float = 1.0, entropy: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probabilities ``[B, R]`` of the response tokens ``actions`` after ``prompts``
    (with gradients), and the per-token entropy ``[B, R]`` when asked."""
    seq = torch.cat([prompts, actions], dim=1)[:, :-1]
    logits, _ = model(seq)
    logits = logits[:, prompts.shape[1] - 1:, :] / temperature
    logp = F.log_softmax(logits, dim=-1)
    lp = logp.gather(2, actions[:, :, None]).squeeze(2)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return lp, ent


@torch.no_grad()
def greedy_accuracy(model: GPT, digits: int, n: int) -> float:
    """Share of the ``n`` held-out problems whose greedy answer is exactly right."""
    from examples.grpo_arith.task import heldout, parse_answer, prompts_tensor

    problems = heldout(n, digits)
    out = generate(model, prompts_tensor(problems, digits), answer_len(digits), greedy=True)
    right = sum(parse_answer(out["actions"][i]) == a + b for i, (a, b) in enumerate(problems))
    return right / n


def load_checkpoint(path: str) -> dict:
    """The SFT stage's ``policy.pt`` (``model``, ``model_kwargs``, ``accuracy``).

    Raises:
        FileNotFoundError: no file at ``path`` (run the SFT job first).
    """
    import os

    if not os.path.exists(path):
        raise FileNotFoundError(
            f"config.arith.init_checkpoint={path!r} does not exist (relative paths are taken "
            f"from {os.getcwd()!r}); run the SFT stage first: "
            "dlrover submit examples/grpo_arith/sft.yaml")
    return torch.load(path, map_location="cpu", weights_only=True)
