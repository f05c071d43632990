"""Causal language modelling: every token predicts the next one; on instruction and chat data, only the
answers' tokens are learnt (data/answers.py)."""

from __future__ import annotations

import copy
import math

import torch

from effitrain.errors import UserError
from effitrain.models import loading
from effitrain.tasks.base import Task
import effitrain.tasks.lm_distillation as lm_distillation
from effitrain.tasks.lm_head import LMHead


class CausalLM(Task):
    auto_class_name = "AutoModelForCausalLM"
    is_text = True
    has_labels = False
    supports_packing = True
    chunked_loss = True
    grows_vocabulary = True  # adapt_model
    supports_chat = True
    supports_preference = True  # tasks/preference.py: this task on chosen/rejected pairs
    supports_rl = True  # tasks/online_rl.py: this task on prompts, learnt from the rewards of its completions
    supports_distillation = True  # tasks/lm_distillation.py: SFT beside a teacher's top-k log-probs
    distillation = None  # --distill-from: a tasks.lm_distillation.LMDistillation (with_distillation)
    pipeline_tag = "text-generation"  # the Hub's name for the task (model cards)
    higher_is_better = ("token_accuracy", "exact_match", "end_of_turn_share")
    GENERATION_METRICS = ("exact_match", "end_of_turn_share")  # prompt-completion and chat data only

    @staticmethod
    def distillation_of(config):
        """--distill-from's settings for this task (tasks.for_config)."""
        return lm_distillation.LMDistillation.of(config)

    def with_distillation(self, distillation) -> CausalLM:
        """This task learning from a teacher's top-k log-probs as well as the labels (a copy: tasks.for_config's)."""
        distilled = copy.copy(self)
        distilled.distillation = distillation
        return distilled

    # -- models ------------------------------------------------------------------------------------
    def load_processor(self, source: loading.ModelSource):
        self.check_head(self.source_config(source))
        return loading.load_text_tokenizer(source)

    def adapt_config(self, config, processor) -> None:
        """A model from a config: the tokenizer's vocabulary and EOS (a config's default ids, Llama's 2, name
        some other token of this tokenizer)."""
        config.vocab_size = len(processor)
        config.eos_token_id = processor.eos_token_id

    def adapt_model(self, model, processor) -> None:
        if model.config.pad_token_id is None and processor is not None:
            model.config.pad_token_id = processor.pad_token_id
        rows = model.get_input_embeddings().weight.shape[0]
        if processor is not None and len(processor) > rows:  # a chat template's special tokens were added
            from effitrain.models import adapters

            model.resize_token_embeddings(len(processor))
            added = list(range(rows, len(processor)))
            adapters.mark_new_tokens(model, dict(zip(added, processor.convert_ids_to_tokens(added))))  # --peft trains them
        if processor is not None and model.can_generate():
            from effitrain.data import answers

            # Saved into model/generation_config.json: plain `generate` on model/ stops at the end of turn too
            # (the stops a pretrained model's own config lists are kept).
            own = model.generation_config.eos_token_id
            stops = list(dict.fromkeys([*([] if own is None else [own] if isinstance(own, int) else own),
                                        *answers.stop_ids(processor)]))
            if stops:
                model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]

    def check_built_model(self, model, encoded, processor, config) -> None:
        """--distill-from: the teacher's vocabulary is the student's. --packing: two training examples packed and
        padded give the same logits (tasks/packing_check.py). Run on the plain model: the transforms after it
        change no computation across positions."""
        import effitrain.tasks.packing_check as packing_check

        if self.distillation is not None:
            self.distillation.check_teacher(self, model, processor)
        if config.packing:
            packed, padded = self.collators(processor, config)
            packing_check.check(model, packing_check.examples(encoded["train"]), packed, padded)

    def check_config(self, config) -> None:
        super().check_config(config)
        other = "--preference" if getattr(config, "preference", None) is not None else \
            "--rl" if getattr(config, "rl", None) not in (None, "distill") else None
        if getattr(config, "distill_from", None) is not None and other is not None:
            raise UserError(f"--distill-from applies to supervised fine-tuning (--task causal-lm on text, prompt-"
                            f"completion or chat data), not with {other}", f"drop --distill-from, or drop {other}")
        if self.distillation is not None:  # a teacher folder that is no causal LM: before the data loads
            self.distillation.teacher_config(self)
        if config.chat_template is not None:
            from effitrain.data import templates

            templates.read(config.chat_template)  # a missing file or one that does not parse: before anything loads

    # -- data --------------------------------------------------------------------------------------
    def columns(self, config) -> dict[str, str]:
        return {"text": config.text_column}

    def load_data(self, config):
        """The columns of the format the data has (conversations.columns), its conversations checked."""
        from effitrain.data import conversations, sources

        self.check_lengths(config)
        def columns(names, where):
            from effitrain.data import preferences

            if preferences.is_preference(names):
                raise UserError(f"{where} holds preference pairs (`chosen`/`rejected` columns)",
                                "pass --preference dpo (or orpo) to train on them")
            return conversations.columns(names, config.text_column, where)

        return sources.load(config, columns, bad_rows=conversations.bad_rows)

    def preprocess(self, splits, processor, config, base_dir):
        """Text: every token; prompt-completion and conversations: ids and labels on the answers (answers.py),
        conversations rendered by the chat template (--chat-template installed on the tokenizer first)."""
        from effitrain.data import answers, conversations, templates, text

        fmt = conversations.of_data(splits["train"])
        templates.record_format(processor, fmt in conversations.CONVERSATIONAL)  # for predict --prompt
        if config.chat_template is not None and fmt not in conversations.CONVERSATIONAL:
            raise UserError(f"--chat-template applies to conversations (a `messages` column, or prompt/completion as "
                            f"message lists); --data {config.data} is {fmt} data",
                            "drop --chat-template, or give the data as messages")
        if fmt == conversations.TEXT:
            if config.metric_for_best in self.GENERATION_METRICS:
                raise UserError(f"--metric-for-best {config.metric_for_best} scores generated answers, and --data "
                                f"{config.data} is text data, which has no answers",
                                "pass --metric-for-best loss (or perplexity, token_accuracy), or give prompt-completion "
                                "or messages data")
            stop = processor.eos_token_id if processor.eos_token_id is not None else processor.sep_token_id
            return text.tokenize(splits, processor, config.max_length, labels=False, end=stop)
        if config.chat_template is not None:
            templates.install(processor, config.chat_template)
        if fmt in conversations.CONVERSATIONAL:
            answers.check_generation_prompt(processor, config.model)
        # Evaluation measures the answers (loss, perplexity, exact match), whatever --loss-on trains on.
        encoded = answers.encode_splits(type(splits)(train=splits["train"]), processor, fmt, config.loss_on,
                                        config.max_length)
        others = type(splits)({name: split for name, split in splits.items() if name != "train"})
        if others:
            encoded.update(answers.encode_splits(others, processor, fmt, "completion", config.max_length))
        return encoded

    # What drop_untrainable says of a row that lost its answer to --max-length.
    UNTRAINABLE = "example(s) of --data {data} keep no answer token"

    def trainable_flags(self, split) -> list[bool] | None:
        """Per row: whether an answer token is left within --max-length; None: text data (no answers)."""
        from effitrain.data import answers

        if "labels" not in split.column_names:
            return None
        return [answers.has_answer(labels) for labels in split["labels"]]

    def drop_untrainable(self, encoded, config):
        """Examples whose every answer token lies beyond --max-length (possible only with labels on answers)."""
        keep = {name: self.trainable_flags(split) for name, split in encoded.items()}
        if keep["train"] is None:
            return encoded, 0
        empty = sum(len(flags) - sum(flags) for flags in keep.values())
        if empty and not config.skip_bad_rows:
            raise UserError(f"{empty} {self.UNTRAINABLE.format(data=config.data)} within --max-length "
                            f"{config.max_length} (the prompt fills it)",
                            "raise --max-length, or pass --skip-bad-rows to leave them out")
        if empty:
            encoded = type(encoded)({name: split.select([i for i, ok in enumerate(keep[name]) if ok])
                                     for name, split in encoded.items()})
        return encoded, empty

    def data_description(self, splits, config) -> str:
        from effitrain.data import conversations

        fmt = conversations.of_data(splits["train"])
        if fmt == conversations.TEXT:
            return "text: loss on every token, the end-of-text token after each text that fits"
        template = "" if fmt not in conversations.CONVERSATIONAL else \
            f", chat template {config.chat_template or 'of the tokenizer'}"
        loss = "every token" if config.loss_on == "all" else \
            "the completions" if fmt == conversations.PROMPT_COMPLETION else "the assistant turns"
        return f"{fmt}{template}, loss on {loss}"

    def collators(self, processor, config):
        """(training collator, evaluation collator): packed rows only in training, when asked. Data with
        labels of its own (answers only) keeps them; text's labels are its ids. With --distill-from, the
        training batches carry the teacher's top-k per position (tasks/lm_distillation.py)."""
        from effitrain.data import answers, text

        by_ids = text.lm_collator(processor, text.pad_multiple(config))
        by_labels = answers.collator(processor.pad_token_id, text.pad_multiple(config))

        def padded(features):
            return (by_labels if "labels" in features[0] else by_ids)(features)

        train = text.packing_collator() if config.packing else padded
        if self.distillation is not None:
            train = lm_distillation.with_teacher_columns(train, self.distillation.top_k)
        return train, padded

    # -- the loss and its counts -------------------------------------------------------------------
    def loss_positions(self, train) -> int | None:
        """Answer-only data (labels of its own): the most labelled positions of a row; text: every position."""
        columns = [name for name in train.column_names if name.endswith("labels")]  # a pair's chosen_/rejected_
        if not columns:
            return None
        return max((sum(1 for label in row if label != -100) for name in columns for row in train[name]), default=0)

    def item_count(self, batch) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()

    def example_count(self, batch) -> torch.Tensor:
        """A packed row holds one example per position id 0."""
        if "position_ids" in batch:
            return (batch["position_ids"] == 0).sum()
        return super().example_count(batch)

    @staticmethod
    def inputs(batch) -> dict:
        return {k: v for k, v in batch.items() if k != "labels" and k not in lm_distillation.COLUMNS}

    def loss_sum(self, model, batch) -> torch.Tensor:
        """Next-token prediction: position t predicts token t+1; -100 targets (padding, and the first token of
        each packed example) are ignored. The training batches of --distill-from add the teacher's term."""
        if lm_distillation.IDS in batch:
            return self.distillation.loss_sum(LMHead(model), self.inputs(batch), batch)
        return LMHead(model).loss_sum(self.inputs(batch), batch["labels"][:, 1:])

    def planned_loss_sum(self, model, batch, loss_positions: int | None) -> torch.Tensor:
        return LMHead(model, planned_per_row=loss_positions).loss_sum(self.inputs(batch), batch["labels"][:, 1:])

    # -- evaluation --------------------------------------------------------------------------------
    def eval_setting(self, processor, config, split):
        """Prompt-completion and chat data (labels on the answers): how answers are generated and scored
        (tasks/generation.py); text data: None (loss, perplexity and token accuracy only)."""
        import effitrain.tasks.generation as generation

        if "labels" not in split.column_names:
            return None
        return generation.for_split(processor, split, config.max_new_tokens)

    def eval_outputs(self, model, batch, setting=None) -> tuple[torch.Tensor, ...]:
        """Per example: the loss summed over its answer tokens, their count, the correct next-token
        guesses; with a generation setting also whether its generated answer matches the reference,
        and whether it stopped at the end of turn."""
        targets = batch["labels"][:, 1:]
        losses, correct = LMHead(model).per_position(self.inputs(batch), targets)
        mask = targets != -100
        outputs = (losses.sum(-1), mask.sum(-1), (correct & mask).sum(-1))
        if setting is None:
            return outputs
        import effitrain.tasks.generation as generation

        prompts, references = generation.prompts_and_references(batch)
        exact, stopped = generation.scores(generation.generate(model, prompts, setting), references, setting)
        device = outputs[0].device
        return (*outputs, exact.long().to(device), stopped.long().to(device))  # gloo gathers no bools

    def metrics(self, outputs: tuple, label_names: list[str] | None) -> dict[str, float]:
        loss_total, tokens, correct = (float(t.double().sum()) for t in outputs[:3])
        loss = loss_total / max(tokens, 1)
        samples = len(outputs[0])
        result = {"loss": loss, "perplexity": math.exp(min(loss, 50)), "token_accuracy": correct / max(tokens, 1),
                  "tokens": int(tokens), "samples": int(samples)}
        if len(outputs) == 5:  # answers generated (eval_setting)
            result["exact_match"] = float(outputs[3].double().sum()) / max(samples, 1)
            result["end_of_turn_share"] = float(outputs[4].double().sum()) / max(samples, 1)
        return result

    def metric_names(self, label_names: list[str] | None) -> list[str]:
        return ["loss", "perplexity", "token_accuracy", *self.GENERATION_METRICS]

    def example_batch(self, model_config, batch_size: int, seq_len: int) -> dict:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}

    # -- prediction: generation ----------------------------------------------------------------------
    def prediction_inputs(self) -> str:
        return ("--prompt \"...\" (repeatable) or --input FILE.jsonl|csv with a `prompt` (or `text`) field, or a "
                "FILE.jsonl of chat `messages`")

    def prediction_records(self, given, where: str) -> list[dict]:
        from effitrain.data import inputs

        self.refuse_other_inputs(given, ("--prompt", "--input"), where)
        records = [{"prompt": prompt} for prompt in given.prompts]
        fix = "pass a JSONL file with one {\"prompt\": ...} or {\"messages\": [...]} per line (or a CSV with a " \
              "`prompt` column)"
        if given.input_file:
            path = inputs.existing(given.input_file, fix)
            rows = inputs.read_table(path, fix)
            if any("text_pair" in row for row in rows):
                raise UserError(f"--input {given.input_file} holds text pairs (a `text_pair` field), which classifiers "
                                f"label; the model in {where} is a {self.name} model, which continues prompts",
                                f"pass {self.prediction_inputs()}")
            if any("messages" in row for row in rows):
                records += self.conversations(path, rows)
            else:
                records += [{"prompt": prompt} for prompt in inputs.string_field(path, rows, ("prompt", "text"), fix)]
        for number, record in enumerate(records, 1):
            if "prompt" in record and not record["prompt"].strip():
                raise UserError(f"prompt {number} is empty", "give every prompt some text to continue")
        return records

    @staticmethod
    def conversations(path, rows: list[dict]) -> list[dict]:
        """--input rows of chat `messages` (every row one), each a conversation for the model to answer."""
        from effitrain.data import conversations

        records = []
        for number, row in enumerate(rows, 1):
            problem = conversations.prompt_problem(row.get("messages"))
            if problem is not None:
                raise UserError(f"--input {path} row {number} {problem[0]}", problem[1])
            records.append({"messages": row["messages"]})
        return records

    def prediction_encodings(self, records: list[dict], processor, options) -> list:
        """Each input's token ids: prompts tokenised as training tokenised prompt-completion prompts, all in
        one call; conversations rendered by the saved chat template with its generation prompt (the ids
        training saw before an answer), and so a prompt to a model trained on conversations (the saved
        tokenizer's record), as one user message. A long input keeps its end (what the model continues),
        options.max_length tokens of it."""
        from effitrain.data import answers, templates

        if templates.trained_on_conversations(processor):
            records = [{"messages": [{"role": "user", "content": r["prompt"]}]} if "prompt" in r else r for r in records]
        prompts = [r["prompt"] for r in records if "prompt" in r]
        tokenised = iter(processor(prompts)["input_ids"] if prompts else [])
        if len(prompts) < len(records):
            answers.check_generation_prompt(processor, processor.name_or_path)
        rows = [answers.prompt_ids(processor, next(tokenised)) if "prompt" in r else
                answers.prompt_render_ids(processor, r["messages"]) for r in records]
        return [row[-options.max_length:] for row in rows] if options.max_length else rows

    def prediction_size(self, encoding) -> int:
        return len(encoding)

    def prediction_batch(self, encodings: list, processor, options) -> dict:
        """Prompts padded on the left, so that every row's next token is generated at the same position."""
        import effitrain.tasks.generation as generation

        return generation.left_padded(encodings, processor.pad_token_id)

    def predictions(self, model, batch: dict, processor, options) -> list[dict]:
        """Greedy continuations, or sampled ones when a temperature or top-p is given; each stops at the
        end of turn (or EOS)."""
        positions = getattr(model.config, "max_position_embeddings", None)
        if positions is not None:
            room = positions - options.max_new_tokens
            if room <= 0:
                raise UserError(f"--max-new-tokens {options.max_new_tokens} leaves no room for the prompt in the "
                                f"model's {positions} positions", f"pass --max-new-tokens below {positions}")
            batch = {key: value[:, -room:] for key, value in batch.items()}  # keep the end of long prompts
        sampling = options.temperature is not None or options.top_p is not None
        settings = {"do_sample": True, "temperature": options.temperature or 1.0, "top_p": options.top_p or 1.0,
                    "top_k": None} if sampling else {"do_sample": False}
        from effitrain.data import answers

        generated = model.generate(**batch, max_new_tokens=options.max_new_tokens,
                                   eos_token_id=answers.stop_ids(processor) or None,
                                   pad_token_id=processor.pad_token_id, **settings)
        continuations = processor.batch_decode(generated[:, batch["input_ids"].shape[1]:].cpu(),
                                               skip_special_tokens=True)
        return [{"generated": text} for text in continuations]

