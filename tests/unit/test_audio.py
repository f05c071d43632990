"""Audio data: decoding and resampling checked on generated tones, then extractor -> collator -> a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import soundfile as sf
from effitrain.data import audio
from effitrain.errors import UserError


def tone(path, rate: int, seconds: float, freq: float = 440.0, channels: int = 1):
    t = np.arange(int(round(seconds * rate))) / rate
    wave = 0.5 * np.sin(2 * np.pi * freq * t)
    sf.write(str(path), np.stack([wave] * channels, axis=1) if channels > 1 else wave, rate)
    return str(path)


def peak_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[np.argmax(spectrum)])


@pytest.mark.parametrize("source_rate", [8000, 44100])
def test_decode_resamples_and_keeps_the_pitch(tmp_path, source_rate):
    path = tone(tmp_path / f"{source_rate}.wav", source_rate, 1.5, freq=440.0)
    samples = audio.decode(path, 16000, None)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 1.5 * 16000) <= 1
    assert peak_hz(samples, 16000) == pytest.approx(440.0, rel=0.02)


def test_decode_mixes_stereo_to_mono_and_truncates(tmp_path):
    path = tone(tmp_path / "stereo.flac", 16000, 2.0, freq=1000.0, channels=2)
    samples = audio.decode(path, 16000, None)
    assert samples.shape == (32000,)
    assert peak_hz(samples, 16000) == pytest.approx(1000.0, rel=0.02)
    assert audio.decode(path, 16000, 0.5).shape == (8000,)
    # Truncation also lands exactly when the file is resampled.
    assert audio.decode(tone(tmp_path / "long.wav", 44100, 3.0), 16000, 1.25).shape == (20000,)


def test_missing_and_garbage_files_are_user_errors(tmp_path):
    garbage = tmp_path / "noise.wav"
    garbage.write_bytes(np.random.default_rng(0).bytes(4096))
    for path in (str(tmp_path / "missing.wav"), str(garbage)):
        with pytest.raises(UserError) as info:
            audio.decode(path, 16000, None)
        assert path in str(info.value) and "\n" not in str(info.value)
        assert "could not be decoded" in info.value.problem


def splits_of_tones(tmp_path, seconds=(0.5, 1.0, 0.75)):
    """A DatasetDict whose `audio` column holds paths relative to tmp_path, at mixed source rates."""
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    rates = (8000, 16000, 44100)
    paths = [tone(tmp_path / f"clip{i}.wav", rates[i % 3], s, freq=300.0 * (i + 1)) for i, s in enumerate(seconds)]
    names = [p.rsplit("/", 1)[1] for p in paths]
    features = Features({"audio": Value("string"), "label": ClassLabel(names=["low", "high"])})
    data = Dataset.from_dict({"audio": names, "label": [i % 2 for i in range(len(names))]}, features=features)
    return DatasetDict(train=data)


def test_wav2vec2_batches_are_padded_to_the_longest_with_a_mask(tmp_path):
    extractor = audio.feature_extractor(None, "wav2vec2")
    encoded = audio.preprocess(splits_of_tones(tmp_path), extractor, max_duration=10.0, base_dir=tmp_path)
    train = encoded["train"]
    assert set(train.column_names) == {"input_values", "attention_mask", "labels"}
    assert [len(x) for x in train["input_values"]] == [8000, 16000, 12000]  # unpadded per example

    batch = audio.collator(extractor)([train[i] for i in range(3)])
    assert batch["input_values"].shape == (3, 16000) and batch["input_values"].dtype.is_floating_point
    assert batch["attention_mask"].shape == (3, 16000)
    assert batch["attention_mask"].sum(dim=1).tolist() == [8000, 16000, 12000]
    assert batch["attention_mask"][0, :8000].all() and not batch["attention_mask"][0, 8000:].any()
    assert (batch["input_values"][0, 8000:] == 0).all()
    assert batch["labels"].tolist() == [0, 1, 0]
    assert str(batch["labels"].dtype) == "torch.int64"

    # max_duration cuts at preprocessing time.
    short = audio.preprocess(splits_of_tones(tmp_path), extractor, max_duration=0.6, base_dir=tmp_path)
    assert [len(x) for x in short["train"]["input_values"]] == [8000, 9600, 9600]


def test_ast_batches_are_fixed_size_spectrograms(tmp_path):
    import torch
    from transformers import ASTConfig, ASTForAudioClassification

    extractor = audio.feature_extractor(None, "audio-spectrogram-transformer")
    encoded = audio.preprocess(splits_of_tones(tmp_path, seconds=(0.5, 1.0)), extractor, 10.0, tmp_path)
    batch = audio.collator(extractor)([encoded["train"][i] for i in range(2)])
    # transformers' ASTFeatureExtractor names its output input_values (ASTForAudioClassification's argument),
    # not input_features.
    assert set(batch) == {"input_values", "labels"}
    assert batch["input_values"].shape == (2, 1024, 128) and batch["input_values"].dtype == torch.float32
    assert batch["labels"].tolist() == [0, 1]

    torch.manual_seed(0)
    config = ASTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                       frequency_stride=16, time_stride=16, num_labels=2)
    loss = ASTForAudioClassification(config)(**batch).loss
    assert torch.isfinite(loss)


def test_a_checkpoint_extractor_is_loaded_from_the_model_dir(tmp_path):
    from transformers import Wav2Vec2FeatureExtractor

    audio.feature_extractor(None, "wav2vec2").__class__(sampling_rate=8000).save_pretrained(tmp_path)
    loaded = audio.feature_extractor(tmp_path, "audio-spectrogram-transformer")
    assert isinstance(loaded, Wav2Vec2FeatureExtractor) and loaded.sampling_rate == 8000
    assert isinstance(audio.feature_extractor(tmp_path / "nothing-here", "wav2vec2"), Wav2Vec2FeatureExtractor)


def test_a_bad_file_in_the_data_names_it(tmp_path):
    from datasets import ClassLabel, Dataset, DatasetDict, Features, Value

    features = Features({"audio": Value("string"), "label": ClassLabel(names=["a", "b"])})
    data = DatasetDict(train=Dataset.from_dict({"audio": ["gone.wav"], "label": [0]}, features=features))
    with pytest.raises(UserError, match="gone.wav could not be decoded"):
        audio.preprocess(data, audio.feature_extractor(None, "wav2vec2"), 5.0, tmp_path)


def test_collated_batch_trains_a_tiny_wav2vec2(tmp_path):
    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    extractor = audio.feature_extractor(None, "wav2vec2")
    encoded = audio.preprocess(splits_of_tones(tmp_path), extractor, 10.0, tmp_path)
    batch = audio.collator(extractor)([encoded["train"][i] for i in range(3)])

    torch.manual_seed(0)
    config = Wav2Vec2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                            conv_dim=(32, 32), conv_stride=(5, 4), conv_kernel=(10, 8), num_feat_extract_layers=2,
                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, num_labels=2)
    model = Wav2Vec2ForSequenceClassification(config)
    out = model(**batch)
    assert out.logits.shape == (3, 2)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grad = model.classifier.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    assert model.wav2vec2.feature_extractor.conv_layers[0].conv.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kernels, strides, expected", [
    ((10, 3, 3, 3, 3, 2, 2), (5, 2, 2, 2, 2, 2, 2), 400),  # wav2vec2-base: 25 ms at 16 kHz
    ((10, 8), (5, 4), 45),
])
def test_shortest_clip_is_where_the_convolutions_give_their_first_frame(kernels, strides, expected):
    from types import SimpleNamespace

    import torch
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(conv_kernel=list(kernels), conv_stride=list(strides), conv_dim=[8] * len(kernels),
                            num_feat_extract_layers=len(kernels))
    assert audio.shortest_clip(config) == expected
    # transformers' own count of frames (it reads only self.config): one at the minimum, none a sample below
    model = SimpleNamespace(config=config)
    assert int(Wav2Vec2Model._get_feat_extract_output_lengths(model, torch.tensor(expected))) == 1
    assert int(Wav2Vec2Model._get_feat_extract_output_lengths(model, torch.tensor(expected - 1))) == 0


def test_shortest_clip_is_zero_for_spectrogram_models():
    from transformers import ASTConfig

    assert audio.shortest_clip(ASTConfig()) == 0


def test_a_clip_shorter_than_the_minimum_is_named(tmp_path):
    path = tone(tmp_path / "short.wav", 16000, 44 / 16000)
    assert len(audio.decode(path, 16000, None, min_samples=44)) == 44
    with pytest.raises(UserError, match=r"short.wav is 0.00275 s \(44 samples at 16000 Hz\), shorter than the "
                                        r"model's receptive field of 45 samples"):
        audio.decode(path, 16000, None, min_samples=45)


def test_skip_bad_rows_leaves_out_a_clip_shorter_than_the_receptive_field(tmp_path):
    """--skip-bad-rows skips what preprocessing would refuse: a clip the model's convolutions make no frame of
    (decoded at the extractor's rate, as preprocessing decodes it), beside files that do not decode."""
    from datasets import Dataset
    from effitrain import tasks
    from effitrain.config import TrainConfig

    model = ("wav2vec2:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=16,conv_dim=[8,8],"
             "conv_kernel=[10,8],conv_stride=[5,4],num_feat_extract_layers=2,num_conv_pos_embeddings=4,"
             "num_conv_pos_embedding_groups=2")  # a receptive field of 45 samples
    clips = [tone(tmp_path / "long.wav", 16000, 0.05), tone(tmp_path / "short.wav", 16000, 44 / 16000),
             tone(tmp_path / "short_44k.wav", 44100, 100 / 44100)]  # 36 samples once at 16 kHz
    (tmp_path / "broken.wav").write_bytes(b"not audio")
    data = Dataset.from_dict({"audio": [*map(str, clips), str(tmp_path / "broken.wav")]})
    config = TrainConfig(task="audio-classification", model=model, audio_column="audio", skip_bad_rows=True)
    assert tasks.for_config(config)._undecodable(config, data, None) == [1, 2, 3]
