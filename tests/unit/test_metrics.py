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


@pytest.mark.parametrize("seed", range(6))
def test_metrics_equal_sklearns(seed):
    """The numpy metrics give sklearn's figures: absent classes, a class never predicted, labels outside
    the classes in the confusion counts (left out, as sklearn's labels= leaves them out)."""
    from effitrain.tasks.metrics import confusion_counts
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    rng = np.random.default_rng(seed)
    classes = 2 + seed % 4
    refs = rng.integers(0, classes - (seed % 2), size=50 + seed)  # odd seeds: the last class never occurs
    preds = np.where(rng.random(refs.size) < 0.7, refs, rng.integers(0, classes, size=refs.size))
    names = [f"c{i}" for i in range(classes)]
    m = classification_metrics(preds, refs, names)
    per_class = f1_score(refs, preds, labels=list(range(classes)), average=None, zero_division=0)
    assert m["accuracy"] == pytest.approx(accuracy_score(refs, preds), abs=1e-12)
    assert [m[f"f1_{n}"] for n in names] == pytest.approx(per_class.tolist(), abs=1e-12)
    assert m["f1_macro"] == pytest.approx(per_class.mean(), abs=1e-12)
    noisy_refs = np.where(rng.random(refs.size) < 0.1, -100, refs)
    assert confusion_counts(preds, noisy_refs, classes) == \
        confusion_matrix(noisy_refs, preds, labels=list(range(classes))).tolist()

