"""Instruction and chat data: formats, templates and the labels on answers (data/conversations.py,
data/templates.py, data/answers.py), over token ids, with templates as data and a byte-level BPE
tokenizer trained here (no download)."""

import re

import pytest
import torch
from effitrain.data import answers, conversations, templates
from effitrain.errors import UserError

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>"]

CHATML = templates.CHATML
LLAMA3 = (r"{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          r"'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + "
          r"'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          r"{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
          r"{% endif %}")
QWEN = (r"{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + "
        r"'<|im_end|>\n' }}{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a "
        r"helpful assistant.<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if not (message.role == "
        r"'system' and loop.first) %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + "
        r"'\n' }}{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "qwen": "<|im_end|>"}
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "qwen": QWEN}

CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE tokenizer trained on a few sentences, with the three templates' special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [m["content"] for m in CONVERSATION] * 20 + ["You are Qwen, created by Alibaba Cloud.", "system user"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   bos_token="<|begin_of_text|>",
                                   extra_special_tokens=SPECIAL[1:3] + SPECIAL[4:])


def with_template(tokenizer, template):
    import copy

    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer


def expected_answers(tokenizer, messages, end_of_turn):
    """Each assistant turn's content tokenised alone, then its end-of-turn token."""
    eot = tokenizer.convert_tokens_to_ids(end_of_turn)
    return [tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [eot]
            for m in messages if m["role"] == "assistant"]


def runs(labels):
    out, current = [], []
    for label in labels + [answers.IGNORE]:
        if label != answers.IGNORE:
            current.append(label)
        elif current:
            out.append(current)
            current = []
    return out


@pytest.mark.parametrize("name", TEMPLATES)
def test_labels_cover_exactly_the_assistant_turns_and_their_end_of_turn_tokens(bpe, name):
    tokenizer = with_template(bpe, TEMPLATES[name])
    messages = CONVERSATION[1:] if name == "qwen" else CONVERSATION  # Qwen's adds its default system prompt
    encoded = answers.encode(tokenizer, {"messages": messages}, conversations.MESSAGES)
    assert encoded.input_ids == tokenizer.apply_chat_template(messages)["input_ids"]
    assert runs(encoded.labels) == expected_answers(tokenizer, messages, END_OF_TURN[name])
    assert all(label in (answers.IGNORE, token) for label, token in zip(encoded.labels, encoded.input_ids))
    if name == "qwen":  # the default system prompt is rendered, and not learnt
        assert "You are Qwen" in tokenizer.decode(encoded.input_ids)


def test_generation_blocks_give_the_same_labels_as_rendering_prefixes(bpe):
    marked = CHATML.replace("message['content'] + '<|im_end|>'",
                            "'' }}{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
                            "'<|im_end|>' }}{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}"
                            "{% endif %}{{ ''")
    assert templates.has_generation_blocks(marked)
    plain, blocks = with_template(bpe, CHATML), with_template(bpe, marked)
    assert blocks.apply_chat_template(CONVERSATION, tokenize=False) == plain.apply_chat_template(CONVERSATION,
                                                                                                tokenize=False)
    by_blocks = answers.encode(blocks, {"messages": CONVERSATION}, conversations.MESSAGES)
    by_prefixes = answers.encode(plain, {"messages": CONVERSATION}, conversations.MESSAGES)
    assert by_blocks == by_prefixes


def test_a_generation_block_that_leaves_the_end_of_turn_out_is_refused(bpe):
    marked = CHATML.replace("message['content'] + '<|im_end|>'",
                            "'' }}{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>'")
    with pytest.raises(UserError, match="no special token .* inside its {% generation %} blocks"):
        answers.encode(with_template(bpe, marked), {"messages": CONVERSATION}, conversations.MESSAGES)


def test_a_template_without_an_end_of_turn_token_is_refused(bpe):
    plain = (r"{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
             r"{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(UserError, match="no special token .* at the end of each assistant turn"):
        answers.encode(with_template(bpe, plain), {"messages": CONVERSATION}, conversations.MESSAGES)


def test_a_template_that_renders_earlier_turns_differently_cannot_locate_them(bpe):
    """As Qwen3's drops the reasoning of earlier turns: the conversation up to a turn is not a prefix."""
    changing = CHATML.replace("message['content']", "(message['content'] if loop.last else '...')")
    with pytest.raises(answers.Unlocatable, match="as the start of the whole conversation"):
        answers.encode(with_template(bpe, changing), {"messages": CONVERSATION}, conversations.MESSAGES)


def test_prompt_completion_strings_learn_the_completion_and_the_end_of_text(bpe):
    encoded = answers.encode(bpe, {"prompt": "What is two plus two?", "completion": " It is four."},
                             conversations.PROMPT_COMPLETION)
    prompt = bpe("What is two plus two?", add_special_tokens=False)["input_ids"]
    completion = bpe(" It is four.", add_special_tokens=False)["input_ids"] + [bpe.eos_token_id]
    assert encoded.input_ids == prompt + completion
    assert encoded.labels == [answers.IGNORE] * len(prompt) + completion


def test_conversational_prompt_completion_learns_only_the_completion(bpe):
    """An assistant turn inside the prompt is context, not an answer to learn."""
    tokenizer = with_template(bpe, CHATML)
    row = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}
    encoded = answers.encode(tokenizer, row, conversations.CHAT_PROMPT_COMPLETION)
    assert encoded.input_ids == tokenizer.apply_chat_template(CONVERSATION)["input_ids"]
    assert runs(encoded.labels) == expected_answers(tokenizer, CONVERSATION[4:], "<|im_end|>")


def test_loss_on_all_labels_every_token(bpe):
    tokenizer = with_template(bpe, CHATML)
    encoded = answers.encode(tokenizer, {"messages": CONVERSATION}, conversations.MESSAGES, loss_on="all")
    assert encoded.labels == encoded.input_ids


def test_padding_with_the_end_of_turn_token_keeps_it_learnt(bpe):
    """Padded by length, not by id: a pad token that is also the end-of-turn token stays in the labels."""
    eot = bpe.convert_tokens_to_ids("<|im_end|>")
    batch = answers.collator(eot, multiple=4)([{"input_ids": [5, 6, eot], "labels": [-100, 6, eot]},
                                               {"input_ids": [7], "labels": [-100]}])
    assert batch["input_ids"].tolist() == [[5, 6, eot, eot], [7, eot, eot, eot]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, eot, -100], [-100, -100, -100, -100]]


def test_the_step_loss_is_the_mean_over_answer_tokens():
    """causal-lm's loss sum over its item count: cross-entropy averaged over the answer positions only."""
    from effitrain import tasks
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                         num_key_value_heads=2, intermediate_size=32)).eval()
    batch = answers.collator(0)([{"input_ids": [3, 4, 5, 6, 7], "labels": [-100, -100, 5, 6, 7]},
                                 {"input_ids": [8, 9, 10], "labels": [-100, -100, 10]}])
    task = tasks.get("causal-lm")
    assert int(task.item_count(batch)) == 4
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
    by_hand = torch.stack([torch.nn.functional.cross_entropy(logits[row, position - 1], torch.tensor(target))
                           for row, position, target in ((0, 2, 5), (0, 3, 6), (0, 4, 7), (1, 2, 10))]).mean()
    with torch.no_grad():
        loss = task.loss_sum(model, batch) / task.item_count(batch)
    torch.testing.assert_close(loss, by_hand, rtol=1e-6, atol=1e-6)


def test_formats_are_told_apart_by_their_columns():
    assert conversations.columns(["messages", "id"], "text", "d") == {"messages": "messages"}
    assert conversations.columns(["prompt", "completion"], "text", "d") == {"prompt": "prompt",
                                                                             "completion": "completion"}
    assert conversations.columns(["body"], "body", "d") == {"text": "body"}
    with pytest.raises(UserError, match="mixes data formats: it has `messages` and `text` columns"):
        conversations.columns(["text", "messages"], "text", "d")
    with pytest.raises(UserError, match="has a `prompt` column but no `completion` column"):
        conversations.columns(["prompt"], "text", "d")


def test_bad_conversations_are_refused_by_row_or_skipped():
    from datasets import Dataset

    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [good, [{"role": "robot", "content": "hi"}, good[1]], good[:1], [good[0], {"role": "assistant",
                                                                                      "content": " "}]]
    data = Dataset.from_dict({"messages": rows})
    with pytest.raises(UserError, match="row 2 message 1 has the unknown role `robot`"):
        conversations.bad_rows(data, "d", skip=False)
    assert conversations.bad_rows(data, "d", skip=True) == [1, 2, 3]
    assert conversations.bad_rows(data.select([2]), "d", skip=True) == [0]
    with pytest.raises(UserError, match="row 1 ends on a user turn"):
        conversations.bad_rows(data.select([2]), "d", skip=False)
    with pytest.raises(UserError, match="row 1 has an empty completion"):
        conversations.bad_rows(data.select([3]), "d", skip=False)


def test_chatml_adds_its_tokens_and_becomes_the_eos_of_a_tokenizer_without_one(tokenizer):
    import copy

    bert = copy.deepcopy(tokenizer)  # WordPiece: no EOS, no chat template
    templates.install(bert, "chatml")
    assert bert.chat_template == CHATML and bert.eos_token == "<|im_end|>"
    ids = bert.apply_chat_template(CONVERSATION[1:3])["input_ids"]
    assert bert.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [ids[0], ids[-1]]
    encoded = answers.encode(bert, {"messages": CONVERSATION[1:3]}, conversations.MESSAGES)
    assert runs(encoded.labels) == [bert("It is four.", add_special_tokens=False)["input_ids"] + [ids[-1]]]


@pytest.mark.parametrize("name", TEMPLATES)
def test_the_end_of_turn_token_is_what_ends_the_answers(bpe, name):
    tokenizer = with_template(bpe, TEMPLATES[name])
    assert answers.end_of_turn_id(tokenizer, conversations.MESSAGES) == tokenizer.convert_tokens_to_ids(
        END_OF_TURN[name])
    assert answers.end_of_turn_id(tokenizer, conversations.PROMPT_COMPLETION) == tokenizer.eos_token_id


ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
# No call, attribute or output inside the inner loop: only an exception raised in the thread stops it.
SILENT_ENDLESS = "{% set r = range(100000) | list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}"


@pytest.mark.parametrize("template", [ENDLESS, SILENT_ENDLESS], ids=["calls", "silent"])
def test_a_template_that_never_ends_is_stopped_in_any_thread(bpe, monkeypatch, template):
    """The time limit stops the render whichever thread runs it (the Python API from a thread, evaluate's
    workers): no signal, no alarm left behind."""
    import signal
    import threading
    import time

    from effitrain.data import chat_render

    monkeypatch.setattr(chat_render, "SECONDS", 0.3)
    before = signal.getsignal(signal.SIGALRM)
    outcome = {}

    def encode(tokenizer):
        start = time.monotonic()
        try:
            answers.encode(tokenizer, {"messages": CONVERSATION}, conversations.MESSAGES)
        except UserError as err:
            outcome["error"], outcome["seconds"] = str(err), time.monotonic() - start

    for thread in ("main", "another"):  # a template of each (a template stopped once is refused at once after)
        outcome.clear()
        tokenizer = with_template(bpe, template + "{# " + thread + " #}")
        if thread == "main":
            encode(tokenizer)
        else:
            worker = threading.Thread(target=encode, args=(tokenizer,))
            worker.start()
            worker.join(30)
        assert "was stopped on a conversation: it ran more than 0.3 s" in outcome["error"], (thread, outcome)
        assert outcome["seconds"] < 5
    assert signal.getsignal(signal.SIGALRM) is before
    time.sleep(0.5)  # a limit that expired after its render ended raises nothing later
    plain = answers.encode(with_template(bpe, CHATML), {"messages": CONVERSATION}, conversations.MESSAGES)
    assert plain.input_ids == with_template(bpe, CHATML).apply_chat_template(CONVERSATION)["input_ids"]


@pytest.mark.parametrize("template, said", [
    ("{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v ~ s.v %}{% endfor %}{{ s.v }}",
     "it builds a value of"),
    ("{% set s = namespace(v='x') %}{% for i in range(40) %}{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}",
     "it builds a value of"),
    ("{{ 'x' * 100000000 }}", "it builds a value of 1 x 100,000,000"),
    ("{{ 10 ** (10 ** 8) }}", "it computes 10 ** 100000000"),
    ("{{ '%0999999999d' % 1 }}", "it builds a formatted field 999,999,999 wide"),
    ("{{ 'x' | center(999999999) }}", "it passes 999,999,999 to the filter center"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "it builds an output of more than"),
    ("{{ 'x'.ljust(10000000000) }}", "it passes 10,000,000,000 to ljust"),
    ("{{ '{:>{}}'.format('x', 10000000000) }}", "it passes 10,000,000,000 to format"),
    ("{{ '%*d' % (10000000000, 1) }}", "it builds a formatted field 10,000,000,000 wide"),
    ("{% set a = 'x' * 10000000 %}{{ a | replace('x', 'yyyy') }}", "it builds a replacement of 40,000,000"),
    ("{% set a = 'x' * 10000000 %}{{ a.replace('x', 'yyyy') }}", "it builds a replacement of 40,000,000"),
    ("{% set a = 'x' * 1000000 %}{{ range(100) | join(a) }}", "it builds a join of 99,000,190"),
    ("{% set a = 'x' * 1000000 %}{{ a.join(range(100) | map('string')) }}", "it builds a join of"),
], ids=["tilde", "plus", "repeat", "power", "format", "filter", "output", "ljust", "str-format", "star-width",
        "replace-filter", "replace-method", "join-filter", "join-method"])
def test_a_template_that_builds_gigabytes_is_stopped_before_it_does(bpe, template, said):
    """Sizes are checked before each operation that could build a huge value (and Jinja's compiler no longer
    computes constant ones while it compiles: `10 ** (10 ** 8)` took minutes there)."""
    import time

    start = time.monotonic()
    with pytest.raises(UserError, match="was stopped on a conversation: " + re.escape(said)):
        answers.encode(with_template(bpe, template), {"messages": CONVERSATION}, conversations.MESSAGES)
    assert time.monotonic() - start < 5


def test_a_template_slow_on_every_conversation_is_stopped_and_a_stopped_one_refused_at_once(bpe, monkeypatch):
    """Under the limit one by one, renders that add up (0.1 s and more each, past the limit in all) are
    stopped: a data set's conversations would take hours. A template stopped once is refused at once after
    (predict renders three times: one wait, not three)."""
    import time

    from effitrain.data import chat_render

    monkeypatch.setattr(chat_render, "SECONDS", 1.0)
    slow = "{% for i in range(200) %}{% for j in range(30000) %}{% endfor %}{% endfor %}" + CHATML  # ~0.2 s
    tokenizer = with_template(bpe, slow)
    start = time.monotonic()
    with pytest.raises(UserError, match=r"was stopped on a conversation: it takes \d\.\d\d s a conversation"):
        for _ in range(200):
            answers.encode(tokenizer, {"messages": CONVERSATION}, conversations.MESSAGES)
    assert time.monotonic() - start < 10
    start = time.monotonic()
    with pytest.raises(UserError, match="it takes"):
        answers.check_generation_prompt(tokenizer, "slow")
    assert time.monotonic() - start < 0.5


def test_a_template_file_is_compiled_within_the_limits(tmp_path):
    path = tmp_path / "fold.jinja"
    path.write_text("{{ 10 ** (10 ** 8) }}")
    templates.read(str(path))  # compiled without folding the constant: it is computed (and refused) at render


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_that_prompt_the_assistant_pass_the_generation_prompt_check(bpe, name):
    answers.check_generation_prompt(with_template(bpe, TEMPLATES[name]), name)


def test_a_template_that_ignores_add_generation_prompt_is_refused_and_a_headerless_one_is_not(bpe):
    """Without its {% if add_generation_prompt %} block, ChatML's "<|im_start|>assistant\\n" would sit inside
    every answer (trained on, then printed by predict); a template whose turns have no header loses nothing."""
    blind = CHATML.split("{% if add_generation_prompt %}")[0]
    with pytest.raises(UserError, match=r"ignores add_generation_prompt: the assistant's turn starts with "
                                        r"'<\|im_start\|>assistant'.*fix: add \{% if add_generation_prompt %\}"):
        answers.check_generation_prompt(with_template(bpe, blind), "blind")
    headerless = "{% for message in messages %}{{ message['content'] + '<|endoftext|>' }}{% endfor %}"
    answers.check_generation_prompt(with_template(bpe, headerless), "headerless")


TOOLS_CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}{% if message['content'] %}"
                "{{ message['content'] }}{% endif %}{% for call in message.get('tool_calls') or [] %}"
                "{{ '<tool_call>' + "
                "call['function']['name'] + ' ' + (call['function']['arguments'] | tojson) + '</tool_call>' }}"
                "{% endfor %}{{ '<|im_end|>' + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
TOOL_CONVERSATION = [
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant",
     "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 2}}}]},
    {"role": "tool", "name": "add", "content": "4"},
    {"role": "assistant", "content": "It is four."},
]


def test_tool_calling_conversations_train_on_the_calls_and_the_answer(bpe, tmp_path):
    """TRL's tool-calling format (an assistant turn of tool_calls, a `tool` turn with a `name`): read from JSON
    Lines (datasets types such messages as JSON objects), checked row by row, and trained on with a template
    that renders calls: the loss covers the call turn and the answer, not the tool's result."""
    import json

    from datasets import load_dataset

    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": TOOL_CONVERSATION}) + "\n" + json.dumps({"messages": CONVERSATION}) + "\n")
    data = load_dataset("json", data_files=str(path), split="train")
    assert conversations.bad_rows(data, "tools.jsonl", skip=False) == []
    tokenizer = with_template(bpe, TOOLS_CHATML)
    encoded = answers.encode(tokenizer, {"messages": TOOL_CONVERSATION}, conversations.MESSAGES)
    learnt = tokenizer.decode([i for i in encoded.labels if i != answers.IGNORE])
    assert learnt == '<tool_call>add {"a": 2, "b": 2}</tool_call><|im_end|>It is four.<|im_end|>'
    with pytest.raises(UserError, match="the data has tool calls .* does not render them"):
        answers.encode(with_template(bpe, CHATML), {"messages": TOOL_CONVERSATION}, conversations.MESSAGES)
    broken = [TOOL_CONVERSATION[0], {"role": "assistant", "tool_calls": [{"name": "add"}]}]
    assert "has tool_calls that are not the assistant's list" in conversations._problem({"messages": broken},
                                                                                        conversations.MESSAGES)[0]


def test_the_generation_prompt_check_leaves_a_template_that_refuses_its_probe_to_the_data(bpe):
    """A template that requires a system turn refuses the check's bare user turn: the check passes it to the
    conversations themselves, which it renders (or refuses with their row) one by one."""
    picky = "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system turn first') }}{% endif %}" + CHATML
    answers.check_generation_prompt(with_template(bpe, picky), "picky")
    encoded = answers.encode(with_template(bpe, picky), {"messages": CONVERSATION}, conversations.MESSAGES)
    assert runs(encoded.labels) == expected_answers(bpe, CONVERSATION, "<|im_end|>")
