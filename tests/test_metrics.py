import numpy as np
import pytest

from effitrain.tasks.metrics import classification_metrics


def test_metrics_match_hand_computation():
    refs = np.array([0, 0, 0, 1, 1, 2])
    preds = np.array([0, 0, 1, 1, 0, 2])
    m = classification_metrics(preds, refs, ["a", "b", "c"])
    # a: tp 2, fp 1, fn 1 -> f1 2/3; b: tp 1, fp 1, fn 1 -> 1/2; c: 1.
    assert m["accuracy"] == pytest.approx(4 / 6)
    assert m["f1_a"] == pytest.approx(2 / 3) and m["f1_b"] == pytest.approx(0.5) and m["f1_c"] == 1.0
    assert m["f1_macro"] == pytest.approx((2 / 3 + 0.5 + 1) / 3)


def test_class_absent_from_split_counts_as_zero_f1():
    m = classification_metrics(np.array([0, 0]), np.array([0, 0]), ["ham", "spam"])
    assert m["f1_ham"] == 1.0 and m["f1_spam"] == 0.0 and m["f1_macro"] == 0.5
