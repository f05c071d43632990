"""Table of user mistakes: each exits 2 with one line naming the problem and the fix, and leaves the
previous run's files exactly as they were."""

import hashlib
import os
import shutil

import pytest
import torch
from effitrain.runtime.devices import has_accelerator

from conftest import run_cli


def snapshot(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def workdir(tiny_model_dir, tmp_path_factory):
    """A folder with a finished run (prev/) and the broken inputs the cases point at."""
    root = tmp_path_factory.mktemp("bad")
    (root / "prev" / "model").mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, root / "prev" / "model" / name)
    (root / "prev" / "metrics.json").write_text('{"test": {"accuracy": 0.99}}\n')
    (root / "prev" / "log.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    (root / "empty.csv").write_text("")
    (root / "empty.jinja").write_text(" \n")
    (root / "dangling").symlink_to("nowhere/run")
    rows = "\n".join(f"message {i},{['ham', 'spam'][i % 2]}" for i in range(20))
    (root / "d.csv").write_text("text,label\n" + rows + "\n")
    (root / "badrow.csv").write_text("text,label\n" + rows + "\ntoo,many,fields\n")
    (root / "dev.csv").write_text("text,label\nhello,ham\nbuy now,promo\n")
    (root / "d.txt").write_text("plain text\n")
    (root / "bad.yaml").write_text("learning_rate: 0.1\n")
    (root / "plan-bad.yaml").write_text("plan:\n  pieces: 0\n")
    (root / "plan-edited.yaml").write_text("plan:\n  grad_accum: 1\n  pieces: 1\n  optim: sgd\n")
    (root / "badtype.yaml").write_text("lr: fast\n")
    (root / "corrupt").mkdir()
    shutil.copy(tiny_model_dir / "config.json", root / "corrupt" / "config.json")
    shutil.copy(tiny_model_dir / "tokenizer.json", root / "corrupt" / "tokenizer.json")
    (root / "corrupt" / "model.safetensors").write_bytes(b"\x00" * 64)
    (root / "pickled").mkdir()
    shutil.copy(tiny_model_dir / "config.json", root / "pickled" / "config.json")
    shutil.copy(tiny_model_dir / "tokenizer.json", root / "pickled" / "tokenizer.json")
    (root / "notok").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, root / "notok" / name)
    torch.save({}, root / "pickled" / "pytorch_model.bin")
    write_bad_data(root)
    write_bad_models(root, tiny_model_dir)
    write_orphan_adapter(root, tiny_model_dir)
    write_adapter_cases(root, tiny_model_dir)
    write_output_cases(root, tiny_model_dir)
    write_report_cases(root)
    write_chat_cases(root)
    write_preference_cases(root)
    write_rl_cases(root)
    write_mismatched_media(root)
    write_distill_cases(root)
    return root


def write_distill_cases(root):
    """--distill-from teachers: a folder without a model, one of sms-spam's labels (d.csv's: ham, spam)."""
    import json

    from effitrain.models import character_tokenizer

    (root / "no-teacher").mkdir()
    (root / "no-teacher" / "notes.txt").write_text("no model here\n")
    shutil.copytree(root / "prev" / "model", root / "teacher-hs")
    config = json.loads((root / "teacher-hs" / "config.json").read_text())
    config.update(id2label={"0": "ham", "1": "spam"}, label2id={"ham": 0, "spam": 1})
    (root / "teacher-hs" / "config.json").write_text(json.dumps(config))
    shutil.copytree(root / "teacher-hs", root / "teacher-chars")  # the same teacher reading other token ids
    character_tokenizer.character_tokenizer().save_pretrained(root / "teacher-chars")
    # Causal LMs over the packaged tokenizer (LLAMA's), and the same reading other token ids.
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(root / "prev" / "model")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(root / "lm-teacher")
    tokenizer.save_pretrained(root / "lm-teacher")
    shutil.copytree(root / "lm-teacher", root / "lm-teacher-chars")
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (root / "lm-teacher-chars" / name).unlink(missing_ok=True)
    character_tokenizer.character_tokenizer().save_pretrained(root / "lm-teacher-chars")
    write_distill_media_cases(root)


def write_distill_media_cases(root):
    """Image and audio teachers whose processor is not the student's (labels a, b as the data's): a ViT of
    VIT_STUDENT's shape normalising with ImageNet's mean and std, and write_mismatched_media's wav2vec2 with its
    feature extractor at 8 kHz; images and clips (none too short) to train on."""
    from effitrain.data.image import image_processor
    from effitrain.models.loading import config_for
    from transformers import ViTForImageClassification

    config = config_for("vit", VIT_STUDENT.partition(":")[2])
    config.id2label, config.label2id = {0: "a", 1: "b"}, {"a": 0, "b": 1}
    ViTForImageClassification(config).save_pretrained(root / "vit-imagenet")
    processor = image_processor(None, config)
    processor.image_mean, processor.image_std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    processor.save_pretrained(root / "vit-imagenet")
    (root / "pics.csv").write_text("image,label\n" + "".join(f"gray.png,{'ab'[i % 2]}\n" for i in range(8)))
    shutil.copytree(root / "w2v", root / "w2v-8k")
    extractor_config = root / "w2v-8k" / "preprocessor_config.json"
    extractor_config.write_text(extractor_config.read_text().replace('"sampling_rate": 16000', '"sampling_rate": 8000'))
    (root / "long.csv").write_text("path,label\n" + "".join(f"clips/c{i}.wav,{'ab'[i % 2]}\n" for i in (0, 1, 2, 4,
                                                                                                       5, 6, 7, 0)))


def write_chat_cases(root):
    """Instruction and chat data with a mistake each, a template that does not parse, one that never ends
    a turn with a special token, and a causal LM whose tokenizer has neither a pad nor an EOS token."""
    import json

    from effitrain.data import templates
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    def jsonl(name, rows):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    def chat(n, *turns):
        return {"messages": [{"role": role, "content": f"{content} {n}"} for role, content in turns]}

    good = [chat(n, ("user", "hi"), ("assistant", "hello")) for n in range(12)]
    jsonl("chat.jsonl", good)
    jsonl("chat_role.jsonl", good[:5] + [chat(5, ("robot", "hi"), ("assistant", "hello"))] + good[6:])
    jsonl("chat_user_end.jsonl", good[:3] + [chat(3, ("user", "hi"), ("assistant", "hello"), ("user", "bye"))])
    jsonl("chat_long.jsonl", [chat(n, ("user", "word " * 40), ("assistant", "hello")) for n in range(12)])
    jsonl("chat_answer_first.jsonl", good[:6] + [chat(6, ("assistant", "first"), ("user", "x"), ("assistant", "y"))]
          + good[7:])
    jsonl("chat_refused.jsonl", good[:9] + [chat(9, ("user", "REFUSE"), ("assistant", "hello"))] + good[10:])
    (root / "picky.jinja").write_text(  # ChatML ending turns with [SEP] (the tokenizer's), refusing one content
        templates.CHATML.replace("<|im_end|>", "[SEP]").replace(
            "{% for message in messages %}", "{% for message in messages %}{% if message['content'].startswith("
            "'REFUSE') %}{{ raise_exception('no refusals') }}{% endif %}"))
    jsonl("pc_empty.jsonl", [{"prompt": f"hi {n}", "completion": "" if n == 2 else "hello"} for n in range(12)])
    jsonl("mixed.jsonl", good[:6] + [{"text": f"plain text {n}"} for n in range(6)])
    jsonl("chat_num.jsonl", good[:3] + [{"messages": [{"role": "user", "content": 5}, {"role": "assistant",
                                                                                      "content": "7"}]}] + good[4:])
    jsonl("chat_parts.jsonl", good[:3] + [{"messages": [{"role": "user", "content": ["a", "b"]},
                                                        {"role": "assistant", "content": "x"}]}] + good[4:])
    (root / "chat_latin.jsonl").write_bytes("".join(json.dumps(chat(n, ("user", "caf\xe9"), ("assistant", "ol\xe9")),
                                                               ensure_ascii=False) + "\n" for n in range(12))
                                            .encode("latin-1"))
    (root / "range.jinja").write_text("{% for i in range(10**12) %}x{% endfor %}")  # beyond the sandbox's limit
    (root / "include.jinja").write_text("{% include '/etc/passwd' %}")  # transformers' sandbox has no loader
    (root / "broken.jinja").write_text("{% for m in messages %}{{ m['content'] }\n")
    (root / "no_end.jinja").write_text("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}"
                                       "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    vocabulary = {word: i for i, word in enumerate(["[UNK]", "hi", "hello", "bye"])}
    backend = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(root / "nopad")
    LlamaForCausalLM(LlamaConfig(vocab_size=4, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                 num_key_value_heads=1, intermediate_size=8)).save_pretrained(root / "nopad")
    write_chat_models(root, jsonl)


def write_preference_cases(root):
    """Preference pairs (issue 30) with a mistake each."""
    import json

    def jsonl(name, rows):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    def turn(role, content):
        return [{"role": role, "content": content}]

    good = [{"prompt": f"Is {n} even?", "chosen": ["yes", "no"][n % 2], "rejected": ["no", "yes"][n % 2]}
            for n in range(12)]
    chat = [{"prompt": turn("user", f"Is {n} even?"), "chosen": turn("assistant", "yes"),
             "rejected": turn("assistant", "no")} for n in range(12)]
    jsonl("pairs.jsonl", good)
    jsonl("pairs_same.jsonl", good[:3] + [{**good[3], "rejected": good[3]["chosen"]}] + good[4:])
    jsonl("pairs_empty.jsonl", good[:2] + [{**good[2], "chosen": " "}] + good[3:])
    jsonl("pairs_norej.jsonl", [{"prompt": row["prompt"], "chosen": row["chosen"]} for row in good])
    jsonl("pairs_noprompt.jsonl", [{"chosen": row["chosen"], "rejected": row["rejected"]} for row in good])
    jsonl("pairs_completion.jsonl", [{**row, "completion": row["chosen"]} for row in good])
    jsonl("pairs_mixed.jsonl", [{**row, "chosen": turn("assistant", "yes")} for row in good])
    jsonl("pairs_long.jsonl", [{**row, "prompt": "word " * 40} for row in good])
    jsonl("pairs_chat.jsonl", chat)
    jsonl("pairs_role.jsonl", chat[:4] + [{**chat[4], "rejected": turn("robot", "no")}] + chat[5:])
    jsonl("pairs_user_answer.jsonl", chat[:1] + [{**chat[1], "chosen": turn("assistant", "yes") + turn("user", "ok")}]
          + chat[2:])
    jsonl("pairs_number.jsonl", good[:3] + [{**good[3], "chosen": 5}] + good[4:])
    jsonl("pairs_apart.jsonl", [{"chosen": turn("user", f"a {n}") + turn("assistant", "yes"),
                                 "rejected": turn("user", f"b {n}") + turn("assistant", "no")} for n in range(12)])


def write_chat_models(root, jsonl):
    """Saved causal LMs for predict: one with the ChatML template, one without a template; conversations
    to answer with a mistake each."""
    from effitrain.data import templates
    from effitrain.models.loading import default_model_dir
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir()))
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer) + 2, hidden_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, intermediate_size=8))
    model.save_pretrained(root / "lm-plain")
    tokenizer.save_pretrained(root / "lm-plain")
    exact = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                         num_attention_heads=1, num_key_value_heads=1, intermediate_size=8))
    exact.save_pretrained(root / "lm-exact")  # a vocabulary without room for ChatML's tokens
    tokenizer.save_pretrained(root / "lm-exact")
    templates.install(tokenizer, "chatml")
    model.save_pretrained(root / "lm-chat")
    tokenizer.save_pretrained(root / "lm-chat")
    write_grown_adapter(root, exact, tokenizer)
    ask = [{"role": "user", "content": "hi"}]
    jsonl("ask.jsonl", [{"messages": ask}])
    jsonl("ask_answered.jsonl", [{"messages": ask}, {"messages": ask + [{"role": "assistant", "content": "hello"}]}])
    jsonl("ask_role.jsonl", [{"messages": [{"role": "robot", "content": "hi"}]}])
    jsonl("lm_text.jsonl", [{"text": f"plain text {n}"} for n in range(12)])


def write_grown_adapter(root, base, tokenizer):
    """An adapter trained over lm-exact grown by ChatML's two tokens, whose adapter_config.json was edited to
    drop the rows it trained (trainable_token_indices)."""
    import json

    from effitrain import config as cfg
    from effitrain import tasks
    from effitrain.models import adapters

    folder = root / "grown-adapter"
    base.name_or_path = base.config.name_or_path = str(root / "lm-exact")  # what peft records as the base
    base.resize_token_embeddings(len(tokenizer))
    adapters.mark_new_tokens(base, {i: str(i) for i in range(len(tokenizer) - 2, len(tokenizer))})
    adapted = adapters.apply(base, tasks.get("causal-lm"), cfg.build(None, {"peft": "lora", "task": "causal-lm"}))
    adapters.save_adapter(adapted, folder)
    adapters.plain_config(adapted).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**settings, "trainable_token_indices": None}))


VIT_STUDENT = ("vit:image_size=16,patch_size=8,hidden_size=8,num_hidden_layers=1,num_attention_heads=1,"
               "intermediate_size=8")
WAV2VEC2 = ("wav2vec2:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,intermediate_size=16,"
            "conv_dim=[8,8],conv_kernel=[10,8],conv_stride=[5,4],num_feat_extract_layers=2,"
            "num_conv_pos_embeddings=4,num_conv_pos_embedding_groups=2")  # receptive field (8-1)*5+10 = 45 samples


def write_rl_cases(root):
    """Online RL (issue 43): prompts with an answer, prompts alone, and reward files with a mistake each."""
    import json

    def jsonl(name, rows):
        (root / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    jsonl("rl.jsonl", [{"prompt": f"{n}+{n}=", "answer": str(2 * n)} for n in range(12)])
    jsonl("rl_no_answer.jsonl", [{"prompt": f"{n}+{n}="} for n in range(12)])
    # conversations whose prompt is all but the last turn (issue 44): row 3 ends on the user, or has no prompt
    chat = [[{"role": "user", "content": f"Is {n} even?"}, {"role": "assistant", "content": ["yes", "no"][n % 2]}]
            for n in range(12)]
    jsonl("rl_chat_user_end.jsonl", [{"messages": turns[:1] if n == 2 else turns} for n, turns in enumerate(chat)])
    jsonl("rl_chat_no_prompt.jsonl", [{"messages": turns[1:] if n == 2 else turns} for n, turns in enumerate(chat)])
    (root / "rl_rewards.py").write_text("def correct(completions, answer, **kwargs):\n"
                                        "    return [float(c == a) for c, a in zip(completions, answer)]\n\n"
                                        "def nan(completions, **kwargs):\n    return [float('nan')] * len(completions)\n\n"
                                        "def graded(completions, grade, **kwargs):\n    return [1.0] * len(completions)\n")
    (root / "rl_broken.py").write_text("def correct(completions:\n")
    # the hostile pass: files that end the program at import, a folder named like a file, functions that
    # return what has no order or no float, that exit or raise KeyboardInterrupt themselves
    (root / "rl_exits.py").write_text("import sys\nsys.exit()\n")
    (root / "rl_interrupts.py").write_text("raise KeyboardInterrupt\n")
    (root / "rl_folder.py").mkdir()
    (root / "rl_hostile.py").write_text("import sys\n\n"
                                        "def unordered(completions, **kwargs):\n    return set(range(len(completions)))\n\n"
                                        "def huge(completions, **kwargs):\n    return [10 ** 400] * len(completions)\n\n"
                                        "def exits(completions, **kwargs):\n    sys.exit(0)\n\n"
                                        "def interrupts(completions, **kwargs):\n    raise KeyboardInterrupt\n")


def write_mismatched_media(root):
    """Clips shorter than a tiny wav2vec2's receptive field, a saved wav2vec2 classifier, an image and a saved
    1-channel ViT (issue 28, item 5)."""
    import numpy as np
    import PIL.Image
    import soundfile
    from effitrain.data.audio import feature_extractor
    from effitrain.models.loading import config_for
    from transformers import ViTConfig, ViTForImageClassification, Wav2Vec2ForSequenceClassification

    (root / "clips").mkdir()
    for i in range(8):  # clip 3: 44 samples, one fewer than the receptive field
        soundfile.write(root / "clips" / f"c{i}.wav", np.sin(np.arange(44 if i == 3 else 800) / 3.0), 16000)
    (root / "clips.csv").write_text("path,label\n" + "".join(f"clips/c{i}.wav,{'ab'[i % 2]}\n" for i in range(8)))
    # every row the short clip: whichever rows the split holds, it meets one
    (root / "short.csv").write_text("path,label\n" + "".join(f"clips/c3.wav,{'ab'[i % 2]}\n" for i in range(8)))
    config = config_for("wav2vec2", WAV2VEC2.partition(":")[2])
    config.id2label, config.label2id = {0: "a", 1: "b"}, {"a": 0, "b": 1}
    Wav2Vec2ForSequenceClassification(config).save_pretrained(root / "w2v")
    feature_extractor(None, "wav2vec2").save_pretrained(root / "w2v")
    PIL.Image.new("L", (16, 16), 128).save(root / "gray.png")
    one_channel = ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, num_channels=1,
                            intermediate_size=8, image_size=16, patch_size=8)
    ViTForImageClassification(one_channel).save_pretrained(root / "vit1")
    from effitrain.data.image import image_processor

    three = ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1, intermediate_size=8, image_size=16,
                      patch_size=8, id2label={0: "a", 1: "b"}, label2id={"a": 0, "b": 1})
    ViTForImageClassification(three).save_pretrained(root / "vit-resized")
    processor = image_processor(None, three)
    processor.size = {"height": 32, "width": 32}  # a processor saved for another size than the model's
    processor.save_pretrained(root / "vit-resized")


def write_report_cases(root):
    """Runs of two tasks for `effitrain report`, and a page of the user's that --out must not replace."""
    import json

    from effitrain.outputs.run_folder import MARKER

    for name, task in (("cls-run", "sequence-classification"), ("lm-run", "causal-lm")):
        (root / name).mkdir()
        (root / name / "config.yaml").write_text(f"task: {task}\n")
        (root / name / MARKER).write_text('{"kind": "train"}')
    (root / "page.html").write_text("<p>mine</p>\n")
    (root / "emptydir").mkdir()
    # benches without a variant run (issue 28, item 6): killed before its first variant; every variant refused
    for name in ("bench-stopped", "bench-failed"):
        (root / name).mkdir()
        (root / name / MARKER).write_text('{"kind": "bench"}')
    error = "effitrain: error: --data d.csv has no column `body` (columns: text, label); fix: pass --text-column"
    (root / "bench-failed" / "bench.json").write_text(json.dumps(
        {"variants": [{"name": "baseline", "status": "failed", "error": error},
                      {"name": "bf16", "status": "skipped", "error": "no native bf16"}]}))
    (root / "bench-failed" / "baseline.log").write_text("$ effitrain train --output-dir bench-failed/baseline\n")
    (root / "ro").mkdir()
    (root / "ro").chmod(0o555)


def write_output_cases(root, tiny_model_dir):
    """Folders --overwrite must not empty, and weights that do not fit their config."""
    from effitrain.outputs.run_folder import MARKER
    from transformers import BertConfig, BertForSequenceClassification

    (root / "notes").mkdir()
    (root / "notes" / "ideas.txt").write_text("mine")
    for name in ("marked", "marked2"):  # effitrain runs; the first also holds a file of the user's
        shutil.copytree(root / "prev", root / name)
        (root / name / MARKER).write_text('{"kind": "train"}')
    (root / "marked" / "notes.txt").write_text("mine")
    (root / "nan.yaml").write_text("lr: .nan\n")
    # 9**12 items by aliases under a known key: its message must not build them (issue 28, item 3)
    anchors = ['&a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in zip("abcdefghijk", "bcdefghijkl"):
        anchors.append(f"&{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
    (root / "bomb.yaml").write_text("lr: [" + ", ".join(anchors) + "]\n")
    (root / "deep.yaml").write_text("lr: " + "[" * 5000 + "]" * 5000 + "\n")  # beyond PyYAML's recursion
    (root / "digits.yaml").write_text("epochs: " + "9" * 5000 + "\n")  # beyond Python's 4300-digit int()
    config = BertConfig.from_pretrained(tiny_model_dir)
    config.hidden_size, config.intermediate_size = 64, 128
    BertForSequenceClassification(config).save_pretrained(root / "wrongsize")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, root / "wrongsize" / name)
    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model_dir, root / "nanmodel")  # what a diverged run would have saved, before effitrain refused to
    weights = load_file(str(tiny_model_dir / "model.safetensors"))
    weights["classifier.bias"] = torch.full_like(weights["classifier.bias"], float("nan"))
    save_file(weights, str(root / "nanmodel" / "model.safetensors"), metadata={"format": "pt"})
    import json

    labelled = {**json.loads((tiny_model_dir / "config.json").read_text()), "id2label": {"0": "ham", "1": "spam"},
                "label2id": {"ham": 0, "spam": 1}}  # d.csv's labels, so that evaluate gets to the outputs
    (root / "nanmodel" / "config.json").write_text(json.dumps(labelled))


def write_bad_data(root):
    """Data of the wrong types, encodings and kinds of file."""
    import json
    import os

    def jsonl(name, make):
        (root / name).write_text("".join(json.dumps(make(i)) + "\n" for i in range(12)))

    label = ["ham", "spam"]
    jsonl("num_text.jsonl", lambda i: {"text": i, "label": label[i % 2]})
    jsonl("list_text.jsonl", lambda i: {"text": ["some", "words"], "label": label[i % 2]})
    jsonl("dict_text.jsonl", lambda i: {"text": {"body": "x"}, "label": label[i % 2]})
    jsonl("list_label.jsonl", lambda i: {"text": f"m {i}", "label": [i % 2]})
    jsonl("dict_label.jsonl", lambda i: {"text": f"m {i}", "label": {"y": i % 2}})
    jsonl("frac_label.jsonl", lambda i: {"text": f"m {i}", "label": i * 0.37})
    jsonl("pair_num.jsonl", lambda i: {"text": f"m {i}", "q": i, "label": label[i % 2]})
    (root / "one_class.csv").write_text("text,label\n" + "".join(f"message {i},ham\n" for i in range(12)))
    (root / "semi.csv").write_text("text;label\n" + "".join(f"message {i};{label[i % 2]}\n" for i in range(12)))
    (root / "latin.csv").write_bytes(("text,label\n" + "".join(f"caf\xe9 {i},{label[i % 2]}\n" for i in range(12)))
                                     .encode("latin-1"))
    (root / "bad.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": oops\n')
    os.mkfifo(root / "pipe.csv")
    (root / "noread.csv").write_text("text,label\nhello,ham\n")
    (root / "noread.csv").chmod(0)


def write_orphan_adapter(root, tiny_model_dir):
    """An adapter folder (as `train --peft` writes it) whose base model is gone."""
    from safetensors.torch import save_file

    folder = root / "orphan-adapter"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, folder / name)
    (folder / "adapter_config.json").write_text('{"peft_type": "LORA", "base_model_name_or_path": "/nowhere/base", '
                                                '"r": 8, "lora_alpha": 16, "target_modules": ["query"]}')
    save_file({}, str(folder / "adapter_model.safetensors"))


def save_adapter_run(run, base):
    """RUN/adapter as `train --peft lora` writes it (untrained adapters: only whether it loads matters here)."""
    from effitrain import config as cfg
    from effitrain import tasks
    from effitrain.models import adapters
    from transformers import BertForSequenceClassification

    labels = {"id2label": {0: "ham", 1: "spam"}, "label2id": {"ham": 0, "spam": 1}}  # d.csv's: evaluate gets to the model
    adapted = adapters.apply(BertForSequenceClassification.from_pretrained(base, **labels),
                             tasks.get("sequence-classification"), cfg.build(None, {"peft": "lora"}))
    adapters.save_adapter(adapted, run / "adapter")
    adapters.plain_config(adapted).save_pretrained(run / "adapter")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(base / name, run / "adapter" / name)


def write_adapter_cases(root, tiny_model_dir):
    """Adapter runs whose base is gone or was replaced after training (by another architecture, other
    shapes, other weights), one whose adapter_config.json was edited, and one that is fine (lora-run)."""
    import json

    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification

    for name in ("lora", "gone", "arch", "shapes", "weights"):
        shutil.copytree(tiny_model_dir, root / f"{name}-base")
        save_adapter_run(root / f"{name}-run", root / f"{name}-base")
    shutil.rmtree(root / "gone-base")
    for name in ("arch", "shapes", "weights"):
        shutil.rmtree(root / f"{name}-base")
    torch.manual_seed(1)
    GPT2ForSequenceClassification(GPT2Config(n_layer=1, n_embd=32, n_head=2)).save_pretrained(root / "arch-base")
    config = BertConfig.from_pretrained(tiny_model_dir)
    BertForSequenceClassification(config).save_pretrained(root / "weights-base")  # seed 1: other values
    config.intermediate_size = 48
    BertForSequenceClassification(config).save_pretrained(root / "shapes-base")
    shutil.copytree(root / "lora-run", root / "edited-run")
    settings = json.loads((root / "edited-run" / "adapter" / "adapter_config.json").read_text())
    (root / "edited-run" / "adapter" / "adapter_config.json").write_text(json.dumps({**settings, "r": 4}))
    shutil.copytree(root / "lora-run", root / "truncated-run")  # a copy that stopped part way
    weights = root / "truncated-run" / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    shutil.copytree(root / "lora-run", root / "retargeted-run")
    settings["target_modules"] = [*settings["target_modules"], "bert.encoder.layer.0.attention.self.nosuch"]
    (root / "retargeted-run" / "adapter" / "adapter_config.json").write_text(json.dumps(settings))


def write_bad_models(root, tiny_model_dir):
    """Model folders whose config cannot give the model asked for."""
    import json

    from transformers import ViTConfig, ViTForImageClassification

    config = json.loads((tiny_model_dir / "config.json").read_text())
    for name, changes in (("unknown-type", {"model_type": "nosuchmodel"}),
                          ("bad-shapes", {"hidden_size": 30, "num_attention_heads": 4})):
        shutil.copytree(tiny_model_dir, root / name)
        (root / name / "config.json").write_text(json.dumps({**config, **changes}))
    ViTForImageClassification(ViTConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
                                        intermediate_size=8, image_size=16, patch_size=8)).save_pretrained(root / "vit")
    shutil.copytree(tiny_model_dir, root / "noread-model")
    (root / "noread-model").chmod(0)


CPU_ONLY = pytest.mark.skipif(has_accelerator(), reason="refusals for machines without an accelerator")
NOT_ROOT = pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
TINY = ["--model", "prev/model", "--max-train-samples", "8"]
T5 = "t5:d_model=16,d_ff=32,num_layers=1,num_heads=2,d_kv=8"
LLAMA = ["--model", "llama:hidden_size=16,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,"
         "intermediate_size=16", "--task", "causal-lm", "--max-train-samples", "8"]
# Rows marked FRESH run as `python -m effitrain` in a new process: one or more for each command and for each
# library a refusal imports (datasets, transformers, peft, bitsandbytes, torch.distributed), so that what
# importing prints is seen too. The others call effitrain.cli.main in this process (conftest's cli_here:
# the same code, the same checks, without 1-15 s of imports each).
FRESH = pytest.mark.fresh_process

CASES = [
    # flag values
    pytest.param(["train", "--lr", "abc"], "invalid float value", marks=FRESH),
    (["train", "--batch-size", "0"], "--batch-size must be > 0"),
    (["train", "--warmup-ratio", "2"], "--warmup-ratio must be in [0, 1)"),
    (["train", "--beta2", "1.5"], "--beta2 must be in [0, 1)"),
    (["train", "--task", "translation"], "invalid choice"),
    (["train", "--bogus"], "unrecognized arguments"),
    # conflicting options
    (["train", "--packing", "--task", "image-classification"], "--packing applies to text"),
    (["train", "--packing", "--task", "audio-classification"], "--packing applies to text"),
    (["train", "--packing", "--model", "gpt2:n_layer=1,n_embd=8,n_head=1"],
     "--packing for sequence classification is verified exact only for model types"),
    (["train", "--packing", "--memory-budget", "1GiB"], "--memory-budget cannot split a packed micro-batch"),
    (["train", "--effective-batch-size", "8", "--grad-accum", "2"], "both set the accumulation"),
    (["train", "--compile", "--strategy", "fsdp"], "--compile with --strategy fsdp is not supported"),
    (["train", "--optim", "muon", "--strategy", "fsdp"], "--optim muon with --strategy fsdp is not supported"),
    (["train", "--optim", "galore-adamw", "--peft", "lora"], "an alternative to --peft lora's adapters"),
    (["train", "--optim", "schedule-free-adamw", "--local-sgd-steps", "4"], "each process would keep its own"),
    (["train", "--resume", "auto"], "--resume needs the --output-dir"),
    (["train", *TINY, "--output-dir", "new", "--resume", "nowhere"], "is not a complete effitrain checkpoint"),
    (["train", "--effective-batch-size", "20", "--batch-size", "8", *TINY, "--output-dir", "new"],
     "is not a multiple of --batch-size"),
    pytest.param(["train", "--precision", "fp16", *TINY, "--output-dir", "new"], "needs a CUDA GPU", marks=CPU_ONLY),
    pytest.param(["train", "--strategy", "deepspeed", *TINY, "--output-dir", "new"], "needs GPUs", marks=CPU_ONLY),
    # config files and keys
    (["train", "--config", "missing.yaml"], "does not exist"),
    pytest.param(["train", "--config", "bad.yaml"], "unknown key `learning_rate`", marks=FRESH),
    (["train", "--config", "badtype.yaml"], "`lr` must be float"),
    # model paths and weights
    (["train", "--model", "./missing-model"], "is not a directory"),
    (["train", "--model", "nobody/no-such-model"], "nor in the Hugging Face cache"),
    pytest.param(["train", "--model", "corrupt", "--output-dir", "new"], "cannot load the model", marks=FRESH),
    (["train", "--model", "pickled", "--output-dir", "new"], "only pickle weights"),
    (["train", "--model", "gpt2:n_layerz=2", "--task", "causal-lm"], "gpt2 has no setting `n_layerz`"),
    # --student-layers: 0, more than the teacher's layers, a teacher with random weights
    (["train", *TINY, "--student-layers", "0"], "--student-layers must be > 0, got 0"),
    (["train", *TINY, "--student-layers", "3", "--output-dir", "new"], "--student-layers 3 is more than the 2 layers"),
    (["train", *LLAMA, "--student-layers", "1", "--output-dir", "new"], "takes the layers of a pretrained model"),
    (["plan", "--student-layers", "7"], "--student-layers 7 is more than the 6 layers"),
    (["plan", "--model", "bert:num_hidden_layers=2", "--student-layers", "1"], "takes the layers of a pretrained"),
    (["inspect", "prev/model", "--student-layers", "-1"], "--student-layers must be > 0, got -1"),
    (["inspect", "vit", "--task", "image-classification", "--student-layers", "2"], "more than the 1 layers"),
    # data files, columns, labels, rows
    (["train", *TINY, "--data", "imagenet"], "no such file, folder or built-in"),
    (["train", *TINY, "--data", "empty.csv", "--output-dir", "new"], "is empty"),
    (["train", *TINY, "--data", "d.txt", "--output-dir", "new"], "unknown file type"),
    (["train", *TINY, "--data", "d.csv", "--text-column", "body", "--output-dir", "new"], "has no column `body`"),
    (["train", *TINY, "--data", "badrow.csv", "--output-dir", "new"], "cannot be read"),
    (["train", *TINY, "--data", "d.csv", "--validation-file", "dev.csv", "--output-dir", "new"],
     "label `promo` is not in the training data"),
    (["train", "--model", "notok", "--output-dir", "new"], "has no tokenizer"),
    pytest.param(["predict", "--model", "notok", "--text", "hi"], "has no tokenizer", marks=FRESH),
    # evaluation during training
    (["train", *TINY, "--data", "d.csv", "--metric-for-best", "f1_promo", "--output-dir", "new"],
     "--metric-for-best `f1_promo` is not a metric of sequence-classification"),
    (["train", *TINY, "--data", "d.csv", "--early-stopping-patience", "2", "--output-dir", "new"],
     "--early-stopping-patience 2 needs at least 3 evaluations"),
    (["train", "--early-stopping-patience", "0"], "--early-stopping-patience must be > 0"),
    (["train", "--early-stopping-threshold", "-1"], "--early-stopping-threshold must be >= 0"),
    (["train", "--eval-every", "0"], "--eval-every must be > 0"),
    (["train", "--early-stopping-threshold", "0.1"], "applies to early stopping, which is off"),
    (["train", "--early-stopping-patience", "2", "--early-stopping-threshold", "inf"],
     "--early-stopping-threshold must be a finite number"),
    (["train", "--early-stopping-target", "nan"], "--early-stopping-target must be a finite number"),
    (["train", "--config", "plan-bad.yaml"], "plan `pieces: 0` is not an integer from 1 to --batch-size"),
    (["train", "--config", "plan-edited.yaml", *TINY, "--output-dir", "new"], "the plan's `optim: 'sgd'` is not what"),
    (["evaluate", "--model", "prev/model", "--output", "prev/metrics.json"], "already exists"),
    (["evaluate", "--model", "prev/model", "--output", "nowhere/m.json"], "no folder nowhere"),
    (["predict", "--model", "prev/model", "--text", "x", "--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["train", "--keep", "worst"], "invalid choice"),
    # outputs
    (["train", *TINY, "--output-dir", "prev"], "already holds files"),
    (["train", *TINY, "--output-dir", "d.csv"], "is a file"),
    # output folders and honest results
    (["train", *TINY, "--output-dir", "notes", "--overwrite"], "is not an effitrain run"),
    (["train", *TINY, "--output-dir", "marked", "--overwrite"], "holds files effitrain did not write (notes.txt)"),
    (["train", "--model", "marked2/model", "--max-train-samples", "8", "--output-dir", "marked2", "--overwrite"],
     "holds this run's own input"),
    (["train", *TINY, "--output-dir", "marked2"], "already holds an effitrain run"),
    (["train", "--output-dir", ""], "--output-dir is empty"),
    (["bench", "--output-dir", "notes", "--overwrite", "--variants", "baseline"], "is not an effitrain run"),
    (["train", "--lr", "inf"], "--lr must be a finite number"),
    (["train", "--max-grad-norm", "nan"], "--max-grad-norm must be a finite number"),
    (["train", "--config", "nan.yaml"], "--lr must be a finite number"),
    (["plan", "--memory", "0"], "--memory must be > 0, got 0"),
    (["plan", "--task", "sequence-classification", "--rl", "grpo"], "--rl applies to --task causal-lm, not "
     "sequence-classification"),
    (["plan", "--task", "causal-lm", "--rl", "grpo", "--num-generations", "1"], "--num-generations must be >= 2"),
    (["plan", "--task", "causal-lm", "--max-new-tokens", "4"], "--max-new-tokens plans the completions of online RL"),
    (["train", *TINY, "--peft", "lora", "--lora-r", "40", "--output-dir", "new"],
     "--lora-r 40 is above the smaller side of `bert.encoder.layer.0.attention.self.query` (32 inputs x 32 outputs)"),
    (["train", "--config", "bomb.yaml"], "`lr` must be float or null, got list [['lol', 'lol', 'lol', 'lol', ...], "),
    (["train", "--seed", "-1"], "--seed must be in [0, 2**32)"),
    (["train", "--config", "deep.yaml"], "config file deep.yaml is nested too deeply to read"),
    (["train", "--config", "digits.yaml"], "config file digits.yaml holds a value that cannot be read (Exceeds the "
                                           "limit (4300 digits) for integer string conversion)"),
    (["train", "--model", "bert:hidden_size=" + "9" * 5000, "--output-dir", "new"],
     "--model bert: the value of `hidden_size` cannot be read (5000 characters)"),
    (["plan", "--model", "bert:hidden_size=" + "[" * 3000 + "]" * 3000],
     "--model bert: the value of `hidden_size` cannot be read (6000 characters)"),
    (["train", "--model", "bert:hidden_size=[1", "--output-dir", "new"], "the value of `hidden_size` cannot be read"),
    (["train", "--epochs", "9" * 5000], "argument --epochs: invalid int value: '" + "9" * 80 + "...' (5000 characters)"),
    (["train", "--model", "wrongsize", "--max-train-samples", "8", "--output-dir", "new"],
     "do not fit its config.json"),
    (["predict", "--model", "wrongsize", "--text", "hi"], "do not fit its config.json"),
    (["predict", "--model", "nanmodel", "--text", "hi"], "gives non-finite outputs"),
    (["train", "--model", "nanmodel", "--data", "d.csv", "--max-train-samples", "8", "--output-dir", "new"],
     "the weights of model nanmodel are not finite before training (NaN or infinity in 1 tensor(s), e.g. "
     "`classifier.bias`)"),
    pytest.param(["evaluate", "--model", "nanmodel", "--data", "d.csv"], "gives non-finite outputs", marks=FRESH),
    # other commands
    (["predict", "--model", "prev/model"], "nothing to predict"),
    (["predict", "--model", "prev/model", "--input", "missing.jsonl"], "does not exist"),
    (["inspect", "./missing-model"], "is not a directory"),
    (["launch", "--nproc", "2"], "needs the command to run after `--`"),
    (["launch", "--nproc", "1000", "--", "train"], "--nproc 1000 is more than 4 processes per CPU core"),
    pytest.param(["launch", "--nnodes", "2", "--", "train"], "needs --master-port", marks=FRESH),
    # node 0's address and port, checked before torch sees them (issue 28, item 4)
    (["launch", "--nnodes", "2", "--master-port", "70000", "--", "train"], "--master-port 70000 is not a port (1-65535)"),
    (["launch", "--master-addr", "127.0.0.1", "--master-port", "0", "--", "train"], "--master-port 0 is not a port"),
    (["launch", "--nnodes", "2", "--master-port", "x", "--", "train"], "argument --master-port: invalid int value: 'x'"),
    (["launch", "--nnodes", "2", "--master-addr", " ", "--master-port", "29500", "--", "train"],
     "--master-addr is empty"),
    (["launch", "--nnodes", "2", "--master-addr", "10.0.0.1:29500", "--master-port", "29500", "--", "train"],
     "--master-addr '10.0.0.1:29500' holds a port"),
    (["launch", "--master-addr", "node 01", "--", "train"], "--master-addr 'node 01' is not a host name or an IP"),
    (["launch", "--master-addr", "tcp://node01", "--", "train"], "--master-addr 'tcp://node01' is a URL, not a host"),
    (["launch", "--master-addr", "no-such-host.invalid", "--", "train"],
     "--master-addr no-such-host.invalid does not resolve on node 0"),
    (["launch", "--nnodes", "2", "--master-port", "29500", "--join-timeout", "0", "--", "train"],
     "--join-timeout must be > 0 seconds"),
    (["launch", "--nnodes", "2", "--master-port", "29500", "--join-timeout", "1e308", "--", "train"],
     "--join-timeout 1e+308 is longer than a week (604800 s)"),
    (["launch", "--nnodes", "2", "--master-port", "29500", "--join-timeout", "inf", "--", "train"],
     "--join-timeout inf is longer than a week"),
    pytest.param(["bench", "--variants", "nope"], "unknown", marks=FRESH),
    # bench's --extra, parsed and validated as train would before any run (issue 28, item 6)
    (["bench", "--variants", "baseline", "--output-dir", "new", "--extra=--lr"],
     "--extra: argument --lr: expected one argument"),
    (["bench", "--variants", "baseline", "--output-dir", "new", "--extra=--lr -1"], "--extra: --lr must be > 0"),
    (["bench", "--output-dir", "new", "--extra=--no-such-flag"], "--extra: unrecognized arguments: --no-such-flag"),
    (["bench", "--output-dir", "new", "--extra=--config nan.yaml"], "--extra: --lr must be a finite number"),
    # a mistake only a run finds (the data's columns): the first run's one line, and the bench stops there
    (["bench", "--variants", "baseline,bf16", "--output-dir", "new", "--data", "d.csv", "--extra=--text-column body"],
     "the baseline run refused its settings: "),
    # data of the wrong type, encoding or kind of file (issue 12, item 5)
    (["train", *TINY, "--data", "num_text.jsonl", "--output-dir", "new"], "column `text` (text) holds integers"),
    (["train", *TINY, "--data", "list_text.jsonl", "--output-dir", "new"], "column `text` (text) holds lists"),
    (["train", *TINY, "--data", "dict_text.jsonl", "--output-dir", "new"], "column `text` (text) holds objects"),
    (["train", *TINY, "--data", "pair_num.jsonl", "--text-pair-column", "q", "--output-dir", "new"],
     "column `q` (text pair) holds integers"),
    (["train", *TINY, "--data", "list_label.jsonl", "--output-dir", "new"], "label column `label` holds lists"),
    (["train", *TINY, "--data", "dict_label.jsonl", "--output-dir", "new"], "label column `label` holds objects"),
    (["train", *TINY, "--data", "frac_label.jsonl", "--output-dir", "new"], "a regression target"),
    (["train", *TINY, "--data", "one_class.csv", "--output-dir", "new"], "every training label is `ham` (one class)"),
    (["train", *TINY, "--data", "d.csv", "--label-column", "text", "--output-dir", "new"],
     "column `text` is both the text column and the label column"),
    (["train", *TINY, "--data", "latin.csv", "--output-dir", "new"], "is not UTF-8 text"),
    (["train", *TINY, "--data", "latin.csv", "--skip-bad-rows", "--output-dir", "new"], "is not UTF-8 text"),
    (["train", *TINY, "--data", "semi.csv", "--output-dir", "new"], "looks separated by semicolons"),
    pytest.param(["train", *TINY, "--data", "bad.jsonl", "--output-dir", "new"], "bad.jsonl: line 2 is not valid JSON",
                 marks=FRESH),  # no datasets log
    (["train", *TINY, "--data", "pipe.csv", "--output-dir", "new"], "is not a regular file"),
    (["train", *TINY, "--data", "/dev/zero", "--output-dir", "new"], "is not a regular file"),
    (["train", *TINY, "--data", "d.csv", "--validation-file", "corrupt", "--output-dir", "new"],
     "--validation-file corrupt is a folder"),
    pytest.param(["train", *TINY, "--data", "noread.csv", "--output-dir", "new"], "permission denied", marks=NOT_ROOT),
    # model configs that cannot be built, lengths beyond the model (issue 12, item 6)
    (["train", *TINY, "--data", "d.csv", "--model", "bert:hidden_size=abc"], "`hidden_size` must be a whole number"),
    (["train", *TINY, "--data", "d.csv", "--model", "bert:num_hidden_layers=-1"], "`num_hidden_layers` must be > 0"),
    (["train", *TINY, "--data", "d.csv", "--model", "bert:hidden_size=30,num_attention_heads=4", "--output-dir", "new"],
     "does not build a BertForSequenceClassification"),
    (["plan", "--model", "bert:hidden_size=30,num_attention_heads=4"],
     "does not build a BertForSequenceClassification"),
    (["plan", "--model", "bert:hidden_size=abc"], "`hidden_size` must be a whole number"),
    (["inspect", "bad-shapes"], "does not build a BertForSequenceClassification"),
    (["train", *TINY, "--data", "d.csv", "--model", "unknown-type", "--output-dir", "new"],
     "model_type `nosuchmodel`, which transformers"),
    pytest.param(["inspect", "unknown-type"], "model_type `nosuchmodel`, which transformers", marks=FRESH),
    (["train", *TINY, "--data", "d.csv", "--model", "vit", "--output-dir", "new"],
     "model type `vit` has no sequence-classification head"),
    # encoder-decoder models: refused from the config, by plan as by train (no traceback at the first forward)
    (["plan", "--model", T5], "model type `t5` is an encoder-decoder model, which effitrain does not train"),
    (["train", *TINY, "--data", "d.csv", "--model", T5, "--output-dir", "new"],
     "model type `t5` is an encoder-decoder model, which effitrain does not train"),
    (["train", *TINY, "--data", "d.csv", "--model", "prev/modle", "--output-dir", "new"],
     "model path prev/modle does not exist (the folder prev does)"),
    (["train", *TINY, "--data", "d.csv", "--max-length", "100000", "--output-dir", "new"],
     "--max-length 100000 is longer than the 512 positions"),
    pytest.param(["plan", "--model", "prev/model", "--seq-len", "100000"],
                 "--seq-len 100000 is longer than the 512 positions", marks=FRESH),
    pytest.param(["train", *TINY, "--data", "d.csv", "--model", "noread-model", "--output-dir", "new"],
                 "permission denied", marks=NOT_ROOT),
    # adapters (--peft)
    (["train", "--peft", "lora", "--lora-r", "0"], "--lora-r must be >= 1"),
    (["train", "--lora-alpha", "8"], "--lora-alpha applies to adapters, and --peft is none"),
    (["train", "--peft", "lora", "--lora-target-modules", "query value"], "is not all-linear or a comma list"),
    pytest.param(["train", *TINY, "--data", "d.csv", "--peft", "lora", "--lora-target-modules", "query,q_proj",
                  "--output-dir", "new"], "`q_proj` is not a linear module of BertForSequenceClassification",
                 marks=FRESH),
    pytest.param(["train", *TINY, "--data", "d.csv", "--peft", "qlora", "--output-dir", "new"],
                 "dequantise wrongly when a layer's input width is not a multiple of 64", marks=[CPU_ONLY, FRESH]),
    (["predict", "--model", "orphan-adapter", "--text", "hello"],
     "the base model of the adapter in orphan-adapter (/nowhere/base) cannot be loaded"),
    # an adapter applied to its own base only (issue 28, item 1)
    (["predict", "--model", "gone-run/adapter", "--text", "hi"], "the base model of the adapter in gone-run/adapter "
                                                                  "is missing: nothing at "),
    (["predict", "--model", "arch-run/adapter", "--text", "hi"],
     "arch-base is a gpt2 model, and the adapter was trained on a bert model"),
    pytest.param(["evaluate", "--model", "shapes-run/adapter", "--data", "d.csv"],
                 "shapes-base has other shapes than the base the adapter was trained on "
                 "(bert.encoder.layer.0.intermediate.dense.bias: 48 there, 64 in the base it was trained on)",
                 marks=FRESH),
    (["predict", "--model", "weights-run/adapter", "--text", "hi"],
     "weights-base holds other weights than the base the adapter was trained on (sha256 of model.safetensors "
     "differs); fix: put the base it was trained on back at"),
    pytest.param(["predict", "--model", "edited-run/adapter", "--text", "hi"],
                 "edited-run/adapter/adapter_config.json does not match the weights in adapter_model.safetensors: "
                 "size mismatch for ", marks=FRESH),
    (["predict", "--model", "truncated-run/adapter", "--text", "hi"],
     "truncated-run/adapter/adapter_model.safetensors is not a whole safetensors file (Error while deserializing "
     "header: invalid header length); fix: copy the adapter folder again from its run, or use the merged model "
     "truncated-run/model"),
    (["evaluate", "--model", "retargeted-run/adapter", "--data", "d.csv"],
     "its target_modules name bert.encoder.layer.0.attention.self.nosuch, which BertForSequenceClassification does "
     "not have"),
    (["train", "--model", "lora-run/adapter", "--max-train-samples", "8", "--output-dir", "new"],
     "lora-run/adapter is an adapter folder (LoRA weights over a base model, from `train --peft`), where a whole "
     "model is needed; fix: pass the merged model lora-run/model"),
    (["train", "--model", "lora-run/adapter", "--peft", "lora", "--output-dir", "new"], "is an adapter folder"),
    (["inspect", "lora-run/adapter"], "is an adapter folder"),
    # model and data that do not fit each other, found before the first step (issue 28, item 5)
    (["train", "--task", "image-classification", "--data", "digits", "--output-dir", "new", "--model",
      "vit:image_size=8,patch_size=4,hidden_size=8,num_hidden_layers=1,num_attention_heads=1,num_channels=1"],
     "takes 1-channel images (num_channels=1); effitrain decodes every image as RGB"),
    (["predict", "--model", "vit1", "--input", "gray.png"], "model vit1 takes 1-channel images"),
    (["predict", "--model", "vit-resized", "--input", "gray.png"],
     "model vit-resized: its image processor makes 32x32 images, and its config's image_size is 16x16"),
    pytest.param(["train", "--task", "audio-classification", "--data", "clips.csv", "--audio-column", "path",
                  "--model", WAV2VEC2, "--output-dir", "new"],
                 "clips/c3.wav is 0.00275 s (44 samples at 16000 Hz), shorter than the model's receptive field of "
                 "45 samples", marks=FRESH),
    (["evaluate", "--model", "w2v", "--data", "short.csv", "--audio-column", "path"],
     "c3.wav is 0.00275 s (44 samples at 16000 Hz), shorter than the model's receptive field of 45 samples"),
    (["predict", "--model", "w2v", "--input", "clips/c3.wav"], "shorter than the model's receptive field of 45"),
    # effitrain report
    (["report", "missing-run"], "RUN missing-run does not exist"),
    (["report", "d.csv"], "RUN d.csv is a file, not a run folder"),
    (["report", "notes"], "RUN notes is not an effitrain run"),
    (["report", "prev/model"], "fix: pass the run's folder: effitrain report prev"),
    (["report", "emptydir"], "RUN emptydir is not an effitrain run: the folder is empty"),
    (["report", "bench-stopped"], "RUN bench-stopped is an unfinished bench folder: it stopped (killed or failed) "
                                  "before its first variant ran"),
    (["report", "bench-failed"], "RUN bench-failed is a bench folder in which no variant ran (1 failed, 1 skipped; "
                                 "baseline: --data d.csv has no column `body` (columns: text, label))"),
    pytest.param(["report", "cls-run", "lm-run"], "the runs are of different tasks", marks=FRESH),
    (["report", "prev", "--out", "nowhere/r.html"], "no folder nowhere"),
    (["report", "prev", "--out", "notes"], "--out notes is a folder"),
    (["report", "prev", "--out", "notes/ideas.txt"], "does not end in .html"),
    (["report", "prev", "--out", "marked/report.html"], "is inside the effitrain run marked"),
    (["report", "prev", "--out", "page.html"], "page.html already exists and is not an effitrain report"),
    pytest.param(["report", "prev", "--out", "ro/r.html"], "the folder ro is not writable", marks=NOT_ROOT),
    # instruction and chat data for causal LMs (issue 29)
    (["train", *LLAMA, "--data", "chat_role.jsonl", "--output-dir", "new"],
     "row 6 message 1 has the unknown role `robot`"),
    pytest.param(["train", *LLAMA, "--data", "chat_user_end.jsonl", "--output-dir", "new"], "row 4 ends on a user turn",
                 marks=FRESH),
    (["train", *LLAMA, "--data", "pc_empty.jsonl", "--output-dir", "new"], "row 3 has no value in column `completion`"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "broken.jinja", "--output-dir", "new"],
     "--chat-template broken.jinja does not parse as a Jinja template (line 1: "),
    (["train", *LLAMA, "--data", "mixed.jsonl", "--output-dir", "new"],
     "mixes data formats: it has `messages` and `text`"),
    (["train", "--model", "nopad", "--task", "causal-lm", "--data", "chat.jsonl", "--output-dir", "new"],
     "the tokenizer in nopad has no pad token (nor an EOS token to pad with)"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--output-dir", "new"], "has no chat template to render conversations"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "no_end.jinja", "--output-dir", "new"],
     "puts no special token (end of turn"),
    (["train", *LLAMA, "--data", "d.csv", "--chat-template", "chatml", "--output-dir", "new"],
     "--chat-template applies to conversations"),
    (["train", *LLAMA, "--data", "chat_long.jsonl", "--chat-template", "chatml", "--max-length", "24", "--output-dir",
      "new"], "keep no answer token within --max-length 24"),
    (["train", "--chat-template", "chatml"],
     "--chat-template applies to --task causal-lm, not sequence-classification"),
    (["train", *LLAMA, "--chat-template", "chatl"], "is neither a built-in template (chatml) nor a file"),
    # --tokenizer (a model built from a config)
    (["train", *LLAMA, "--tokenizer", "charaters", "--output-dir", "new"],
     "--tokenizer charaters is neither `characters` nor a folder"),
    (["train", *LLAMA, "--tokenizer", "notes", "--output-dir", "new"], "--tokenizer notes has no tokenizer"),
    (["train", "--model", "prev/model", "--tokenizer", "characters", "--output-dir", "new"],
     "--tokenizer applies to a model built from a config, and --model prev/model is pretrained"),
    (["train", "--task", "image-classification", "--data", "digits", "--tokenizer", "characters"],
     "--tokenizer applies to text tasks, and image-classification reads no text"),
    (["plan", "--task", "causal-lm", "--model", "default", "--tokenizer", "characters"],
     "--tokenizer applies to a model built from a config, and --model default is pretrained"),
    (["train", "--loss-on", "answers"], "invalid choice"),
    (["train", "--model", "mamba:hidden_size=16,num_hidden_layers=1,state_size=4", "--task", "causal-lm", "--packing",
      "--max-train-samples", "8", "--output-dir", "new"],
     "--packing: with model type `mamba` the second example of a packed row gets other outputs"),
    (["train", "--model", "lm-exact", "--task", "causal-lm", "--data", "chat.jsonl", "--chat-template", "chatml",
      "--peft", "lora", "--lora-target-modules", "q_proj,lm_head", "--output-dir", "new"],
     "whose output rows must be trained in full, which peft cannot do under a LoRA adapter"),
    (["predict", "--model", "grown-adapter", "--prompt", "hi"], "the adapter does not hold the rows of the tokens"),
    # found by the adversarial pass (issue 28, item 10)
    (["train", "--model", "bert:hidden_size=99999996,num_attention_heads=4", "--max-train-samples", "8",
      "--output-dir", "new"], "of fp32 weights, more than this machine's"),
    (["train", *LLAMA, "--data", "chat_num.jsonl", "--chat-template", "chatml", "--output-dir", "new"],
     "row 4 message 1 has content that is a number, not text"),
    (["train", *LLAMA, "--data", "chat_parts.jsonl", "--chat-template", "chatml", "--output-dir", "new"],
     "row 4 message 1 has content that is a list, not text"),
    (["train", *LLAMA, "--data", "chat_latin.jsonl", "--chat-template", "chatml", "--output-dir", "new"],
     "data file chat_latin.jsonl is not UTF-8 text"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "range.jinja", "--output-dir", "new"],
     "the chat template was stopped on a conversation: it passes 1,000,000,000,000 to range, over the limit"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "include.jinja", "--output-dir", "new"],
     "the chat template fails on a conversation (TypeError: no loader for this environment specified)"),
    # evaluation by generation and chat prediction (issue 29, item 6)
    (["predict", "--model", "lm-chat", "--input", "ask_answered.jsonl"],
     "ask_answered.jsonl row 2 ends on an assistant turn (nothing left for the model to answer)"),
    (["predict", "--model", "lm-chat", "--input", "ask_role.jsonl"], "row 1 message 1 has the unknown role `robot`"),
    (["predict", "--model", "lm-plain", "--input", "ask.jsonl"], "has no chat template to render conversations"),
    (["train", *LLAMA, "--data", "lm_text.jsonl", "--metric-for-best", "exact_match", "--output-dir", "new"],
     "--metric-for-best exact_match scores generated answers"),
    (["train", "--max-new-tokens", "8"], "--max-new-tokens applies to --task causal-lm, not sequence-classification"),
    (["train", *LLAMA, "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    # preference tuning (issue 30)
    (["train", *LLAMA, "--data", "pairs_same.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "row 4 has the same chosen and rejected answer"),
    (["train", *LLAMA, "--data", "pairs_empty.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "row 3 has no value in column `chosen`"),
    (["train", *LLAMA, "--data", "pairs_norej.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "has a `chosen` column but no `rejected` column"),
    (["train", *LLAMA, "--data", "pairs_noprompt.jsonl", "--preference", "orpo", "--output-dir", "new"],
     "without a `prompt` column must be conversations"),
    (["train", *LLAMA, "--data", "pairs_completion.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "mixes data formats: it has `chosen`/`rejected` and `completion` columns"),
    (["train", *LLAMA, "--data", "pairs_mixed.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "mixes data formats: its columns hold text or messages"),
    (["train", *LLAMA, "--data", "pairs_number.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "column `chosen` holds neither text nor lists of {role, content} messages"),
    (["train", *LLAMA, "--data", "pairs_long.jsonl", "--preference", "dpo", "--max-length", "24", "--output-dir",
      "new"], "keep no token of the chosen or the rejected answer within --max-length 24"),
    (["train", *LLAMA, "--data", "pairs_role.jsonl", "--preference", "dpo", "--chat-template", "chatml",
      "--output-dir", "new"], "row 5 (rejected) message 2 has the unknown role `robot`"),
    (["train", *LLAMA, "--data", "pairs_user_answer.jsonl", "--preference", "dpo", "--chat-template", "chatml",
      "--output-dir", "new"], "row 2 (chosen) has a completion with a turn that is not the assistant's"),
    (["train", *LLAMA, "--data", "pairs_apart.jsonl", "--preference", "dpo", "--chat-template", "chatml",
      "--output-dir", "new"], "row 1 its chosen and rejected conversations share no leading message"),
    (["train", *LLAMA, "--data", "pairs.jsonl", "--preference", "dpo", "--chat-template", "chatml", "--output-dir",
      "new"], "--chat-template applies to conversations, and --data pairs.jsonl holds its pairs as text"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--preference", "dpo", "--output-dir", "new"],
     "has no `chosen`/`rejected` columns"),
    (["train", *LLAMA, "--data", "pairs.jsonl", "--output-dir", "new"], "holds preference pairs"),
    (["train", "--preference", "dpo"], "--preference applies to --task causal-lm, not sequence-classification"),
    pytest.param(["train", "--preference", "kto"], "--preference", marks=FRESH),
    (["train", *LLAMA, "--beta", "0.2"], "--beta applies to preference tuning, and --preference is not set"),
    (["train", *LLAMA, "--preference", "dpo", "--beta", "0"], "--beta must be > 0"),
    (["train", *LLAMA, "--preference", "dpo", "--beta", "nan"], "--beta must be a finite number"),
    (["train", *LLAMA, "--preference", "orpo", "--reference", "copy"], "--reference applies to --preference dpo"),
    (["train", *LLAMA, "--preference", "dpo", "--reference", "adapters"],
     "--reference adapters is the model with its adapters switched off, and --peft is none"),
    (["train", *LLAMA, "--preference", "dpo", "--dpo-label-smoothing", "0.5"], "--dpo-label-smoothing must be in"),
    (["train", *LLAMA, "--preference", "dpo", "--dpo-loss", "ipo", "--dpo-label-smoothing", "0.1"],
     "--dpo-label-smoothing applies to --dpo-loss sigmoid"),
    (["train", *LLAMA, "--data", "pairs.jsonl", "--preference", "dpo", "--packing"],
     "--packing does not apply to --preference"),
    (["train", *LLAMA, "--data", "pairs.jsonl", "--preference", "orpo", "--loss-on", "all"],
     "--loss-on does not apply to --preference"),
    (["train", *LLAMA, "--data", "pairs.jsonl", "--preference", "dpo", "--metric-for-best", "token_accuracy",
      "--output-dir", "new"], "--metric-for-best `token_accuracy` is not a metric of causal-lm"),
    (["plan", "--task", "sequence-classification", "--preference", "dpo"],
     "--preference applies to --task causal-lm, not sequence-classification"),
    (["plan", "--task", "causal-lm", "--preference", "orpo", "--reference", "copy"],
     "--reference applies to --preference dpo"),
    (["evaluate", "--model", "prev/model", "--reference-model", "prev/model"], "--reference-model is DPO's reference"),
    (["evaluate", "--model", "lm-chat", "--data", "pairs.jsonl", "--preference", "dpo", "--reference-model",
      "prev/model"], "--reference-model prev/model: --task causal-lm does not fit the model in prev/model: it is a "
                     "sequence-classification model (BertForSequenceClassification); fix: pass the causal-lm model"),
    # online RL (issue 43)
    (["train", *LLAMA, "--data", "d.csv", "--rl", "grpo", "--output-dir", "new"],
     "--data d.csv has no `prompt` column (columns: text, label)"),
    (["train", *LLAMA, "--data", "rl_chat_user_end.jsonl", "--rl", "grpo", "--output-dir", "new"],
     "--data rl_chat_user_end.jsonl: row 3 ends on a user turn (nothing for the model to answer there)"),
    (["train", "--model", "lm-chat", "--task", "causal-lm", "--data", "rl_chat_no_prompt.jsonl", "--rl", "distill",
      "--distill-from", "lm-chat", "--output-dir", "new"],
     "--data rl_chat_no_prompt.jsonl: row 3 has no turn before its assistant answer"),
    (["train", *LLAMA, "--data", "rl_no_answer.jsonl", "--rl", "grpo", "--output-dir", "new"],
     "--rl grpo needs a reward function, and the data has no `answer` or `solution` column"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "missing.py:correct", "--output-dir", "new"],
     "reward missing.py:correct: the file"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_rewards.py:corect", "--output-dir",
      "new"], "reward rl_rewards.py:corect: rl_rewards.py has no 'corect' (it defines correct, graded, nan)"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "rloo", "--reward", "rl_broken.py:correct", "--output-dir",
      "new"], "reward rl_broken.py:correct: rl_broken.py fails to import: SyntaxError"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_rewards.py:graded", "--output-dir",
      "new"], "graded requires a column 'grade', which the data does not have (it has prompt, answer)"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_rewards.py:nan", "--max-new-tokens", "2",
      "--num-generations", "2", "--batch-size", "2", "--output-dir", "new"],
     "reward nan (rl_rewards.py:nan) returned nan on row"),
    (["train", *LLAMA, "--rl", "grpo", "--reward", "rl_rewards.py:correct,exact-match", "--reward-weights", "1"],
     "the reward weights are 1 value(s) for 2 reward function(s)"),
    (["train", *LLAMA, "--rl", "grpo", "--num-generations", "1"], "--num-generations must be >= 2, got 1"),
    (["train", *LLAMA, "--rl", "grpo", "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    (["train", *LLAMA, "--rl", "grpo", "--temperature", "0"], "--temperature must be > 0, got 0.0 (at 0, greedy "
                                                               "sampling gives the same completion --num-generations"),
    # online RL, the hostile pass (issue 43)
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_exits.py:f", "--output-dir", "new"],
     "reward rl_exits.py:f: rl_exits.py fails to import: SystemExit"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_interrupts.py:f", "--output-dir", "new"],
     "reward rl_interrupts.py:f: rl_interrupts.py fails to import: KeyboardInterrupt"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", "rl_folder.py:f", "--output-dir", "new"],
     "reward rl_folder.py:f: rl_folder.py is a folder, not a Python file"),
    *[(["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--reward", f"rl_hostile.py:{name}",
        "--max-new-tokens", "2", "--num-generations", "2", "--batch-size", "2", "--output-dir", "new"], needle)
      for name, needle in [("unordered", "reward unordered (rl_hostile.py:unordered) returned a set for 4 completions"),
                           ("huge", "reward huge (rl_hostile.py:huge) returned 10000000000000000000... (401 "
                                    "characters) on row"),
                           ("exits", "reward exits (rl_hostile.py:exits) raised SystemExit: 0 on row"),
                           ("interrupts", "reward interrupts (rl_hostile.py:interrupts) raised KeyboardInterrupt on "
                                          "row")]],
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--num-generations", "100000000", "--batch-size", "2",
      "--output-dir", "new"], "--num-generations 100000000 x 2 prompts a step (--batch-size 2 x --grad-accum 1) "
                              "samples 200,000,000 completions at once, which need at least"),
    (["train", *LLAMA, "--rl", "grpo", "--reward-weights", "nan"], "the reward weight nan is not a finite number"),
    (["train", *LLAMA, "--rl", "grpo", "--reward-weights", "inf"], "the reward weight inf is not a finite number"),
    (["train", *LLAMA, "--rl", "grpo", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["train", *LLAMA, "--rl", "grpo", "--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["train", *LLAMA, "--rl", "grpo", "--temperature", "-1"], "--temperature must be > 0, got -1.0"),
    (["train", *LLAMA, "--rl", "grpo", "--temperature", "inf"], "--temperature must be a finite number, got inf"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--max-new-tokens", "4096", "--output-dir", "new"],
     "--max-new-tokens 4096 leaves no room for a prompt in the model's 2048 positions"),
    (["train", *LLAMA, "--rl", "grpo", "--packing"], "--packing does not apply to --rl"),
    (["train", *LLAMA, "--rl", "grpo", "--preference", "dpo"], "--rl grpo and --preference dpo are two ways"),
    (["train", "--rl", "grpo", "--output-dir", "new"], "--rl applies to --task causal-lm, not sequence-classification"),
    (["train", *LLAMA, "--kl-beta", "0.1"], "--kl-beta applies to online RL, and --rl is not set"),
    (["train", *LLAMA, "--rl", "rloo", "--loss-type", "grpo"], "--loss-type applies to --rl grpo, not rloo"),
    (["train", *LLAMA, "--rl", "rloo", "--scale-rewards", "group"], "--scale-rewards group does not apply to --rl rloo"),
    (["train", *LLAMA, "--rl", "grpo", "--strategy", "fsdp"], "--rl with --strategy fsdp is not supported"),
    pytest.param(["train", *LLAMA, "--rl", "ppo"], "--rl", marks=FRESH),
    (["evaluate", "--model", "prev/model", "--data", "d.csv", "--reward", "exact-match"],
     "--reward applies to causal LMs (rewards score generated completions), and the model in prev/model is a "
     "sequence-classification model; fix: drop --reward"),
    (["evaluate", "--model", "prev/model", "--rl", "grpo"], "--rl applies to causal LMs (rewards score generated"),
    pytest.param(["evaluate", "--model", "lm-plain", "--data", "rl.jsonl", "--reward", "missing.py:correct"],
                 "reward missing.py:correct: the file", marks=FRESH),
    (["evaluate", "--model", "lm-plain", "--data", "rl.jsonl", "--reward", "rl_rewards.py:corect"],
     "reward rl_rewards.py:corect: rl_rewards.py has no 'corect' (it defines correct, graded, nan)"),
    (["evaluate", "--model", "lm-plain", "--data", "rl.jsonl", "--reward", "rl_rewards.py:graded"],
     "graded requires a column 'grade', which the data does not have (it has prompt, answer)"),
    (["evaluate", "--model", "lm-plain", "--data", "d.csv", "--reward", "exact-match"],
     "--data d.csv has no `prompt` column (columns: text, label)"),
    (["evaluate", "--model", "lm-plain", "--data", "rl_no_answer.jsonl", "--rl", "rloo"],
     "--rl rloo needs a reward function, and the data has no `answer` or `solution` column"),
    (["evaluate", "--model", "lm-plain", "--data", "rl.jsonl", "--reward", "exact-match,ends-turn", "--reward-weights",
      "1"], "the reward weights are 1 value(s) for 2 reward function(s)"),
    # experiment trackers (--report-to)
    pytest.param(["train", "--report-to", "wandb"], "--report-to: unknown tracker `wandb`", marks=FRESH),
    (["train", "--report-to", "TensorBoard"], "unknown tracker `TensorBoard`"),
    (["train", "--report-to", "tensorboard,tensorboard"], "--report-to names tensorboard twice"),
    (["train", "--report-to", "none,mlflow"], "mixes none with trackers"),
    (["train", "--report-to", "tensorboard,"], "has an empty name"),
    (["train", "--report-to", "tensorboard", "--run-name", " "], "--run-name is empty"),
    # the fourth hostile pass (issue 41)
    (["train", "--optim", "adafactor", "--strategy", "fsdp"],
     "--optim adafactor with --strategy fsdp is not supported"),
    (["train", "--optim", "adamw-8bit", "--strategy", "fsdp"], "--optim adamw-8bit with --strategy fsdp"),
    (["plan", "--optim", "galore-adamw", "--peft", "lora"], "an alternative to --peft lora's adapters"),
    (["plan", "--optim", "muon", "--strategy", "fsdp"], "it needs each weight whole"),
    (["plan", "--optim", "adam-8bit", "--strategy", "fsdp"], "--optim adam-8bit with --strategy fsdp"),
    (["evaluate", "--model", "prev/model", "--max-new-tokens", "0"], "--max-new-tokens must be > 0"),
    # --distill-from (tasks/distillation.py)
    (["train", *TINY, "--data", "d.csv", "--distill-from", "nowhere", "--output-dir", "new"],
     "--distill-from nowhere is not a folder"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "no-teacher", "--output-dir", "new"],
     "--distill-from no-teacher holds no config.json: it is not a saved model"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "corrupt", "--output-dir", "new"], "--distill-from corrupt"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "vit", "--output-dir", "new"],
     "--distill-from vit is a ViTForImageClassification, not a sequence-classification model"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "prev/model", "--output-dir", "new"],
     "--distill-from prev/model predicts the labels ['LABEL_0', 'LABEL_1'], and the data's are ['ham', 'spam']"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "teacher-chars", "--output-dir", "new"],
     "--distill-from teacher-chars has another tokenizer vocabulary than the model trained"),
    (["train", "--task", "image-classification", "--model", VIT_STUDENT, "--data", "pics.csv", "--distill-from",
      "vit-imagenet", "--output-dir", "new"],
     "--distill-from vit-imagenet has another image processor than the model trained (image_mean [0.485, 0.456, "
     "0.406] vs [0.5, 0.5, 0.5]; image_std [0.229, 0.224, 0.225] vs [0.5, 0.5, 0.5]: the teacher's vs the student's)"),
    (["train", "--task", "audio-classification", "--model", WAV2VEC2, "--data", "long.csv", "--audio-column", "path",
      "--distill-from", "w2v-8k", "--output-dir", "new"],
     "--distill-from w2v-8k has another feature extractor than the model trained (sampling_rate 8000 vs 16000: the "
     "teacher's vs the student's)"),
    (["train", *TINY, "--data", "d.csv", "--distill-alpha", "0.2"],
     "--distill-alpha applies to distillation, and --distill-from is not set"),
    (["train", *TINY, "--data", "d.csv", "--distill-temperature", "4"],
     "--distill-temperature applies to distillation, and --distill-from is not set"),
    (["train", *TINY, "--distill-from", "teacher-hs", "--distill-alpha", "1.5"], "--distill-alpha must be in [0, 1]"),
    (["train", *TINY, "--distill-from", "teacher-hs", "--distill-temperature", "0"],
     "--distill-temperature must be > 0"),
    # --distill-from with --task causal-lm (tasks/lm_distillation.py)
    (["train", *LLAMA, "--distill-from", "teacher-hs", "--output-dir", "new"],
     "--distill-from teacher-hs is a BertForSequenceClassification, not a causal-lm model"),
    (["train", *LLAMA, "--distill-from", "lm-teacher-chars", "--output-dir", "new"],
     "--distill-from lm-teacher-chars has another tokenizer vocabulary than the model trained"),
    (["train", *LLAMA, "--distill-from", "lm-teacher", "--distill-top-k", "0"], "--distill-top-k must be > 0"),
    (["train", *LLAMA, "--distill-from", "lm-teacher", "--distill-top-k", "1000000", "--output-dir", "new"],
     "--distill-top-k 1000000 is above the vocabulary"),
    (["train", *LLAMA, "--distill-top-k", "5"],
     "--distill-top-k applies to distillation, and --distill-from is not set"),
    (["train", *TINY, "--data", "d.csv", "--distill-from", "teacher-hs", "--distill-top-k", "5"],
     "--distill-top-k applies to --task causal-lm, not sequence-classification"),
    (["train", *LLAMA, "--distill-from", "lm-teacher", "--data", "chat.jsonl", "--chat-template", "chatml",
      "--preference", "dpo"], "--distill-from applies to supervised fine-tuning"),
    # --rl distill (tasks/objectives/on_policy_distill.py)
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--output-dir", "new"],
     "--rl distill learns from a teacher, and --distill-from is not set"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "nowhere", "--output-dir", "new"],
     "--distill-from nowhere is not a folder"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "lm-plain", "--output-dir", "new"],
     "--distill-from lm-plain has another vocabulary than the model trained"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "teacher-hs", "--output-dir", "new"],
     "--distill-from teacher-hs is a BertForSequenceClassification, not a causal LM"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "lm-exact", "--distill-alpha", "0.3",
      "--output-dir", "new"], "--distill-alpha does not apply to --rl distill"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "lm-exact", "--distill-beta", "1.5",
      "--output-dir", "new"], "--distill-beta must be in [0, 1]"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "lm-exact", "--reward",
      "exact-match", "--output-dir", "new"], "--reward applies to --rl grpo or rloo, not distill"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "grpo", "--distill-from", "lm-exact", "--output-dir", "new"],
     "--distill-from does not apply to --rl grpo (it learns from rewards)"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--distill-beta", "0.5", "--output-dir", "new"],
     "--distill-beta applies to --rl distill (on-policy distillation)"),
    (["train", *LLAMA, "--data", "rl.jsonl", "--rl", "distill", "--distill-from", "lm-exact", "--distill-top-k", "5",
      "--output-dir", "new"], "--distill-top-k does not apply to --rl distill"),
    (["train", "--zero-stage", "3"], "--zero-stage applies to --strategy deepspeed, not ddp"),
    (["train", "--batch-size", "99999999999999999999"], "--batch-size must be at most 2,147,483,647"),
    (["plan", "--num-labels", "99999999999999999999"], "--num-labels must be at most 1,000,000"),
    (["train", "--config", ""], "--config is empty"),
    (["train", "--output-dir", "dangling"], "--output-dir dangling is a symbolic link to nowhere/run, which does not "
                                           "exist; fix: create the folder it points to"),
    (["train", *LLAMA, "--data", "chat_answer_first.jsonl", "--chat-template", "chatml", "--output-dir", "new"],
     "the conversation in row 7 of the data cannot be located in its templated token ids: the conversation starts "
     "with an assistant turn, which has no prompt before it; fix: correct that conversation"),
    (["train", *LLAMA, "--data", "chat_refused.jsonl", "--chat-template", "picky.jinja", "--output-dir", "new"],
     "the conversation in row 10 of the data cannot be located in its templated token ids: the chat template "
     "refuses it: no refusals; fix: correct that conversation (what the template accepts: its roles and their "
     "order), or remove it"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "empty.jinja", "--output-dir", "new"],
     "--chat-template empty.jinja is an empty file"),
    (["train", *LLAMA, "--data", "chat.jsonl", "--chat-template", "chatml", "--validation-file", "d.csv",
      "--output-dir", "new"], "has no column `messages` (columns: text, label); fix: give it a `messages` column"),
]


@pytest.mark.parametrize("args, needle", CASES)
def test_bad_input(workdir, cli_here, request, args, needle):
    before = snapshot(workdir)  # every earlier run, model and data file
    fresh = request.node.get_closest_marker("fresh_process") is not None
    result = (run_cli if fresh else cli_here)(*args, cwd=workdir)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-2000:]
    assert len(lines) == 1 and needle in lines[0] and "fix:" in lines[0], result.stderr[-2000:]
    assert snapshot(workdir) == before
    assert not (workdir / "new").exists()  # nothing half made: the corrected command is not refused


def test_the_table_is_long_enough():
    assert len(CASES) >= 90
    fresh = [case for case in CASES if any(mark.name == FRESH.name for mark in getattr(case, "marks", ()))]
    assert len(fresh) >= 12
