"""The kinds of task effitrain trains, and the one table of their constructors.

Everything that depends on what the model learns (the Auto class, the processor, preprocessing,
collators, the loss as a sum over items, counts, metrics, example batches for the planner,
prediction) is a method of the task object that `get(name)` returns. No other module compares task
names. The names themselves live in catalog/task_names.py, which config reads without importing this
package; the classes are imported on first use (torch: not on the CLI's parse path)."""

from __future__ import annotations

from effitrain.catalog.task_names import NAMES


def _classification(modality: str):
    def make(name: str):
        from effitrain.tasks.classification import Classification

        return Classification(name, modality=modality)

    return make


def _causal_lm(name: str):
    from effitrain.tasks.causal_lm import CausalLM

    return CausalLM(name)


# name -> the function that makes its task object from the name.
CONSTRUCTORS = {
    "sequence-classification": _classification("text"),
    "image-classification": _classification("image"),
    "audio-classification": _classification("audio"),
    "causal-lm": _causal_lm,
}
_INSTANCES: dict = {}


def get(name: str):
    """The task object for a registered name (a UserError for any other)."""
    if name not in CONSTRUCTORS:
        from effitrain.errors import UserError

        raise UserError(f"unknown task `{name}`", f"pass --task {' or '.join(NAMES)}")
    if name not in _INSTANCES:
        _INSTANCES[name] = CONSTRUCTORS[name](name)
    return _INSTANCES[name]


def for_config(config):
    """The task object of a run's settings, the one place tasks are built: the registered one, or with
    --preference the same task on preference pairs with the objective named, or with --rl on prompts with its
    online RL objective (a new object each time: it holds the run's reference model), or with --distill-from
    the task with its distillation settings."""
    task = get(config.task)
    if getattr(config, "rl", None) is not None:
        if not task.supports_rl:
            task.check_config(config)  # refuses --rl with the task's name
        from effitrain.tasks import objectives, online_rl

        return online_rl.OnlineRL(task.name, objectives.of_rl(config))
    if getattr(config, "distill_from", None) is not None and getattr(config, "preference", None) is None:
        if not task.supports_distillation:
            task.check_config(config)  # refuses --distill-from with the task's name
        return task.with_distillation(task.distillation_of(config))
    if getattr(config, "preference", None) is None:
        return task
    if not task.supports_preference:
        task.check_config(config)  # refuses --preference with the task's name
    from effitrain.tasks import objectives, preference

    return preference.Preference(task.name, objectives.of(config))


def for_model_config(model_config, where: str, expected: str | None = None):
    """The task a saved model was made for: the one whose Auto class maps the config to the class its
    config.json `architectures` names (BertForSequenceClassification, ViTForImageClassification,
    Wav2Vec2ForSequenceClassification, GPT2LMHeadModel, ...). Without `architectures`, the one task
    whose Auto class knows the config type, if only one does. `expected`: the task the user asked for
    (evaluate's --task), refused when it is not the model's."""
    from effitrain.errors import UserError

    candidates = [get(name) for name in NAMES]
    wanted = get(expected) if expected is not None else None  # an unknown name is refused here
    architectures = list(getattr(model_config, "architectures", None) or [])
    found = [task for task in candidates if task.makes(model_config)]
    if not architectures:
        found = [task for task in candidates if task.supports(model_config)]
    if len(found) == 1 or (found and architectures):
        if wanted is not None and wanted is not found[0]:
            kind = architectures[0] if architectures else model_config.model_type
            raise UserError(f"--task {expected} does not fit the model in {where}: it is a {found[0].name} model "
                            f"({kind})", f"drop --task (the task comes from the model's config.json), or pass a "
                                         f"{expected} model")
        return found[0]

    kind = architectures[0] if architectures else f"model type `{model_config.model_type}` without `architectures`"
    raise UserError(f"the model in {where} is a {kind}, which has no head effitrain predicts or evaluates with "
                    f"(tasks: {', '.join(NAMES)})",
                    "pass a model/ directory written by `effitrain train`, or one whose config.json `architectures` "
                    "names a *ForSequenceClassification, *ForImageClassification, *ForAudioClassification or "
                    "causal LM class")

