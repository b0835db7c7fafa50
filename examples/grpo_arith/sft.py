"""Stage 1: supervised training of the character GPT on generated sums (``sft`` template).

Next-token cross-entropy on the answer characters only (``task.sft_batch``), AdamW,
``config.sft.steps`` steps of ``config.sft.batch_size`` problems. At the end, rank 0
measures greedy accuracy on the held-out problems, reports it as ``accuracy``, and
saves ``{"model": state_dict, "model_kwargs": {...}, "accuracy": float}`` to
``config.sft.save_to`` (default ``<job dir>/policy.pt``) for the GRPO stage.
"""

from __future__ import annotations

import os
import random

import torch
import torch.nn.functional as F

from dlrover_core import BaseWorkload
from examples.grpo_arith.policy import build_model, greedy_accuracy, model_kwargs
from examples.grpo_arith.task import Problems


class ArithSFT(BaseWorkload):
    def setup(self) -> None:
        c = self.config
        torch.set_num_threads(int(c.get("torch_threads", 1)))
        seed = int(c.get("seed", 0))
        torch.manual_seed(seed)
        self.kwargs = model_kwargs(c)
        model = build_model(**self.kwargs)
        self.model = self.backend.wrap(model)
        self.raw = model
        s = c.sft
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=float(s.lr),
                                     weight_decay=float(s.get("weight_decay", 0.0)))
        self.problems = Problems(self.kwargs["digits"], int(c.arith.heldout), seed)
        self.rng = random.Random(seed * 7919 + self.rank)

    def run(self) -> dict:
        from examples.grpo_arith.task import sft_batch

        s = self.config.sft
        steps, bs, digits = int(s.steps), int(s.batch_size), self.kwargs["digits"]
        loss = torch.zeros(())
        for step in range(steps):
            self.model.train()
            x, y = sft_batch(self.problems.sample(bs, self.rng), digits)
            logits, _ = self.model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1),
                                   ignore_index=-100)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            if step % 25 == 0 or step == steps - 1:
                self.report(step, loss=loss.item())
        out = {"loss": loss.item(), "steps": steps}
        if self.rank == 0:
            n = int(self.config.arith.heldout)
            acc = greedy_accuracy(self.raw, digits, n)
            path = str(s.get("save_to") or os.path.join(self.job_dir, "policy.pt"))
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = path + ".tmp"
            torch.save({"model": self.raw.state_dict(), "model_kwargs": self.kwargs,
                        "accuracy": acc, "eval_problems": n}, tmp)
            os.replace(tmp, path)
            self.report(steps - 1, accuracy=acc, eval_problems=n, loss=loss.item())
            out.update(accuracy=acc, saved_to=path)
        return out
