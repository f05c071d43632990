"""--distill-from with image and audio teachers (tasks/distillation.py): the teacher runs on the inputs the
student's processor made, so its processor (size, mean/std, rescaling, channels; sampling rate, feature extractor)
must be the student's, else it is refused in one line; a matching image teacher's stored logits are its forward
on the processed images."""

import numpy as np
import pytest
import torch
from effitrain import tasks
from effitrain.data import audio, image
from effitrain.errors import UserError
from effitrain.tasks import distillation
from effitrain.tasks.distillation import Distillation

LABELS = ["cat", "dog"]
ID2LABEL, LABEL2ID = {0: "cat", 1: "dog"}, {"cat": 0, "dog": 1}


def vit_config(**changes):
    from transformers import ViTConfig

    settings = dict(image_size=16, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    intermediate_size=16, id2label=ID2LABEL, label2id=LABEL2ID)
    return ViTConfig(**{**settings, **changes})


def save_vit(folder, config, processor=None, seed=1):
    """A teacher folder: a ViT classifier of seeded weights, and the processor given (else the one effitrain
    makes from its config)."""
    from transformers import ViTForImageClassification

    torch.manual_seed(seed)
    ViTForImageClassification(config).save_pretrained(folder)
    (processor or image.image_processor(None, config)).save_pretrained(folder)
    return str(folder)


def refusal(task_name, teacher, processor, student_config) -> str:
    task = tasks.get(task_name)
    with pytest.raises(UserError) as refused:
        Distillation(teacher).check_teacher(task, LABELS, processor, student_config)
    assert "\n" not in str(refused.value) and refused.value.fix
    return refused.value.problem


def test_processor_differences_name_each_setting_theirs_then_ours():
    ours = image.image_processor(None, vit_config())
    theirs = image.image_processor(None, vit_config(image_size=32))
    theirs.image_mean = [0.485, 0.456, 0.406]
    assert distillation.processor_differences(theirs, ours) == [
        "image_mean [0.485, 0.456, 0.406] vs [0.5, 0.5, 0.5]",
        'size {"height": 32, "width": 32} vs {"height": 16, "width": 16}']
    # Spellings of one setting (a tuple and a list, PIL's enum and its number) are not differences.
    same = image.image_processor(None, vit_config())
    same.image_mean, same.resample = [0.5, 0.5, 0.5], int(same.resample)
    assert distillation.processor_differences(same, ours) == []
    # A setting only one of them has.
    wav2vec2 = audio.feature_extractor(None, "wav2vec2")
    ast = audio.feature_extractor(None, "audio-spectrogram-transformer")
    differences = distillation.processor_differences(ast, wav2vec2)
    assert 'feature_extractor_type "ASTFeatureExtractor" vs "Wav2Vec2FeatureExtractor"' in differences
    assert "num_mel_bins 128 vs null" in differences and "return_attention_mask false vs true" in differences


def test_an_image_teacher_with_the_students_processor_is_accepted(tmp_path):
    """The student built from a config, the teacher a saved run of the same shape (its processor saved, read
    back from preprocessor_config.json): nothing differs."""
    teacher = save_vit(tmp_path / "teacher", vit_config(hidden_size=32))
    student = vit_config()
    Distillation(teacher).check_teacher(tasks.get("image-classification"), LABELS,
                                        image.image_processor(None, student), student)


def test_an_image_teacher_with_other_preprocessing_is_refused(tmp_path):
    student = vit_config()
    processor = image.image_processor(None, student)
    resized = save_vit(tmp_path / "resized", vit_config(image_size=32))
    assert refusal("image-classification", resized, processor, student) == (
        f"--distill-from {resized} has another image processor than the model trained (size "
        '{"height": 32, "width": 32} vs {"height": 16, "width": 16}: the teacher\'s vs the student\'s): the teacher '
        "would read inputs made otherwise than it was trained on")
    imagenet = image.image_processor(None, student)
    imagenet.image_mean, imagenet.image_std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    normalised = save_vit(tmp_path / "imagenet", vit_config(), imagenet)
    problem = refusal("image-classification", normalised, processor, student)
    assert "image_mean [0.485, 0.456, 0.406] vs [0.5, 0.5, 0.5]; image_std [0.229, 0.224, 0.225] vs [0.5, 0.5, " \
           "0.5]: the teacher's vs the student's" in problem
    unscaled = image.image_processor(None, student)
    unscaled.do_rescale = False
    assert "do_rescale false vs true" in refusal("image-classification", save_vit(tmp_path / "unscaled", student,
                                                                                    unscaled), processor, student)
    one_channel = save_vit(tmp_path / "gray", vit_config(num_channels=1))
    assert refusal("image-classification", one_channel, processor, student) == (
        f"--distill-from {one_channel} takes 1-channel images, the model trained 3")


def test_an_audio_teacher_with_another_feature_extractor_is_refused(tmp_path):
    from transformers import ASTConfig, ASTForAudioClassification, Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    tiny = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                id2label=ID2LABEL, label2id=LABEL2ID)
    wav2vec2 = Wav2Vec2Config(conv_dim=[8, 8], conv_kernel=[10, 8], conv_stride=[5, 4], num_feat_extract_layers=2,
                              num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, **tiny)
    student = audio.feature_extractor(None, "wav2vec2")

    def teacher(name, model, extractor):
        model.save_pretrained(tmp_path / name)
        extractor.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    same = teacher("same", Wav2Vec2ForSequenceClassification(wav2vec2), audio.feature_extractor(None, "wav2vec2"))
    Distillation(same).check_teacher(tasks.get("audio-classification"), LABELS, student, wav2vec2)
    slower = audio.feature_extractor(None, "wav2vec2")
    slower.sampling_rate = 8000
    at_8khz = teacher("8khz", Wav2Vec2ForSequenceClassification(wav2vec2), slower)
    assert refusal("audio-classification", at_8khz, student, wav2vec2) == (
        f"--distill-from {at_8khz} has another feature extractor than the model trained (sampling_rate 8000 vs "
        "16000: the teacher's vs the student's): the teacher would read inputs made otherwise than it was trained on")
    spectrogram = teacher("ast", ASTForAudioClassification(ASTConfig(frequency_stride=16, time_stride=16,
                                                                     max_length=64, num_mel_bins=16, **tiny)),
                          audio.feature_extractor(None, "audio-spectrogram-transformer"))
    problem = refusal("audio-classification", spectrogram, student, wav2vec2)
    assert 'feature_extractor_type "ASTFeatureExtractor" vs "Wav2Vec2FeatureExtractor"' in problem


def test_a_matching_image_teacher_distils_its_forward_on_the_processed_images(tmp_path):
    """Through Distillation.prepare (what before_training runs): each stored row is the teacher's forward on that
    image as the student's processor made it, and the file holds the same."""
    from datasets import ClassLabel, Dataset, DatasetDict
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import ViTForImageClassification

    config = vit_config()
    teacher_dir = save_vit(tmp_path / "teacher", vit_config(hidden_size=32, num_attention_heads=4), seed=3)
    processor = image.image_processor(None, config)
    rng = np.random.default_rng(0)
    pictures = [Image.fromarray(rng.integers(0, 256, (9 + 5 * i, 30 - 3 * i, 3), dtype=np.uint8)) for i in range(5)]
    split = Dataset.from_dict({"image": pictures, "label": [0, 1, 1, 0, 1]}).cast_column("label",
                                                                                          ClassLabel(names=LABELS))
    encoded = image.preprocess(DatasetDict(train=split, validation=split.select([0])), processor, None)
    task = tasks.get("image-classification").with_distillation(Distillation(teacher_dir))
    torch.manual_seed(0)
    student = ViTForImageClassification(config)
    task.check_built_model(student, encoded, processor, None)
    _, collate = task.collators(processor, None)
    out = task.distillation.prepare(task, student, encoded, processor, collate, 2, tmp_path)
    teacher = ViTForImageClassification.from_pretrained(teacher_dir).eval()
    pixels = processor(images=pictures, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        expected = teacher(pixel_values=pixels).logits
    stored = torch.tensor(np.array(out["train"][distillation.COLUMN]))
    torch.testing.assert_close(stored, expected, rtol=1e-5, atol=1e-5)
    assert stored.abs().max() > 0.1  # a teacher of real outputs, not zeros
    torch.testing.assert_close(load_file(str(tmp_path / distillation.FILE))["logits"], stored)
