"""Classification metrics computed locally (evaluate.load needs the hub)."""

from __future__ import annotations


def classification_metrics(predictions, references, label_names: list[str]) -> dict[str, float]:
    """accuracy, macro-F1 over every class (absent ones count as 0), and f1_<label> per class."""
    from sklearn.metrics import accuracy_score, f1_score

    classes = list(range(len(label_names)))
    per_class = f1_score(references, predictions, labels=classes, average=None, zero_division=0)
    metrics = {
        "accuracy": float(accuracy_score(references, predictions)),
        "f1_macro": float(per_class.mean()),
    }
    metrics.update({f"f1_{name}": float(score) for name, score in zip(label_names, per_class)})
    return metrics



def confusion_counts(predictions, references, num_labels: int) -> list[list[int]]:
    """counts[true][predicted] over the examples (labels outside 0..num_labels-1, e.g. -100, left out)."""
    from sklearn.metrics import confusion_matrix

    return confusion_matrix(references, predictions, labels=list(range(num_labels))).tolist()
