"""Prequential (test-then-train) counters of a classifier on a stream, with the two
baselines and the two kappa statistics that make a stream accuracy readable.

- **Prequential accuracy** (Gama, Sebastiao, Rodrigues 2013, "On evaluating
  stream learning algorithms", Machine Learning 90): every record is predicted by
  the model as it is *before* it trains on that record; accuracy = correct / records.
- **No-change classifier**: predicts the label of the previous record in stream
  order. On a stream whose labels come in runs (temporal dependence) it is hard
  to beat.
- **Majority class**: predicts the most frequent label among the records seen so
  far (test-then-train like the model: record ``i`` is predicted from the labels
  of records ``0..i-1``; a tie goes to the smallest label).
  Before the first label both baselines have nothing to predict: that record
  counts as a miss for them.
- **Cohen's kappa** ``(p0 - pc) / (1 - pc)``: ``p0`` the model's accuracy, ``pc``
  the accuracy of a chance classifier with the model's own prediction frequencies,
  ``pc = sum_k (true_k / n) * (pred_k / n)``.
- **Kappa-temporal** ``(p0 - p_nc) / (1 - p_nc)`` (Bifet, de Francisci Morales,
  Read, Holmes, Pfahringer 2015, "Efficient online evaluation of big data stream
  classifiers", KDD): ``p_nc`` the no-change classifier's accuracy. Below 0 the
  model does worse than repeating the previous label.

Both kappas are ``nan`` when their denominator is 0 (chance, or no-change, is
perfect). The counters are plain integers (:meth:`PrequentialStats.state` /
:meth:`PrequentialStats.from_state`, JSON-safe), so they travel in a checkpoint.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PrequentialStats:
    """Counters over a stream of ``(label, prediction)`` pairs, in stream order.

    Attributes:
        records: pairs seen. correct: model predictions equal to the label.
        no_change_correct, majority_correct: the baselines' correct predictions.
        last_label: the label of the previous record (``None`` before the first).
        label_counts, prediction_counts: label -> count (keys are ``str`` of the
            int label, so that a JSON round trip keeps them).
    """

    records: int = 0
    correct: int = 0
    no_change_correct: int = 0
    majority_correct: int = 0
    last_label: int | None = None
    label_counts: dict[str, int] = field(default_factory=dict)
    prediction_counts: dict[str, int] = field(default_factory=dict)

    def update(self, labels: Iterable[int], predictions: Iterable[int]) -> None:
        """Add records in stream order: ``labels`` and ``predictions`` are int class
        ids of the same length (e.g. ``y.tolist()`` of an int64 ``[N]`` tensor).

        Raises:
            ValueError: the two have different lengths.
        """
        labels, predictions = [int(v) for v in labels], [int(v) for v in predictions]
        if len(labels) != len(predictions):
            raise ValueError(f"{len(labels)} labels but {len(predictions)} predictions")
        if not labels:
            return
        self.correct += sum(p == y for p, y in zip(predictions, labels))
        previous = [self.last_label, *labels[:-1]]
        self.no_change_correct += sum(a == y for a, y in zip(previous, labels))
        # the majority label before each record, kept up to date in O(1) per record
        # (a tie goes to the smallest label, as in the module docstring)
        counts = {int(k): c for k, c in self.label_counts.items()}
        top = max(counts.values(), default=0)
        majority = min((k for k, c in counts.items() if c == top), default=None)
        hits = 0
        for y in labels:
            if majority is not None:
                hits += majority == y
            c = counts.get(y, 0) + 1
            counts[y] = c
            if c > top or (c == top and y < majority):
                top, majority = c, y
        self.majority_correct += hits
        self.records += len(labels)
        self.last_label = labels[-1]
        self.label_counts = {str(k): c for k, c in counts.items()}
        for p, c in collections.Counter(predictions).items():
            self.prediction_counts[str(p)] = self.prediction_counts.get(str(p), 0) + c

    # ------------------------------------------------------------------ figures
    def accuracy(self) -> float:
        return self.correct / self.records if self.records else 0.0

    def no_change_accuracy(self) -> float:
        return self.no_change_correct / self.records if self.records else 0.0

    def majority_accuracy(self) -> float:
        return self.majority_correct / self.records if self.records else 0.0

    def chance_agreement(self) -> float:
        """``pc`` of Cohen's kappa: ``sum_k (true_k / n) * (pred_k / n)``."""
        n = self.records
        if not n:
            return 0.0
        return sum(c * self.prediction_counts.get(k, 0)
                   for k, c in self.label_counts.items()) / (n * n)

    def kappa(self) -> float:
        return _kappa(self.accuracy(), self.chance_agreement())

    def kappa_temporal(self) -> float:
        return _kappa(self.accuracy(), self.no_change_accuracy())

    def metrics(self) -> dict[str, float]:
        """The figures under their metric names (``prequential_accuracy``, ``kappa``,
        ``kappa_temporal``, ``baseline_no_change_accuracy``,
        ``baseline_majority_accuracy``)."""
        return {"prequential_accuracy": self.accuracy(), "kappa": self.kappa(),
                "kappa_temporal": self.kappa_temporal(),
                "baseline_no_change_accuracy": self.no_change_accuracy(),
                "baseline_majority_accuracy": self.majority_accuracy()}

    # ------------------------------------------------------------------ persistence
    def state(self) -> dict[str, Any]:
        """The counters as a JSON-safe dict."""
        return {"records": self.records, "correct": self.correct,
                "no_change_correct": self.no_change_correct,
                "majority_correct": self.majority_correct, "last_label": self.last_label,
                "label_counts": dict(self.label_counts),
                "prediction_counts": dict(self.prediction_counts)}

    @classmethod
    def from_state(cls, state: dict[str, Any] | None) -> PrequentialStats:
        """Counters from :meth:`state` (``None`` or ``{}``: empty)."""
        s = dict(state or {})
        return cls(records=int(s.get("records", 0)), correct=int(s.get("correct", 0)),
                   no_change_correct=int(s.get("no_change_correct", 0)),
                   majority_correct=int(s.get("majority_correct", 0)),
                   last_label=None if s.get("last_label") is None else int(s["last_label"]),
                   label_counts={str(k): int(v) for k, v in
                                 (s.get("label_counts") or {}).items()},
                   prediction_counts={str(k): int(v) for k, v in
                                      (s.get("prediction_counts") or {}).items()})


def _kappa(p0: float, pe: float) -> float:
    return (p0 - pe) / (1.0 - pe) if pe < 1.0 else float("nan")
