"""Stage 2: GRPO on the SFT policy, with a rule-based reward role (``grpo`` template).

- ``ArithRollout``: for each prompt id it was handed, builds the problem (the same
  in every process, ``task.Problems.by_id``) and samples ``rl.samples_per_prompt``
  answers at ``arith.temperature``. Batch rows: ``prompt`` ``[N, P]``, ``actions``
  ``[N, R]`` (answer characters), ``logprobs``, ``mask`` (up to the first ``.``),
  ``dones``, ``rewards`` (zeros) and ``group`` (prompt id).
- ``ArithReward``: reads the two operands back from the prompt text and gives 1.0
  when the answer before ``.`` is their sum, else 0.0. No learnt reward model.
- ``ArithReference``: the SFT policy, frozen, for the KL term.
- ``ArithActor``: the policy being trained (Adam); ``evaluate`` gives greedy accuracy
  on the held-out problems (``accuracy``, ``eval_problems``).

All load ``config.arith.init_checkpoint`` (written by ``sft.yaml``), which also gives
the model shape.
"""

from __future__ import annotations

import torch

from dlrover_plugin_ppo.workloads import (
    ActorWorkload,
    ReferenceWorkload,
    RewardWorkload,
    RolloutWorkload,
    TorchRNG,
)
from examples.grpo_arith.policy import (
    build_model,
    generate,
    greedy_accuracy,
    load_checkpoint,
    response_logprobs,
)
from examples.grpo_arith.task import (
    Problems,
    answer_len,
    decode,
    parse_answer,
    prompts_tensor,
)


class _Arith:
    def load_policy(self) -> torch.nn.Module:
        self.init_torch()
        ckpt = load_checkpoint(str(self.config.arith.init_checkpoint))
        self.kwargs = dict(ckpt["model_kwargs"])
        self.digits = int(self.kwargs["digits"])
        self.temperature = float(self.config.arith.get("temperature", 1.0))
        model = build_model(**self.kwargs)
        model.load_state_dict(ckpt["model"])
        return model


class ArithActor(_Arith, ActorWorkload):
    def setup(self) -> None:
        self.policy = self.load_policy()
        self.optimizer = torch.optim.Adam(self.policy.parameters(),
                                          lr=float(self.config.arith.lr))

    def evaluate_actions(self, batch):
        return response_logprobs(self.policy, batch["prompt"], batch["actions"],
                                 self.temperature, entropy=self.rl.entropy_coef > 0)

    def evaluate(self):
        n = int(self.config.arith.heldout)
        return {"accuracy": greedy_accuracy(self.policy, self.digits, n), "eval_problems": n}


class ArithRollout(_Arith, RolloutWorkload):
    def setup(self) -> None:
        self.policy = self.load_policy()
        self.problems = Problems(self.digits, int(self.config.arith.heldout),
                                 int(self.config.get("seed", 0)))
        self.num_samples = 0

    def state_objects(self):
        """The RNG that samples the answers, checkpointed at each driver commit (a
        restored rollout samples what it would have)."""
        return {"rng": TorchRNG()}

    def generate(self, iteration, prompt_ids=None):
        if not prompt_ids:
            raise ValueError("ArithRollout needs prompt ids: set config.rl.prompts_per_iter")
        g = self.rl.samples_per_prompt
        problems = [self.problems.by_id(int(i)) for i in prompt_ids]
        prompts = prompts_tensor(problems, self.digits).repeat_interleave(g, dim=0)
        out = generate(self.policy, prompts, answer_len(self.digits), self.temperature)
        self.num_samples += prompts.shape[0]
        return {**out, "prompt": prompts, "rewards": torch.zeros_like(out["mask"]),
                "group": torch.tensor(list(prompt_ids), dtype=torch.int64).repeat_interleave(g)}

    def stats(self):
        out = {"num_samples": self.num_samples}
        self.num_samples = 0
        return out


class ArithReference(_Arith, ReferenceWorkload):
    def setup(self) -> None:
        self.policy = self.load_policy()

    def evaluate_actions(self, batch):
        return response_logprobs(self.policy, batch["prompt"], batch["actions"],
                                 self.temperature)


class ArithReward(RewardWorkload):
    """1.0 for an exactly right sum, 0.0 otherwise (wrong digits, no ``.``, junk)."""

    def setup(self) -> None:
        self.init_torch()

    @staticmethod
    def check(prompt_tokens, answer_tokens) -> float:
        a, b = decode(prompt_tokens).rstrip("=").split("+")
        return float(parse_answer(answer_tokens) == int(a) + int(b))

    def reward(self, batch):
        return torch.tensor([self.check(p, a) for p, a in zip(batch["prompt"], batch["actions"])])
