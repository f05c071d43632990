"""Audio preprocessing: files decoded to mono float32 at the extractor's rate, then the model's feature extractor."""

from __future__ import annotations

import warnings
from pathlib import Path

from effitrain.data import cache
from effitrain.errors import UserError


def decode(path: str, sampling_rate: int, max_duration: float | None, min_samples: int = 0):
    """Mono float32 samples at `sampling_rate`, cut to `max_duration` seconds when given; a UserError when
    fewer than `min_samples` remain (the model's receptive field: see shortest_clip)."""
    from math import ceil, gcd

    import numpy as np
    import soundfile as sf
    from scipy.signal import resample_poly

    fix = "check the path, and that the file is audio soundfile reads (WAV, FLAC, OGG, MP3)"
    if not Path(path).is_file():
        reason = "it is not a file" if Path(path).exists() else "no such file"
        raise UserError(f"audio file {path} could not be decoded: {reason}", fix)
    try:
        with sf.SoundFile(path) as f:
            source_rate = f.samplerate
            # Read only what is kept: long recordings cut to a few seconds cost a few seconds of decoding.
            frames = -1 if max_duration is None else ceil(max_duration * source_rate)
            samples = f.read(frames, dtype="float32", always_2d=True)
    except (sf.SoundFileError, RuntimeError, OSError) as err:
        # libsndfile's own words ("Format not recognised."), without soundfile's "Error opening '<path>':" prefix.
        reason = getattr(err, "error_string", None) or (str(err).strip().splitlines() or [type(err).__name__])[-1]
        raise UserError(f"audio file {path} could not be decoded: {reason.rstrip('.')[:200]}", fix)
    if samples.shape[0] == 0:
        raise UserError(f"audio file {path} could not be decoded: it holds no samples",
                        "remove the row or replace the file with a non-empty recording")
    audio = samples.mean(axis=1, dtype=np.float32)
    if source_rate != sampling_rate:
        # The smallest integer up/down pair: 44.1 kHz -> 16 kHz is 160/441, not 16000/44100 (a far longer filter).
        g = gcd(sampling_rate, source_rate)
        audio = resample_poly(audio, sampling_rate // g, source_rate // g)
    if max_duration is not None:
        # The read above rounds up at the source rate; cut exactly at the target rate.
        audio = audio[: int(round(max_duration * sampling_rate))]
    if len(audio) < min_samples:
        raise UserError(f"audio file {path} is {len(audio) / sampling_rate:.4g} s ({len(audio)} samples at "
                        f"{sampling_rate} Hz), shorter than the model's receptive field of {min_samples} samples "
                        f"({min_samples / sampling_rate:.4g} s): its convolutions give no frame for it",
                        f"drop the row or give clips of at least {min_samples / sampling_rate:.4g} s")
    return np.ascontiguousarray(audio, dtype=np.float32)


def shortest_clip(model_config) -> int:
    """The fewest samples a wav2vec2-style model (a stack of strided 1-D convolutions over the waveform:
    conv_kernel, conv_stride) turns into at least one frame; 0 for models of spectrograms (AST, Whisper).

    Refused rather than padded: the extractor pads only to the longest clip of a batch, so such a clip
    either fails the convolution (alone in its batch) or, padded beside longer ones, is masked out
    entirely and its pooled output is 0/0 (NaN)."""
    kernels, strides = getattr(model_config, "conv_kernel", None), getattr(model_config, "conv_stride", None)
    if not isinstance(kernels, (list, tuple)) or not isinstance(strides, (list, tuple)):
        return 0
    # Backwards from one output frame: each layer needs (frames - 1) * stride + kernel inputs.
    needed = 1
    for kernel, stride in reversed(list(zip(kernels, strides))):
        needed = (needed - 1) * int(stride) + int(kernel)
    return needed


def located(path: str, base_dir) -> str:
    """A path from the data, relative to the data's folder unless absolute."""
    return path if base_dir is None or Path(path).is_absolute() else str(Path(base_dir) / path)


def check(path: str, max_duration: float | None) -> None:
    """A UserError if `path` does not decode (as decode would read it), without resampling."""
    import soundfile as sf

    try:
        rate = sf.info(path).samplerate if Path(path).is_file() else 16000
    except (sf.SoundFileError, RuntimeError, OSError):
        rate = 16000  # decode says why
    decode(path, rate, max_duration)


def feature_extractor(model_dir, model_type: str):
    """The checkpoint's own extractor, or the family default for a model trained from a config."""
    from transformers import (
        ASTFeatureExtractor,
        AutoFeatureExtractor,
        Wav2Vec2FeatureExtractor,
    )

    # Without torchaudio, transformers builds AST's Kaldi mel bank in numpy and warns that the lowest of the
    # 128 filters are empty at 16 kHz; Kaldi's fbank (which AST was trained on) has the same empty filters.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="At least one mel filter has all zero values")
        if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file():
            return AutoFeatureExtractor.from_pretrained(str(model_dir), local_files_only=True)
        if model_type == "audio-spectrogram-transformer":
            return ASTFeatureExtractor()
    return Wav2Vec2FeatureExtractor(feature_size=1, sampling_rate=16000, padding_value=0.0, do_normalize=True,
                                    return_attention_mask=True)


def preprocess(splits, extractor, max_duration: float, base_dir, min_samples: int = 0):
    """Decode every `audio` path (none shorter than `min_samples`) and run the extractor; waveform features
    stay unpadded (padding is per batch)."""
    rate = extractor.sampling_rate

    def encode(batch):
        arrays = [decode(located(path, base_dir), rate, max_duration, min_samples) for path in batch["audio"]]
        return extractor(arrays, sampling_rate=rate)

    # Small batches: a batch holds its decoded waveforms (and AST's 512 KB spectrograms) in memory at once.
    # min_samples in the key: data cached for a model with a smaller receptive field is checked again.
    key = [extractor.to_dict(), max_duration, cache.file_signature(splits, "audio", base_dir), min_samples]
    encoded = cache.map_splits(splits, encode, key, batched=True, batch_size=64, writer_batch_size=64,
                               remove_columns=["audio"])
    return encoded.rename_column("label", "labels")


def collator(extractor):
    """Waveforms padded to the longest in the batch (with their attention mask); fixed-size spectrograms stacked."""
    import numpy as np
    import torch

    key = extractor.model_input_names[0]  # input_values for wav2vec2-style and AST, input_features for Whisper-style

    def collate(features: list[dict]) -> dict:
        labels = torch.tensor([f["labels"] for f in features], dtype=torch.long)
        # Rows come from the Dataset as Python lists; a 2-D example is a spectrogram the extractor already sized.
        first = np.asarray(features[0][key])
        if first.ndim == 2:
            values = torch.from_numpy(np.stack([np.asarray(f[key], dtype=np.float32) for f in features]))
            return {key: values, "labels": labels}
        inputs = [{name: f[name] for name in (key, "attention_mask") if name in f} for f in features]
        batch = dict(extractor.pad(inputs, padding="longest", return_tensors="pt"))
        batch["labels"] = labels
        return batch

    return collate
