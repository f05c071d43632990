"""Image data: processor choice, decoding and its errors, preprocessing to batches, and a tiny ViT on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from effitrain.data import image
from effitrain.errors import UserError
from PIL import Image

LABELS = ["cat", "dog", "bird"]


@pytest.fixture(scope="module")
def vit_config():
    from transformers import ViTConfig

    return ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=64, num_labels=3)


@pytest.fixture(scope="module")
def processor(vit_config):
    return image.image_processor(None, vit_config)


def noise(height, width, mode="RGB", seed=0):
    shape = (height, width) if mode == "L" else (height, width, 3)
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8), mode)


def test_processor_from_config_resizes_and_maps_to_minus_one_one(processor):
    white = Image.new("RGB", (50, 20), (255, 255, 255))
    black = Image.new("RGB", (17, 90), (0, 0, 0))
    pixels = processor(images=[white, black], return_tensors="np")["pixel_values"]
    assert pixels.shape == (2, 3, 32, 32)
    np.testing.assert_allclose(pixels[0], 1.0, atol=1e-6)
    np.testing.assert_allclose(pixels[1], -1.0, atol=1e-6)


def test_processor_size_may_be_a_pair():
    from types import SimpleNamespace

    processor = image.image_processor(None, SimpleNamespace(image_size=[48, 48]))
    assert processor(images=[noise(10, 10)], return_tensors="np")["pixel_values"].shape == (1, 3, 48, 48)


def test_saved_processor_is_loaded_from_the_model_dir(tmp_path, processor):
    processor.save_pretrained(tmp_path)
    loaded = image.image_processor(tmp_path, None)
    assert loaded(images=[noise(40, 40)], return_tensors="np")["pixel_values"].shape == (1, 3, 32, 32)


def test_grayscale_becomes_rgb_and_relative_paths_load(tmp_path):
    assert image.load_image(noise(8, 8, "L"), None).mode == "RGB"
    noise(12, 7, "L").save(tmp_path / "gray.png")
    loaded = image.load_image("gray.png", tmp_path)
    assert loaded.mode == "RGB" and loaded.size == (7, 12)
    assert image.load_image({"bytes": (tmp_path / "gray.png").read_bytes(), "path": None}, None).mode == "RGB"


def test_missing_and_garbage_files_are_one_line_user_errors(tmp_path):
    (tmp_path / "garbage.png").write_bytes(b"this is not a png\n" * 10)
    for name in ("missing.png", "garbage.png"):
        with pytest.raises(UserError, match=f"image file .*{name} could not be decoded") as caught:
            image.load_image(name, tmp_path)
        assert "\n" not in str(caught.value)


def splits_of(images, labels):
    from datasets import ClassLabel, Dataset, DatasetDict

    dataset = Dataset.from_dict({"image": images, "label": labels}).cast_column("label", ClassLabel(names=LABELS))
    return DatasetDict(train=dataset, test=dataset.select(range(min(2, len(dataset)))))


@pytest.fixture(scope="module")
def pil_splits():
    from datasets import Image as ImageFeature

    images = [noise(20 + 7 * i, 45 - 5 * i, "L" if i == 2 else "RGB", seed=i) for i in range(5)]
    return splits_of(images, [0, 1, 2, 1, 0]).cast_column("image", ImageFeature())


def test_preprocess_and_collate_pil_images(pil_splits, processor):
    encoded = image.preprocess(pil_splits, processor, None)
    assert set(encoded["train"].column_names) == {"pixel_values", "labels"}
    row = encoded["train"][0]
    assert row["pixel_values"].dtype == np.float32 and row["pixel_values"].shape == (3, 32, 32)
    batch = image.collator()([encoded["train"][i] for i in range(5)])
    assert batch["pixel_values"].shape == (5, 3, 32, 32) and batch["pixel_values"].dtype == torch.float32
    assert batch["labels"].dtype == torch.long and batch["labels"].tolist() == [0, 1, 2, 1, 0]
    assert len(encoded["test"]) == 2


def test_preprocess_fingerprint_is_deterministic(pil_splits, processor):
    # datasets falls back to a random fingerprint (and no caching) when it cannot hash the function.
    first = image.preprocess(pil_splits, processor, None)["train"]._fingerprint
    assert image.preprocess(pil_splits, processor, None)["train"]._fingerprint == first


@pytest.mark.parametrize("as_feature", [False, True], ids=["strings", "image-feature"])
def test_preprocess_paths_relative_to_base_dir(tmp_path, processor, as_feature):
    (tmp_path / "imgs").mkdir()
    names = []
    for i in range(3):
        names.append(f"imgs/{i}.png")
        noise(10 + 9 * i, 30, seed=i).save(tmp_path / names[-1])
    splits = splits_of(names, [2, 0, 1])
    if as_feature:
        from datasets import Image as ImageFeature

        splits = splits.cast_column("image", ImageFeature())
    encoded = image.preprocess(splits, processor, tmp_path)
    batch = image.collator()([encoded["train"][i] for i in range(3)])
    assert batch["pixel_values"].shape == (3, 3, 32, 32)
    assert batch["labels"].tolist() == [2, 0, 1]
    expected = processor(images=[image.load_image(tmp_path / names[0], None)], return_tensors="np")["pixel_values"]
    np.testing.assert_allclose(batch["pixel_values"][0].numpy(), expected[0], atol=1e-6)


def test_a_bad_file_in_the_data_names_it(tmp_path, processor):
    (tmp_path / "broken.png").write_bytes(b"\x89PNG garbage")
    with pytest.raises(UserError, match="broken.png could not be decoded"):
        image.preprocess(splits_of(["broken.png"], [0]), processor, tmp_path)


def test_tiny_vit_trains_on_a_collated_batch(pil_splits, processor, vit_config):
    from transformers import ViTForImageClassification

    torch.manual_seed(0)
    model = ViTForImageClassification(vit_config)
    batch = image.collator()(list(image.preprocess(pil_splits, processor, None)["train"]))
    out = model(**batch)
    assert out.logits.shape == (5, 3) and torch.isfinite(out.loss)
    out.loss.backward()
    grad = model.classifier.weight.grad
    assert grad is not None and grad.abs().sum() > 0
