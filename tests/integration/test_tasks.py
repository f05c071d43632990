"""Each task trains end to end from the user's kind of data; packing is exact."""

import json

import effitrain
import numpy as np
import pytest
import torch

TINY_VIT = "vit:image_size=28,patch_size=7,hidden_size=32,num_hidden_layers=2,num_attention_heads=2," \
           "intermediate_size=64"
TINY_GPT2 = "gpt2:n_layer=2,n_embd=32,n_head=2,n_positions=128,resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"


def train(tmp_path, **values):
    metrics = effitrain.train({"output_dir": str(tmp_path / "out"), "lr": 1e-3, "log_every": 1, **values})
    return metrics, tmp_path / "out"


def test_sentence_pairs_mrpc_style(tiny_model_dir, tmp_path):
    rows = [("The cat sat on the mat.", "A cat was sitting on the mat.", "1"),
            ("Stocks fell sharply today.", "The weather is sunny.", "0")] * 12
    path = tmp_path / "mrpc.csv"
    path.write_text("#1 String,#2 String,Quality\n" + "\n".join(",".join(r) for r in rows) + "\n")
    metrics, out = train(tmp_path, model=str(tiny_model_dir), data=str(path), text_column="#1 String",
                         text_pair_column="#2 String", label_column="Quality", max_steps=4, batch_size=4)
    assert metrics["labels"] == ["0", "1"] and metrics["steps"] == 4

    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out / "model")
    config = TrainConfig(data=str(path), text_column="#1 String", text_pair_column="#2 String",
                         label_column="Quality")
    splits = tasks.get(config.task).load_data(config).splits
    encoded = text.tokenize(splits, tokenizer, 64)
    first = splits["train"][0]
    assert encoded["train"][0]["input_ids"] == tokenizer(first["text"], first["text_pair"])["input_ids"]
    assert set(encoded["train"][0]["token_type_ids"]) == {0, 1}  # two segments


def test_fashion_mnist_few_steps(tmp_path):
    metrics, out = train(tmp_path, task="image-classification", data="fashion-mnist", model=TINY_VIT,
                         max_steps=5, batch_size=16, max_train_samples=200, max_eval_samples=50)
    assert metrics["steps"] == 5 and len(metrics["labels"]) == 10
    assert metrics["train_tokens_per_second"] is None and metrics["test"]["samples"] == 50
    from transformers import AutoImageProcessor, AutoModelForImageClassification

    assert AutoModelForImageClassification.from_pretrained(out / "model").config.id2label[9] == "ankle boot"
    assert (out / "model" / "preprocessor_config.json").is_file()
    AutoImageProcessor.from_pretrained(out / "model")


def test_digits_learn_from_random_init(tmp_path):
    metrics, _ = train(tmp_path, task="image-classification", data="digits",
                       model=TINY_VIT.replace("image_size=28,patch_size=7", "image_size=8,patch_size=4"),
                       epochs=3, batch_size=32)
    assert metrics["test"]["accuracy"] > 0.5  # 10 classes: chance is 0.1


def write_tones(folder, count=24):
    """Low (220-330 Hz) and high (1.5-2.5 kHz) tones of different lengths and sample rates."""
    import soundfile

    folder.mkdir()
    rows = []
    rng = np.random.default_rng(0)
    for i in range(count):
        label = ["low", "high"][i % 2]
        rate = [8000, 16000, 22050][i % 3]
        freq = rng.uniform(220, 330) if label == "low" else rng.uniform(1500, 2500)
        t = np.arange(int(rate * rng.uniform(0.3, 0.8))) / rate
        soundfile.write(folder / f"clip{i}.wav", 0.5 * np.sin(2 * np.pi * freq * t), rate)
        rows.append(f"clips/clip{i}.wav,{label}")
    (folder.parent / "audio.csv").write_text("path,label\n" + "\n".join(rows) + "\n")
    return folder.parent / "audio.csv"


def test_audio_classification_on_generated_tones(tmp_path):
    csv = write_tones(tmp_path / "clips")
    model = ("wav2vec2:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,intermediate_size=64,"
             "conv_dim=[32,32],conv_stride=[5,4],conv_kernel=[10,8],num_feat_extract_layers=2,"
             "num_conv_pos_embeddings=16,num_conv_pos_embedding_groups=2")
    metrics, out = train(tmp_path, task="audio-classification", data=str(csv), audio_column="path", model=model,
                         max_steps=4, batch_size=4, max_duration=0.5)
    assert metrics["labels"] == ["high", "low"] and metrics["steps"] == 4
    assert (out / "model" / "preprocessor_config.json").is_file()


def test_audio_file_that_fails_to_decode_is_named(tmp_path):
    from effitrain.errors import UserError

    csv = write_tones(tmp_path / "clips")
    (tmp_path / "clips" / "clip3.wav").write_bytes(b"not audio")
    with pytest.raises(UserError, match="clip3.wav could not be decoded"):
        train(tmp_path, task="audio-classification", data=str(csv), audio_column="path",
              model="wav2vec2:hidden_size=32,num_hidden_layers=1,num_attention_heads=2,intermediate_size=32",
              max_steps=1)


def test_causal_lm_with_packing_trains(tmp_path):
    metrics, out = train(tmp_path, task="causal-lm", data="sms-spam", model=TINY_GPT2, packing=True,
                         max_steps=6, batch_size=8, max_train_samples=200, max_eval_samples=40)
    assert metrics["labels"] is None and metrics["test"]["perplexity"] > 1
    losses = [r["loss"] for r in map(json.loads, (out / "log.jsonl").read_text().splitlines()) if "split" not in r]
    assert losses[-1] < losses[0]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "model")


def test_packed_loss_equals_unpacked_mean_token_loss():
    """Same sequences, once padded in a batch and once packed in one row: same mean token loss, since
    attention stays inside each example and position ids restart."""
    from effitrain import tasks
    from effitrain.data import text
    from effitrain.models.loading import config_for, default_model_dir
    from transformers import AutoTokenizer

    LM = tasks.get("causal-lm")
    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    config = config_for("gpt2", "n_layer=2,n_embd=32,n_head=2,n_positions=128")
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    model = __import__("transformers").AutoModelForCausalLM.from_config(config).eval()
    texts = ["a short one", "a much longer sentence that has quite a few more tokens in it", "mid length text here"]
    features = [{"input_ids": tokenizer(t)["input_ids"]} for t in texts]
    padded = text.lm_collator(tokenizer)([dict(f) for f in features])
    packed = text.packing_collator()([dict(f) for f in features])
    assert packed["input_ids"].shape[0] == 1 and "attention_mask" not in packed
    with torch.no_grad():
        mean_padded = LM.loss_sum(model, padded) / LM.item_count(padded)
        mean_packed = LM.loss_sum(model, packed) / LM.item_count(packed)
        # Without restarting positions the packed row would attend across examples: a different loss.
        crossing = {k: v for k, v in packed.items() if k != "position_ids"}
        mean_crossing = LM.loss_sum(model, crossing) / LM.item_count(crossing)
    assert LM.item_count(padded) == LM.item_count(packed)
    torch.testing.assert_close(mean_packed, mean_padded, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(mean_crossing, mean_padded, rtol=1e-3)


def test_padded_text_batches_learn_the_eos_token_as_packed_ones_do():
    """A pad token that is the end-of-text token (GPT-2's, here the packaged tokenizer's [SEP] made its pad):
    padding is found by the attention mask, so a real one in a text keeps its label padded as packed (the
    same labels, the same tokens counted)."""
    from effitrain.data import text
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tokenizer.pad_token = tokenizer.sep_token
    eos = tokenizer.sep_token_id
    features = [{"input_ids": [5, 6, eos]}, {"input_ids": [7, 8, 9, 10, eos]}]
    padded = text.lm_collator(tokenizer, None)([dict(f) for f in features])
    packed = text.packing_collator()([dict(f) for f in features])
    assert padded["labels"].tolist() == [[5, 6, eos, -100, -100], [7, 8, 9, 10, eos]]
    assert padded["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1] * 5]
    shifted_real = [label for row in padded["labels"][:, 1:].tolist() for label in row if label != -100]
    assert shifted_real == [label for label in packed["labels"][0, 1:].tolist() if label != -100]


def test_preprocessing_is_cached_and_reused(tiny_model_dir):
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = TrainConfig(max_train_samples=50, max_eval_samples=20)
    splits = tasks.get(config.task).load_data(config).splits
    first = text.tokenize(splits, tokenizer, 32)
    second = text.tokenize(splits, tokenizer, 32)
    other = text.tokenize(splits, tokenizer, 16)
    files = [d["train"].cache_files[0]["filename"] for d in (first, second, other)]
    assert files[0] == files[1] != files[2]
    # The fingerprint comes from the same hash as the file (datasets does not hash the tokenizer for it).
    assert first["train"]._fingerprint == second["train"]._fingerprint != other["train"]._fingerprint


def test_the_cache_knows_a_tokenizer_by_what_it_does_not_by_its_folder(tiny_model_dir, tmp_path):
    """A tokenizer saved again in the same folder with other tokens (same name, same size) gets its own
    preprocessed splits, not the earlier tokenizer's; the same tokenizer loaded again reuses them."""
    from effitrain import tasks
    from effitrain.config import TrainConfig
    from effitrain.data import text
    from effitrain.models import character_tokenizer
    from transformers import AutoTokenizer

    splits = tasks.get("sequence-classification").load_data(
        TrainConfig(max_train_samples=20, max_eval_samples=8)).splits
    folder = tmp_path / "tok"
    character_tokenizer.character_tokenizer().save_pretrained(folder)
    first = text.tokenize(splits, AutoTokenizer.from_pretrained(folder), 32)
    again = text.tokenize(splits, AutoTokenizer.from_pretrained(folder), 32)
    vocabulary = character_tokenizer.vocabulary()
    swapped = dict(vocabulary, a=vocabulary["b"], b=vocabulary["a"])  # the same tokens and size, two ids swapped
    from transformers import BertTokenizer

    BertTokenizer(vocab=swapped, do_lower_case=False, tokenize_chinese_chars=False,
                  strip_accents=False).save_pretrained(folder)
    changed = text.tokenize(splits, AutoTokenizer.from_pretrained(folder), 32)
    files = [d["train"].cache_files[0]["filename"] for d in (first, again, changed)]
    assert files[0] == files[1] != files[2]
    assert first["train"]["input_ids"] != changed["train"]["input_ids"]
