"""Contrastive image-text objectives and zero-shot classification.

:func:`clip_loss` is the symmetric InfoNCE loss of CLIP (Radford et al., 2021,
"Learning Transferable Visual Models From Natural Language Supervision", ICML;
Figure 3's pseudocode): for a batch of ``n`` matching pairs, the cross-entropy of
each image against all ``n`` texts and of each text against all ``n`` images, the
matching pair being the target, averaged over both directions. InfoNCE itself is
from van den Oord et al., 2018 ("Representation Learning with Contrastive
Predictive Coding").

With several trainer ranks, :func:`gather_features` all-gathers every rank's
features before the logits, as open_clip's ``ClipLoss`` does with
``local_loss=False, gather_with_grad=False`` (``open_clip/loss.py``,
``gather_features``): each rank contrasts the whole global batch, so the loss is
the one of a single process holding all ``N`` pairs, and the gradient reaching a
rank's own rows is that full-batch gradient's rows (the other ranks' features are
constants there). A data-parallel wrapper that averages gradients (DDP) then
holds the full-batch gradient divided by the world size, as in open_clip.

:func:`prompt_ensemble` builds one text embedding per class from several prompt
templates, as CLIP's zero-shot classifier does (Radford et al., 2021, section 3.1.4;
``zeroshot_classifier`` in the CLIP repository's prompt-engineering notebook):
normalise each prompt's features, average per class, normalise again.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: CLIP's initial temperature 0.07, as a log inverse temperature.
INIT_LOGIT_SCALE = math.log(1 / 0.07)
#: CLIP clips the learnt logit scale at 100.
MAX_LOGIT_SCALE = 100.0


def gather_features(image_features: torch.Tensor, text_features: torch.Tensor,
                    group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``[n_r, d]`` features, concatenated in rank order (``[N, d]``).

    ``torch.distributed.all_gather`` of each tensor; this rank's slot is replaced by
    its own tensor, so gradients flow to the local rows only (open_clip's
    ``gather_features`` with ``gather_with_grad=False``). Without an initialised
    process group, or with one rank, the inputs are returned unchanged.

    Every rank must pass the same number of rows ``n_r`` (all_gather needs equal
    shapes). Every gathered tensor, the row counts included, is on the features'
    device (with NCCL: this rank's CUDA device).

    Raises:
        ValueError: the ranks' row counts differ (all-gathered first, so every rank
            raises it together instead of hanging).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return image_features, text_features
    world = dist.get_world_size(group)
    if world == 1:
        return image_features, text_features
    rank = dist.get_rank(group)
    # on the features' device: NCCL gathers only CUDA tensors
    rows = torch.tensor([image_features.shape[0]], dtype=torch.int64,
                        device=image_features.device)
    all_rows = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(all_rows, rows, group=group)
    counts = [int(r) for r in all_rows]
    if len(set(counts)) != 1:
        raise ValueError(f"gather_features: trainer ranks hold {counts} rows; "
                         "every rank needs the same number (batch_size / ranks)")
    out = []
    for x in (image_features, text_features):
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.detach().contiguous(), group=group)
        parts[rank] = x
        out.append(torch.cat(parts, dim=0))
    return out[0], out[1]


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor,
              logit_scale: torch.Tensor, gather: bool = True,
              group=None) -> tuple[torch.Tensor, dict[str, float]]:
    """Symmetric InfoNCE of matching (image, text) pairs, over the global batch.

    Args:
        image_features, text_features: ``[n, d]`` float, unnormalised (L2-normalised
            here); row ``i`` of each is a matching pair. With several ranks in the
            default (or ``group``) process group and ``gather``, these are this
            rank's rows; the logits are taken against every rank's rows
            (:func:`gather_features`, ``N = world_size * n`` pairs).
        logit_scale: scalar, the log of the inverse temperature (learnt; its exp is
            clipped at :data:`MAX_LOGIT_SCALE`).
        gather: ``False``: contrast this rank's rows only.
    Returns:
        ``(loss, metrics)``: the mean of the image->text and text->image
        cross-entropies over the ``N`` pairs (nats; the same value on every rank),
        and ``i2t_accuracy`` (fraction of the ``N`` images whose most similar text
        is their own) and ``temperature``.
    Raises:
        ValueError: the two batches differ in shape, or the ranks' row counts differ.
    """
    if image_features.shape != text_features.shape:
        raise ValueError(f"clip_loss: image features {tuple(image_features.shape)} and text "
                         f"features {tuple(text_features.shape)} must have the same shape")
    a = F.normalize(image_features, dim=-1)
    b = F.normalize(text_features, dim=-1)
    if gather:
        a, b = gather_features(a, b, group)
    scale = logit_scale.exp().clamp(max=MAX_LOGIT_SCALE)
    logits = scale * a @ b.T
    target = torch.arange(a.shape[0], device=a.device)
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    with torch.no_grad():
        acc = (logits.argmax(dim=1) == target).float().mean()
    return loss, {"i2t_accuracy": float(acc), "temperature": float(1 / scale.detach())}


def zero_shot_predict(image_features: torch.Tensor,
                      class_text_features: torch.Tensor) -> torch.Tensor:
    """The class of each image: the index of the most cosine-similar class text.

    Args:
        image_features: ``[n, d]``. class_text_features: ``[c, d]``, one row per class
            (e.g. the ensemble of the prompts of digit 3, :func:`prompt_ensemble`).
    Returns:
        ``[n]`` int64 class indices.
    """
    a = F.normalize(image_features, dim=-1)
    b = F.normalize(class_text_features, dim=-1)
    return (a @ b.T).argmax(dim=1)


def prompt_ensemble(prompt_features: torch.Tensor, prompt_class: torch.Tensor,
                    n_classes: int) -> torch.Tensor:
    """One unit embedding per class from several prompts per class (CLIP's prompt
    ensembling): each prompt's features L2-normalised, averaged over the prompts of
    its class, normalised again.

    Args:
        prompt_features: ``[p, d]`` float, one row per prompt (after the text
            projection). prompt_class: ``[p]`` int64, the class of each row, in
            ``[0, n_classes)``.
    Returns:
        ``[n_classes, d]`` float, unit rows.
    Raises:
        ValueError: a class has no prompt, or a class index is out of range.
    """
    cls = torch.as_tensor(prompt_class, dtype=torch.int64)
    if cls.numel() != prompt_features.shape[0]:
        raise ValueError(f"prompt_ensemble: {prompt_features.shape[0]} prompt rows for "
                         f"{cls.numel()} class labels")
    if cls.numel() and (int(cls.min()) < 0 or int(cls.max()) >= n_classes):
        raise ValueError(f"prompt_ensemble: class labels must be in [0, {n_classes}); "
                         f"got {int(cls.min())}..{int(cls.max())}")
    counts = torch.bincount(cls, minlength=n_classes)
    if bool((counts == 0).any()):
        empty = (counts == 0).nonzero().flatten().tolist()
        raise ValueError(f"prompt_ensemble: classes {empty} have no prompt")
    f = F.normalize(prompt_features, dim=-1)
    sums = torch.zeros(n_classes, f.shape[1], dtype=f.dtype).index_add_(0, cls, f)
    return F.normalize(sums / counts.unsqueeze(1).to(f.dtype), dim=-1)


__all__ = ["INIT_LOGIT_SCALE", "MAX_LOGIT_SCALE", "clip_loss", "gather_features",
           "prompt_ensemble", "zero_shot_predict"]
