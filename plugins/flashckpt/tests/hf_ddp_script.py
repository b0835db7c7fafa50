"""A plain torchrun script that trains a tiny GPT-2 (built from a config, nothing
downloaded, dropout on) with ``transformers.Trainer`` over DDP (gloo, CPU) through
``FlashCheckpointCallback``; ``test_flash_hf_ddp.py`` runs it under ``dlrover-run
--nproc_per_node 2``.

32 distinct samples (sample ``i`` starts with token ``i``), 2 per rank and batch, so 8
optimizer steps an epoch, reshuffled every epoch; a loss log every 3 steps. A flash save
every ``--every`` steps. ``--kill-at N``: at the end of step N every rank waits until
its newest save is committed to ``--ckpt`` (on disk) and SIGKILLs itself. Rank 0 writes
to ``--out`` (``torch.save``): the step and source the run resumed from, its model state
at the end, the sample ids that rank 0 trained on, the loss logs, ``training_loss`` and
the transformers version."""

from __future__ import annotations

import argparse
import os
import signal

import torch


def tiny_gpt2(layers: int, width: int, vocab: int, length: int,
              samples: int) -> tuple[torch.nn.Module, list[dict], list[int]]:
    """A GPT-2 of ``layers`` blocks ``width`` wide (2 heads, dropout 0.1, seeded 0) and
    ``samples`` distinct samples of ``length`` tokens below ``vocab`` (sample ``i``
    starts with token ``i``, seeded 1); the third item fills, as the model runs, with
    the first token of every sample it is given: the sample ids in the order it saw
    them. ``flash_workloads.hf_train`` builds its model and data here too."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=width, n_head=2,
                                       vocab_size=vocab, n_positions=length,
                                       resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(samples):
        ids = torch.randint(0, vocab, (length,), generator=g)
        ids[0] = i
        data.append({"input_ids": ids, "labels": ids})
    seen: list[int] = []
    model.register_forward_pre_hook(
        lambda mod, args, kw: seen.extend(kw["input_ids"][:, 0].tolist()), with_kwargs=True)
    return model, data, seen


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--kill-at", type=int, default=-1)
    a = p.parse_args()

    import transformers
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from dlrover_plugin_flashckpt.hf import FlashCheckpointCallback

    model, data, seen = tiny_gpt2(layers=1, width=16, vocab=48, length=8, samples=32)

    flash = FlashCheckpointCallback(a.ckpt, every_steps=a.every, job=a.job,
                                    options={"wait_timeout_s": 120})

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == a.kill_at:
                flash.saver.wait()  # this rank's newest save is on disk
                os.kill(os.getpid(), signal.SIGKILL)

    args = TrainingArguments(output_dir=os.path.join(a.ckpt, "..", "hf-out"),
                             max_steps=a.max_steps, per_device_train_batch_size=2,
                             learning_rate=1e-2, warmup_steps=2, lr_scheduler_type="linear",
                             logging_steps=3, save_strategy="no", report_to=[], use_cpu=True,
                             ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True,
                             seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[flash, Kill()])
    out = flash.train(trainer)
    if args.process_index == 0:
        torch.save({"resumed_from": flash.resumed_from, "source": flash.resumed_source,
                    "world_size": args.world_size, "step": trainer.state.global_step,
                    "model": {k: v.detach().clone()
                              for k, v in trainer.model.state_dict().items()},
                    "seen": seen, "training_loss": out.training_loss,
                    "logs": [(e["step"], e["loss"]) for e in trainer.state.log_history
                             if "loss" in e],
                    "version": transformers.__version__}, a.out)


if __name__ == "__main__":
    main()
