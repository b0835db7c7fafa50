"""What the character-level GPT examples share (``examples.nanogpt.workload``, its
tuned variant and ``examples.megatron_gpt.workload``): the optimizer, the learning-rate
schedule, the injected faults of the tests, the model built from ``config``, the
resume from a checkpoint, and the training loop around a workload's own step
(:func:`train`: evaluate, report, checkpoint).

Every function takes the workload (a :class:`dlrover_core.BaseWorkload`) whose
``config`` it reads; nothing here runs by itself.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any, Callable

import torch


def adamw(params, config) -> torch.optim.AdamW:
    """The examples' optimizer: AdamW at ``config.lr`` with ``config.weight_decay``
    (default 0.1) and betas (0.9, 0.95), as nanoGPT trains."""
    return torch.optim.AdamW(params, lr=float(config.lr),
                             weight_decay=float(config.get("weight_decay", 0.1)),
                             betas=(0.9, 0.95))


def warmup_cosine_lr(step: int, peak_lr: float, config) -> float:
    """Learning rate at ``step``: linear warm-up over ``config.warmup_steps`` (default 20),
    then cosine decay to ``peak_lr / 10`` at ``config.max_steps``."""
    warm, total = int(config.get("warmup_steps", 20)), int(config.max_steps)
    if step < warm:
        return peak_lr * (step + 1) / warm
    frac = min(1.0, (step - warm) / max(1, total - warm))
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def maybe_fault(workload: Any, step: int) -> None:
    """Test hook: ``config.fault`` = {"rank": r, "step": s, "kind": raise|kill|hang,
    "attempt": a} injects a real fault in rank ``r`` at step ``s``, in restart attempt
    ``a`` only (default 0; ``any``: every attempt, a deterministic bug): ``raise`` a
    ``RuntimeError``, ``kill`` the process (SIGKILL) or ``hang`` (sleep an hour).

    ``config.pause`` = {"step": s, "until": path, "timeout_s": t} holds every rank
    before step ``s`` until the file ``path`` exists (a test lets the job go on once
    it has done what it waited for), polling every 0.2 s.

    Raises:
        TimeoutError: ``path`` did not appear within ``timeout_s`` (default 600) s.
    """
    p = workload.config.get("pause")
    if p and int(p.step) == step:
        limit = float(p.get("timeout_s", 600))
        deadline = time.monotonic() + limit
        while not os.path.exists(str(p.until)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"config.pause: {p.until} did not appear within {limit:g} s")
            time.sleep(0.2)
    f = workload.config.get("fault")
    if not f or int(f.rank) != workload.rank or int(f.step) != step:
        return
    attempt = f.get("attempt", 0)
    if attempt != "any" and int(attempt) != workload.attempt:
        return
    if f.kind == "raise":
        raise RuntimeError(f"injected fault at step {step}")
    if f.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if f.kind == "hang":
        time.sleep(3600)


def build_char_gpt(workload: Any, vocab_size: int) -> tuple[Any, Any, int]:
    """nanoGPT's model of ``config`` (``block_size``, ``n_layer``, ``n_head``,
    ``n_embd``) over ``vocab_size`` symbols, wrapped by the workload's backend (FSDP2
    shards each ``Block``). Returns ``(GPTConfig, wrapped model, parameter count)``."""
    from examples.nanogpt.model import GPT, Block, GPTConfig

    c = workload.config
    cfg = GPTConfig(vocab_size=vocab_size, block_size=int(c.block_size),
                    n_layer=int(c.n_layer), n_head=int(c.n_head), n_embd=int(c.n_embd))
    model = GPT(cfg)
    num_params = model.num_params()
    wrapped = workload.backend.wrap(model, shard_modules=(Block,)) \
        if workload.context.backend == "fsdp" else workload.backend.wrap(model)
    return cfg, wrapped, num_params


def resume(workload: Any, **state: Any) -> None:
    """Load the newest checkpoint into ``workload.model``, ``workload.opt`` and
    ``workload.extra`` (made here: ``{"step": 0}``) and the named ``state`` (e.g. a data
    loader); sets ``start_step`` (0 when there was nothing to load) and
    ``resumed_from`` (the checkpoint's step, or ``None``)."""
    w = workload
    w.extra = {"step": 0}
    loaded = w.checkpointer.load(model=w.model, optimizer=w.opt, extra=w.extra, **state)
    w.start_step = int(w.extra["step"]) if loaded is not None else 0
    w.resumed_from = loaded


def end_step(workload: Any, step: int, metrics: dict, **state: Any) -> bool:
    """After the optimizer step that made ``step`` steps done: every
    ``config.eval_every`` steps and at ``config.max_steps``, ``workload.evaluate()``
    into ``metrics["val_loss"]``; ``resumed_from_step`` when the run resumed; report
    ``metrics`` as step ``step - 1``; and save through the checkpointer (``model``,
    ``optimizer``, ``extra`` with ``step`` and the named ``state``, e.g. a data
    loader). Returns whether it evaluated."""
    w = workload
    evaluated = step % int(w.config.eval_every) == 0 or step == int(w.config.max_steps)
    if evaluated:
        metrics["val_loss"] = w.evaluate()
    if w.resumed_from is not None:
        metrics["resumed_from_step"] = w.resumed_from
    w.report(step - 1, **metrics)
    w.extra["step"] = step
    w.checkpointer.maybe_save(step, model=w.model, optimizer=w.opt, extra=w.extra, **state)
    return evaluated


def final_val_loss(workload: Any, step: int, val: float) -> float:
    """``val``, or (when no step evaluated: NaN) a fresh ``evaluate()`` reported at
    step ``step - 1``."""
    if math.isnan(val):
        val = workload.evaluate()
        workload.report(step - 1, val_loss=val)
    return val


def train(workload: Any, train_step: Callable[[int], float], samples_per_step: int) -> dict:
    """The examples' training loop from ``workload.start_step`` to ``config.max_steps``:
    per step the injected fault (``workload._maybe_fault``), the learning rate of
    ``workload.lr_at(step)`` set on every parameter group, ``train_step(step)`` (forward,
    backward, optimizer step; returns the loss), then :func:`end_step` with ``loss``,
    ``lr`` and ``samples_per_s`` (``samples_per_step`` over the step's wall time, the
    evaluation left out). Returns ``{"val_loss", "steps", "params"}``."""
    w = workload
    max_steps = int(w.config.max_steps)
    step = w.start_step
    t_last, val = time.perf_counter(), float("nan")
    while step < max_steps:
        w._maybe_fault(step)
        lr = w.lr_at(step)
        for g in w.opt.param_groups:
            g["lr"] = lr
        loss = train_step(step)
        step += 1
        now = time.perf_counter()
        metrics = {"loss": loss, "lr": lr,
                   "samples_per_s": samples_per_step / max(now - t_last, 1e-9)}
        t_last = now
        if end_step(w, step, metrics):
            val, t_last = metrics["val_loss"], time.perf_counter()
    return {"val_loss": final_val_loss(w, step, val), "steps": step, "params": w.num_params}
