"""effitrain report (report/): the page of one run and of several, read back in a real browser
(Debian's headless Chromium, driven by selenium; `make test` installs both), and its pieces in process:
reading runs as far as they got, the table of differences, the checks of --out."""

from __future__ import annotations

import json
import os
import shutil
import socket
from pathlib import Path

import effitrain
import pytest
from effitrain.errors import UserError
from effitrain.outputs import run_folder
from effitrain.report import page as report_page
from effitrain.report import runs as report_runs
from effitrain.report import svg

from conftest import run_cli

SMALL = dict(max_train_samples=96, max_eval_samples=40, max_steps=6, eval_every=2, log_every=1, batch_size=16,
             max_length=64, lr=1e-3, warmup_ratio=0.0)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Two finished tiny runs: `a`, and `b` with another lr and batch size."""
    root = tmp_path_factory.mktemp("report")
    effitrain.train({**SMALL, "model": str(tiny_model_dir), "output_dir": str(root / "a")})
    effitrain.train({**SMALL, "model": str(tiny_model_dir), "output_dir": str(root / "b"), "lr": 5e-4,
                     "batch_size": 8})
    return root


# --- what train writes ------------------------------------------------------------------------------

def test_train_writes_the_page_and_the_confusion_matrix(runs):
    a = runs / "a"
    page = (a / "report.html").read_text()
    assert 'content="effitrain report"' in page and "Loss (train: solid, validation: dashed)" in page
    assert "<script" not in page and "http://" not in page and "https://" not in page  # loads nothing
    assert not list(a.glob("report-*.png"))  # train writes the page alone (matplotlib costs ~0.5 s per run)
    assert run_folder.foreign_entries(a) == []  # --overwrite may replace it
    metrics = json.loads((a / "metrics.json").read_text())
    matrix = metrics["test_confusion_matrix"]
    assert matrix["labels"] == metrics["labels"] == ["ham", "spam"]
    assert sum(map(sum, matrix["counts"])) == metrics["test"]["samples"]
    correct = sum(matrix["counts"][i][i] for i in range(2))
    assert correct / metrics["test"]["samples"] == pytest.approx(metrics["test"]["accuracy"])
    assert metrics["examples"]["test"] == metrics["test"]["samples"] and metrics["memory_plan"] is None


def test_a_memory_plan_is_shown_against_the_measured_peak(runs, tmp_path):
    """What metrics.json records of a --memory-budget plan (test_planning checks that runs record it)."""
    planned = copy_run(runs / "a", tmp_path / "planned")
    metrics = json.loads((planned / "metrics.json").read_text())
    metrics["memory_plan"] = {"budget_bytes": 4 * 2**30, "note": "memory budget 4.00 GiB per device: predicted "
                              "peak 0.50 GiB", "predicted_peak_bytes": metrics["peak_memory_bytes"] // 4,
                              "in_use_bytes": metrics["peak_memory_bytes"] // 4}  # the peak: 2x the prediction
    (planned / "metrics.json").write_text(json.dumps(metrics))
    page = report_page.render(report_runs.find_runs([str(planned)]))
    assert "Memory plan (--memory-budget)" in page and "predicted peak (memory plan)" in page
    assert "<td>measured vs predicted</td><td>+100.0%</td>" in page


# --- in a browser -----------------------------------------------------------------------------------

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
# Nothing on the network: no background services, and every host name resolves to nothing.
OFFLINE_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-default-apps", "--disable-extensions", "--disable-domain-reliability",
                 "--disable-client-side-phishing-detection", "--metrics-recording-only", "--no-pings",
                 "--disable-features=Translate,OptimizationHints,MediaRouter,AutofillServerCommunication",
                 "--host-resolver-rules=MAP * ~NOTFOUND", "--window-size=1400,1000")


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("no chromium/chromedriver: apt-get install chromium chromium-driver (make test does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="pip install -e '.[dev]' (selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # with the driver's path: selenium-manager never runs (it downloads)
    for flag in OFFLINE_FLAGS + (f"--user-data-dir={tmp_path_factory.mktemp('chromium')}",):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SE_OFFLINE", "true")
        driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def open_page(driver, page: Path, screenshot: Path) -> dict:
    """Load the page, screenshot it whole; what the console said and which URLs it requested."""
    driver.get_log("browser"), driver.get_log("performance")  # drop what an earlier page left
    driver.get(page.resolve().as_uri())
    height = driver.execute_script("return document.body.scrollHeight")
    driver.set_window_size(1400, min(height + 100, 8000))
    driver.save_screenshot(str(screenshot))
    requests = [json.loads(e["message"])["message"] for e in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requests if m["method"] == "Network.requestWillBeSent"]
    return {"console": driver.get_log("browser"), "urls": urls}


def check_loaded(seen: dict, page: Path, screenshot: Path) -> None:
    assert [e for e in seen["console"] if e["level"] in ("SEVERE", "WARNING")] == [], seen["console"]
    # The page requested only itself (and data: URLs); chrome:// ones are the browser's own start page.
    assert any(url.startswith("file:") for url in seen["urls"]), seen["urls"]
    assert not [url for url in seen["urls"] if not url.startswith(("file:", "data:", "chrome:", "about:"))]
    from PIL import Image

    with Image.open(screenshot) as shot:
        assert shot.size[0] >= 1000 and len(shot.convert("L").getcolors(maxcolors=2**16) or range(99)) > 20


def drawn_charts(driver) -> dict[str, int]:
    """chart -> paths drawn in it, for each line chart that is on screen with a size."""
    from selenium.webdriver.common.by import By

    found = {}
    for fig in driver.find_elements(By.CSS_SELECTOR, "figure[data-chart] svg.chart"):
        box = fig.rect
        paths = [p for p in fig.find_elements(By.TAG_NAME, "path") if len(p.get_attribute("d") or "") > 3]
        key = fig.find_element(By.XPATH, "..").get_attribute("data-chart")
        assert box["width"] > 100 and box["height"] > 100, key
        found[key] = len(paths)
    return found


def test_one_run_in_chromium(runs, browser, tmp_path):
    from selenium.webdriver.common.by import By

    page, shot = runs / "a" / "report.html", tmp_path / "one.png"
    check_loaded(open_page(browser, page, shot), page, shot)
    charts = drawn_charts(browser)
    assert {"loss", "lr", "grad_norm", "throughput", "memory"} <= set(charts), charts
    assert charts["loss"] >= 2 and all(n >= 1 for n in charts.values())  # train and validation loss
    cells = browser.find_elements(By.CSS_SELECTOR, "figure[data-chart=confusion] svg rect")
    assert len(cells) == 4 and all(c.rect["width"] > 10 for c in cells)
    evaluations = browser.find_element(By.XPATH, "//h3[text()='Evaluations']/following-sibling::table")
    assert evaluations.text.count("validation") == 3 and "test" in evaluations.text  # steps 2, 4, 6


def test_two_runs_compared_in_chromium(runs, browser, tmp_path):
    from selenium.webdriver.common.by import By

    page = tmp_path / "compare.html"
    result = run_cli("report", runs / "a", runs / "b", "--out", page)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compare-curves.png", "compare.html"]
    assert (tmp_path / "compare-curves.png").read_bytes()[:4] == b"\x89PNG"
    shot = tmp_path / "two.png"
    check_loaded(open_page(browser, page, shot), page, shot)
    charts = drawn_charts(browser)
    assert charts["loss"] >= 4 and charts["lr"] == 2, charts  # each run's curves, overlaid
    differs = browser.find_element(By.XPATH, "//h3[text()='What differs']/following-sibling::table").text
    assert "lr" in differs and "batch_size" in differs and "output_dir" not in differs
    assert "samples/s" in differs and "peak memory" in differs and "test accuracy" in differs
    assert len(browser.find_elements(By.CSS_SELECTOR, "section.run")) == 2


# --- reading runs, in process ----------------------------------------------------------------------

def copy_run(source: Path, target: Path, keep=("config.yaml", "log.jsonl", "metrics.json", run_folder.MARKER)) -> Path:
    target.mkdir()
    for name in keep:
        shutil.copy(source / name, target / name)
    return target


def test_a_killed_run_is_reported_as_far_as_it_got(runs, tmp_path):
    killed = copy_run(runs / "a", tmp_path / "killed", keep=("config.yaml", "log.jsonl", run_folder.MARKER))
    lines = (killed / "log.jsonl").read_text().splitlines()
    (killed / "log.jsonl").write_text("\n".join(lines[:5]) + "\n" + lines[5][:20])  # killed mid-line
    (killed / run_folder.LOCK).write_text(json.dumps({"pid": 2**22 + 12345, "host": socket.gethostname()}))
    run = report_runs.read_run(killed)
    assert run.status == "stopped" and run.steps and run.final("steps") == run.steps[-1]["step"]
    assert any("stopped before it ended" in note for note in run.notes)
    assert any("1 line(s) of log.jsonl could not be read" in note for note in run.notes)
    assert "stopped" in report_page.render([run])


def test_a_run_still_training_and_one_without_evaluations(runs, tmp_path):
    live = copy_run(runs / "a", tmp_path / "live", keep=("config.yaml", run_folder.MARKER))
    (live / "log.jsonl").write_text(json.dumps({"step": 1, "epoch": 0.1, "loss": 0.7, "lr": 1e-3}) + "\n")
    (live / run_folder.LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    run = report_runs.read_run(live)
    assert run.status == "training" and any("still training" in note for note in run.notes)
    assert any("no evaluation logged yet" in note for note in run.notes)
    page = report_page.render([run])
    assert "(training)" in page and "Evaluations" not in page


def test_a_resumed_log_keeps_the_later_record_of_a_step(tmp_path):
    run_dir = tmp_path / "resumed"
    run_dir.mkdir()
    records = [{"step": 1, "loss": 0.9, "lr": 1}, {"step": 2, "loss": 0.8, "lr": 1}, {"step": 2, "loss": 0.5, "lr": 1},
               {"step": 2, "split": "validation", "loss": 0.7}, {"step": 0, "memory_plan": "m", "pieces": 1}]
    (run_dir / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run = report_runs.read_run(run_dir)
    assert [r["loss"] for r in run.steps] == [0.9, 0.5] and len(run.evals) == 1 and len(run.events) == 1


def test_differences_hold_only_what_differs(runs):
    a, b = report_runs.find_runs([str(runs / "a"), str(runs / "b")])
    header, rows = report_page.differences([a, b])
    assert header == ["", "a", "b"]
    table = {row[0]: row[1:] for row in rows}
    assert table["lr"] == ["0.001", "0.0005"] and table["batch_size"] == ["16", "8"]
    assert "output_dir" not in table and "model" not in table and "seed" not in table  # same, or no setting
    assert "plan.grad_accum" not in table and "max_steps" not in table
    assert table["steps"] == ["6", "6"] and table["test accuracy"][0] == svg.number(a.metrics["test"]["accuracy"])
    assert table["peak memory"][1].endswith("x)") and "x)" not in table["peak memory"][0]  # ratio to the first


def fake_run(folder: Path, config: dict, accuracy: float, layers: int, parameters: int, weight_bytes: int) -> Path:
    """A finished classification run's files, written by hand: config, metrics and a model/ of a known size."""
    import yaml

    (folder / "model").mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"task": "sequence-classification", "model": "default",
                                                        **config}))
    (folder / "metrics.json").write_text(json.dumps({"task": "sequence-classification", "steps": 4,
                                                     "test": {"accuracy": accuracy, "loss": 0.1},
                                                     "parameters": {"total": parameters, "trainable": parameters},
                                                     "train_samples_per_second": 100.0 * 6 / layers}))
    model_config = json.dumps({"architectures": ["BertForSequenceClassification"], "num_hidden_layers": layers})
    (folder / "model" / "config.json").write_text(model_config)
    (folder / "model" / "model.safetensors").write_bytes(b"\0" * (weight_bytes - len(model_config)))
    return folder


def test_a_distilled_student_is_shown_beside_its_teacher_and_the_student_alone(tmp_path):
    teacher = fake_run(tmp_path / "teacher", {}, 0.99, 6, 22_000_000, 88 * 2**20)
    student = fake_run(tmp_path / "student", {"distill_from": str(teacher / "model"), "student_layers": 3,
                                              "distill_alpha": 0.5, "distill_temperature": 2.0},
                       0.985, 3, 17_000_000, 66 * 2**20)
    alone = fake_run(tmp_path / "alone", {"student_layers": 3}, 0.98, 3, 17_000_000, 66 * 2**20)
    other = fake_run(tmp_path / "other", {"student_layers": 2}, 0.9, 2, 15_000_000, 60 * 2**20)  # not that student
    found = report_runs.find_runs([str(p) for p in (alone, student, other, teacher)])
    [pair] = report_runs.distilled_pairs(found)
    assert (pair.teacher.name, pair.student.name, [r.name for r in pair.alone]) == ("teacher", "student", ["alone"])
    header, rows = report_page.distillation_table(pair)
    assert header == ["", "teacher: teacher", "distilled student: student", "student alone: alone"]
    table = {row[0]: row[1:] for row in rows}
    assert table["test accuracy"] == ["0.99", "0.985", "0.98"]
    assert table["layers"] == ["6", "3 (0.50x)", "3 (0.50x)"]
    assert table["model/ size"] == ["88 MiB", "66 MiB (0.75x)", "66 MiB (0.75x)"]
    assert table["parameters"][1] == "17,000,000 (0.77x)" and table["training samples/s"][1] == "200 (2.00x)"
    assert table["distillation"] == ["-", "alpha 0.5, T 2.0, 3 layers kept", "-"]
    page = report_page.render(found)
    assert page.count("Teacher and distilled student") == 1 and "distilled student: student" in page
    # Without its teacher among the runs given, nothing is paired.
    assert report_runs.distilled_pairs([r for r in found if r.name != "teacher"]) == []


def test_find_runs_expands_a_bench_and_reports_a_run_once(runs, tmp_path, capsys):
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / run_folder.MARKER).write_text('{"kind": "bench"}')
    for when, name in enumerate(("grad-accum", "baseline")):
        copy_run(runs / "a", bench / name)
        os.utime(bench / name / run_folder.MARKER, (1e9 + when, 1e9 + when))
    assert [r.name for r in report_runs.find_runs([str(bench)])] == ["grad-accum", "baseline"]  # the order they ran in
    (bench / "bench.json").write_text(json.dumps({"variants": [{"name": "baseline"}, {"name": "grad-accum"}]}))
    assert [r.name for r in report_runs.find_runs([str(bench)])] == ["baseline", "grad-accum"]  # bench.json's
    assert len(report_runs.find_runs([str(runs / "a"), str(runs / "a") + "/"])) == 1
    assert "given more than once" in capsys.readouterr().out


def test_runs_of_different_tasks_and_things_that_are_not_runs_are_refused(runs, tmp_path):
    lm = copy_run(runs / "a", tmp_path / "lm")
    (lm / "config.yaml").write_text((lm / "config.yaml").read_text().replace(
        "task: sequence-classification", "task: causal-lm"))
    with pytest.raises(UserError, match="different tasks"):
        report_runs.find_runs([str(runs / "a"), str(lm)])
    (tmp_path / "empty").mkdir()
    for given, needle in ((tmp_path / "empty", "is not an effitrain run"), (tmp_path / "nope", "does not exist"),
                          (runs / "a" / "metrics.json", "is a file, not a run folder; fix: pass its folder"),
                          (runs / "a" / "model", f"fix: pass the run's folder: effitrain report {runs / 'a'}")):
        with pytest.raises(UserError, match=needle.replace("(", r"\(")):
            report_runs.find_runs([str(given)])


def test_out_is_checked_before_anything_is_written(runs, tmp_path):
    a = str(runs / "a")
    report_page.check_page(runs / "a" / "report.html", [a])  # the run's own page, written again
    for out, needle in ((runs / "b" / "report.html", "is inside the effitrain run"),
                        (runs / "a" / "mine.html", "is inside the effitrain run"),
                        (runs / "a" / "model" / "r.html", "is inside the effitrain run"),
                        (tmp_path, "is a folder"), (tmp_path / "r.txt", "does not end in .html"),
                        (tmp_path / "no" / "r.html", "no folder")):
        with pytest.raises(UserError, match=needle):
            report_page.check_page(out, [a])
    (tmp_path / "notes.html").write_text("<p>mine</p>")
    with pytest.raises(UserError, match="already exists and is not an effitrain report"):
        report_page.check_page(tmp_path / "notes.html", [a])
    (tmp_path / "r-curves.png").write_bytes(b"\x89PNG mine")
    with pytest.raises(UserError, match="r-curves.png already exists"):
        report_page.check_page(tmp_path / "r.html", [a])


def test_pngs_are_written_beside_the_page_and_replaced_next_time(runs, tmp_path):
    out = tmp_path / "one.html"
    page, pngs = report_page.write([str(runs / "a")], str(out))
    assert page == out and sorted(p.name for p in pngs) == ["one-confusion.png", "one-curves.png"]
    assert all(report_page.written_by_report(p) for p in (out, *pngs))
    assert report_page.write([str(runs / "a")], str(out))[0] == out  # its own files: replaced


def test_a_report_that_fails_is_a_warning_not_a_failed_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.yaml").write_text("task: sequence-classification\n")

    def broken(*args, **kwargs):
        raise ValueError("no room\nfor this")

    monkeypatch.setattr(report_page, "render", broken)
    report_page.write_for_run(tmp_path)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "warning: no report" in err and "no room for this" in err
    assert not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("lo, hi, ticks", [(0, 1, [0, 0.2, 0.4, 0.6, 0.8, 1.0]), (3, 3, [2.6, 2.8, 3.0, 3.2, 3.4]),
                                           (0.682, 0.695, [0.68, 0.685, 0.69, 0.695]),
                                           (0, 0.012, [0, 0.0025, 0.005, 0.0075, 0.01, 0.0125]),
                                           (1e-6, 5e-6, [1e-6, 2e-6, 3e-6, 4e-6, 5e-6]),
                                           (0.6926, 0.6931, [0.6926, 0.6927, 0.6928, 0.6929, 0.693, 0.6931])])
def test_ticks_are_round_and_cover_the_values(lo, hi, ticks):
    assert svg.nice_ticks(lo, hi) == pytest.approx(ticks)
    step = ticks[1] - ticks[0]
    assert len({svg.tick_text(t, step) for t in ticks}) == len(ticks)  # no two labels alike


def test_long_logs_are_thinned_and_a_broken_matrix_is_left_out(tmp_path):
    records = [{"step": i, "loss": 1 / i, "lr": 1e-3} for i in range(1, 5002)]
    points = svg.curve(records, "loss")
    assert len(points) <= svg.MAX_POINTS + 1 and points[0][0] == 1 and points[-1][0] == 5001
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    (tmp_path / "metrics.json").write_text(json.dumps({"labels": ["a", "b"], "test": {"accuracy": 1.0},
                                                       "test_confusion_matrix": {"labels": ["a", "b"], "counts": [[1]]}}))
    run = report_runs.read_run(tmp_path)
    assert any("no confusion matrix" in note for note in run.notes) and 'data-chart="confusion"' not in report_page.render([run])
