"""benchmarks/techniques/distill.py's runs as flags, in-process (its dry run, in test_benchmarks.py, trains):
--student-from-teacher starts both students, alone and distilled, from the teacher's fine-tuned model/, and
names their runs apart from the default students', so that --reuse in one --output-dir never mixes them."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_script():
    spec = importlib.util.spec_from_file_location("bench_distill", ROOT / "benchmarks" / "techniques" / "distill.py")
    module = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    spec.loader.exec_module(module)
    sys.path[:] = saved
    return module


def test_student_from_teacher_starts_both_students_from_the_teachers_model(tmp_path):
    bench = load_script()
    teacher = tmp_path / "e3"
    (teacher / "model").mkdir(parents=True)
    (teacher / "model" / "config.json").write_text("{}")
    split = {name: tmp_path / f"{name}.jsonl" for name in ("train", "validation", "test")}
    default = bench.parse_args(["--teacher", str(teacher)])
    initialised = bench.parse_args(["--teacher", str(teacher), "--student-from-teacher"])
    data = bench.data_flags(split)

    def argv(args, kind):
        return bench.train_argv(kind, 1, args, split, teacher, None)

    assert argv(initialised, "teacher") == argv(default, "teacher") == [*data, "--seed", "1"]
    assert argv(default, "alone") == [*data, "--seed", "1", "--student-layers", "3"]
    assert argv(initialised, "alone") == [*data, "--seed", "1", "--model", str(teacher / "model"),
                                          "--student-layers", "3"]
    assert argv(initialised, "distilled") == [*data, "--seed", "1", "--model", str(teacher / "model"),
                                              "--student-layers", "3", "--distill-from", str(teacher / "model")]
    # the alone students depend on the teacher now: its name is in theirs too
    assert [bench.run_name(kind, 1, default) for kind in ("alone", "distilled")] == \
        ["seed1-alone", "seed1-distilled-teacher_e3"]
    assert [bench.run_name(kind, 1, initialised) for kind in ("alone", "distilled")] == \
        ["seed1-alone-from_teacher_teacher_e3", "seed1-distilled-from_teacher_teacher_e3"]
