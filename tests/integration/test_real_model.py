"""The real packaged all-MiniLM-L6-v2 on a slice of the SMS spam data: learns, saves, reloads."""

import effitrain
import pytest
import torch

pytestmark = pytest.mark.slow


def test_real_model_learns_spam_and_reloads_with_plain_transformers(tmp_path):
    from effitrain.commands.predict import predict
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    metrics = effitrain.train(dict(output_dir=str(tmp_path / "run"), max_train_samples=640, max_eval_samples=200,
                                   max_length=64))
    assert metrics["steps"] == 40  # 640 examples in micro-batches of 16
    # Majority class (ham) alone scores about 0.87 on these 200 messages.
    assert metrics["test"]["accuracy"] >= 0.95 and metrics["test"]["f1_spam"] >= 0.8

    model_dir = tmp_path / "run" / "model"
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    texts = ["URGENT! You have won a 1 week FREE membership in our £100,000 prize Jackpot! Txt CLAIM to 81010",
             "Ok lar... I'll be home soon, see you at dinner"]
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    plain = [model.config.id2label[int(i)] for i in logits.argmax(-1)]
    assert plain == [r["label"] for r in predict(str(model_dir), texts)] == ["spam", "ham"]
