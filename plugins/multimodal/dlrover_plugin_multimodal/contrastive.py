"""Contrastive image-text objectives and zero-shot classification.

:func:`clip_loss` is the symmetric InfoNCE loss of CLIP (Radford et al., 2021,
"Learning Transferable Visual Models From Natural Language Supervision", ICML;
Figure 3's pseudocode): for a batch of ``n`` matching pairs, the cross-entropy of
each image against all ``n`` texts and of each text against all ``n`` images, the
matching pair being the target, averaged over both directions. InfoNCE itself is
from van den Oord et al., 2018 ("Representation Learning with Contrastive
Predictive Coding").
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

#: CLIP's initial temperature 0.07, as a log inverse temperature.
INIT_LOGIT_SCALE = math.log(1 / 0.07)
#: CLIP clips the learnt logit scale at 100.
MAX_LOGIT_SCALE = 100.0


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor,
              logit_scale: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Symmetric InfoNCE of ``n`` matching (image, text) pairs.

    Args:
        image_features, text_features: ``[n, d]`` float, unnormalised (L2-normalised
            here); row ``i`` of each is a matching pair.
        logit_scale: scalar, the log of the inverse temperature (learnt; its exp is
            clipped at :data:`MAX_LOGIT_SCALE`).
    Returns:
        ``(loss, metrics)``: the mean of the image->text and text->image
        cross-entropies (nats), and ``i2t_accuracy`` (fraction of images whose
        most similar text in the batch is their own) and ``temperature``.
    Raises:
        ValueError: the two batches differ in shape.
    """
    if image_features.shape != text_features.shape:
        raise ValueError(f"clip_loss: image features {tuple(image_features.shape)} and text "
                         f"features {tuple(text_features.shape)} must have the same shape")
    a = F.normalize(image_features, dim=-1)
    b = F.normalize(text_features, dim=-1)
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
            (e.g. the embedding of "a photo of the digit 3").
    Returns:
        ``[n]`` int64 class indices.
    """
    a = F.normalize(image_features, dim=-1)
    b = F.normalize(class_text_features, dim=-1)
    return (a @ b.T).argmax(dim=1)


__all__ = ["INIT_LOGIT_SCALE", "MAX_LOGIT_SCALE", "clip_loss", "zero_shot_predict"]
