"""Image preprocessing with the model's image processor (PIL backend), and batches of pixel tensors."""

from __future__ import annotations

from pathlib import Path

from effitrain.data import cache
from effitrain.errors import UserError


def image_processor(model_dir, config):
    """The checkpoint's own processor when it ships one; else a ViT-style one sized from the config.

    The PIL ("slow") backend always: the fast one needs torchvision, which effitrain does not install."""
    import transformers

    transformers_5 = int(transformers.__version__.split(".")[0]) >= 5
    if model_dir is not None and (Path(model_dir) / "preprocessor_config.json").is_file():
        # transformers 5 deprecates use_fast (it warns) in favour of backend="pil"; 4.x knows only use_fast.
        backend = {"backend": "pil"} if transformers_5 else {"use_fast": False}
        processor = transformers.AutoImageProcessor.from_pretrained(str(model_dir), local_files_only=True, **backend)
        check_size(processor, config, f"model {model_dir}")
        return processor
    if transformers_5:
        # In 5.x ViTImageProcessor is the torchvision backend; without torchvision it warns and falls back to this.
        from transformers import ViTImageProcessorPil as Processor
    else:
        from transformers import ViTImageProcessor as Processor
    size = getattr(config, "image_size", 224)
    if isinstance(size, (list, tuple)):
        size = size[0]
    # A randomly initialised model has no statistics to match: mean/std 0.5 map pixels to [-1, 1].
    return Processor(size={"height": int(size), "width": int(size)}, do_resize=True, do_normalize=True,
                     image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def check_size(processor, model_config, where: str) -> None:
    """The images the processor makes are the size the model's position embeddings were made for (its config's
    image_size, ViT-style models): another size fails the first forward, or is interpolated silently."""
    wanted = getattr(model_config, "image_size", None)
    if isinstance(wanted, int):
        wanted = (wanted, wanted)
    wanted = tuple(wanted) if isinstance(wanted, (list, tuple)) else None
    made = getattr(processor, "crop_size", None) if getattr(processor, "do_center_crop", False) else None
    made = made or getattr(processor, "size", None) or {}
    made = dict(made) if hasattr(made, "keys") else vars(made) if hasattr(made, "__dict__") else {}  # a SizeDict
    made = (made.get("height"), made.get("width"))
    if wanted is None or None in made or made == wanted or not getattr(processor, "do_resize", True):
        return
    raise UserError(f"{where}: its image processor makes {made[0]}x{made[1]} images, and its config's image_size is "
                    f"{wanted[0]}x{wanted[1]} (the size its position embeddings were made for)",
                    "make preprocessor_config.json's size (or crop_size) the config's image_size, or the other way "
                    "round")


def check_channels(model_config, where: str) -> None:
    """Every image is decoded as RGB (load_image: grayscale and RGBA converted, as HF processors' do_convert_rgb
    does), so the model must take 3 channels: another num_channels would fail the first step (ViT, ConvNeXt,
    ResNet check it) or, in a model that does not check, mix the channels up silently. Refused, not
    converted: a 3-channel processor's mean and std cannot normalise one channel."""
    channels = getattr(model_config, "num_channels", 3)
    if channels != 3:
        raise UserError(f"{where} takes {channels}-channel images (num_channels={channels}); effitrain decodes every "
                        "image as RGB (3 channels, grayscale ones converted)",
                        "use a model with num_channels=3 (e.g. --model vit:num_channels=3,...)")


def load_image(value, base_dir):
    """An RGB PIL image from a PIL image, a datasets.Image dict ({"bytes", "path"}) or a path relative to base_dir."""
    from io import BytesIO

    import PIL.Image
    import PIL.ImageOps

    if isinstance(value, PIL.Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    data, path = (value.get("bytes"), value.get("path")) if isinstance(value, dict) else (None, value)
    if data is None:
        if path is None:
            raise UserError("an image row holds neither bytes nor a path", "give every row an image or a file path")
        path = Path(path)
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
    try:
        image = PIL.Image.open(BytesIO(data) if data is not None else path)
        image.load()  # decode now, so a truncated file fails here and not inside the processor
    except FileNotFoundError:
        raise UserError(f"image file {path} could not be decoded: no such file",
                        "check the path (relative paths are read from the data's folder) or drop the row") from None
    except (OSError, ValueError, SyntaxError) as err:  # what PIL raises for unknown formats and corrupt data
        reason = "not a format Pillow reads" if isinstance(err, PIL.UnidentifiedImageError) else str(err)
        raise UserError(f"image file {path or '(in-memory bytes)'} could not be decoded: {reason}",
                        "replace it with a valid PNG or JPEG, or drop the row") from None
    # As datasets.Image decodes: camera photos are stored sideways with an orientation tag.
    if image.getexif().get(PIL.Image.ExifTags.Base.Orientation) is not None:
        image = PIL.ImageOps.exif_transpose(image)
    return image if image.mode == "RGB" else image.convert("RGB")


def _encode(batch, processor, base_dir):
    # Module level, with its inputs passed as fn_kwargs, so that datasets hashes the same things every run
    # and the cache fingerprint stays deterministic.
    import numpy as np

    images = [load_image(value, base_dir) for value in batch["image"]]
    # No return_tensors: a list of per-image arrays, whatever sizes the processor produces.
    pixels = processor(images=images)["pixel_values"]
    return {"pixel_values": [np.asarray(p, dtype=np.float32) for p in pixels]}


def preprocess(splits, processor, base_dir):
    """pixel_values (float32, channels first) per example and `labels`; image paths are relative to base_dir."""
    from datasets import Image

    if isinstance(next(iter(splits.values())).features["image"], Image):
        # Decode ourselves (load_image): relative paths then resolve against base_dir, and a bad file is a
        # UserError naming it instead of a PIL traceback from inside datasets. Changes no data, only the feature.
        splits = splits.cast_column("image", Image(decode=False))
    base_dir = None if base_dir is None else Path(base_dir)
    key = [processor.to_dict(), cache.file_signature(splits, "image", base_dir)]
    encoded = cache.map_splits(splits, _encode, key, batched=True, remove_columns=["image"],
                               fn_kwargs={"processor": processor, "base_dir": base_dir})
    encoded = encoded.rename_column("label", "labels")
    # Arrow holds pixel_values as nested lists; numpy format reads each row back as one array, not 3*s*s floats.
    return encoded.with_format("numpy", columns=["pixel_values"], output_all_columns=True)


def _collate(features):
    import numpy as np
    import torch

    pixels = np.stack([np.asarray(f["pixel_values"], dtype=np.float32) for f in features])
    labels = [int(f["labels"]) for f in features]
    return {"pixel_values": torch.from_numpy(pixels), "labels": torch.tensor(labels, dtype=torch.long)}


def collator():
    """Stack pixel_values (all the same size after the processor) and labels; module level so it pickles."""
    return _collate
