"""`effitrain inspect`: a model's configuration and parameter counts, and the device Accelerator would take."""

from __future__ import annotations

import json

from effitrain import config as cfg


def add_parser(commands) -> None:
    inspect = commands.add_parser("inspect", help="show a model's configuration and parameter counts")
    inspect.add_argument("model", nargs="?", default="default", help="default, a directory or a cached hub id")
    cfg.add_flags(inspect, ["task", "student_layers"], defaults=True)
    inspect.add_argument("--json", action="store_true", help="print the counts and device as JSON")
    inspect.add_argument("--debug", action="store_true")


def main(args) -> int:
    from effitrain import tasks
    from effitrain.models import loading
    from effitrain.runtime import libraries
    from effitrain.runtime.distributed import make_accelerator

    libraries.quiet_libraries(args.debug)
    task = tasks.get(args.task)
    path = loading.resolve(args.model)
    model_config = loading.load_config(path)
    task.check_supported(model_config)
    model = task.build_on_meta(model_config)
    kept = _student(model, path, task, args.student_layers)
    counts = loading.parameter_counts(model)
    device = str(make_accelerator().device)
    if args.json:
        print(json.dumps({"model": str(path), "config": model.config.to_dict(), "parameters": counts,
                          "device": device, **({"student_layers": kept} if kept else {})}))
        return 0
    print(f"model: {path}")
    if kept:
        print(f"student: {len(kept)} layer{'s' * (len(kept) > 1)}, the teacher's {', '.join(map(str, kept))} "
              "(--student-layers)")
    print(model.config)
    print(f"parameters: {counts['total']:,} total, {counts['trainable']:,} trainable, "
          f"{counts['embedding']:,} in embeddings ({args.task}"
          + (f" head for {model.config.num_labels} labels)" if task.has_labels else ")"))
    print(f"Accelerator would train on: {device}")
    return 0


def _student(model, path, task, layers: int | None) -> list[int] | None:
    """--student-layers: the model (on the meta device) cut to the student train makes of it, in place (the
    same pipeline step: models/student.py); the teacher layers it keeps, or None."""
    if layers is None:
        return None
    from effitrain.models import loading, student

    cfg.check_value("student_layers", layers)
    student.check_source(loading.ModelSource(path), layers, task.build_on_meta)
    kept = student.kept_layers(student.layer_count(model.config), layers)
    student.make_student(model, layers)
    return kept
