"""What online RL's metrics become (issue 43 item 6): one tiny `train --rl grpo` run (a Llama from a config on the
built-in addition prompts, two reward functions) whose report.html holds the reward curve at the logged values
(read back from the SVG's own axis ticks) and each step's generation/update split, whose tracker holds every RL
metric of log.jsonl (TensorBoard; the others get the same records through tracking.scalars), and whose model card
states the RL settings and the final reward; then the split's arithmetic on hand-made logs, and a non-RL log that
shows none of it."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ElementTree

import effitrain
import pytest
from effitrain.report import page as report_page
from effitrain.report import runs as report_runs
from effitrain.report import svg
from test_report import browser, check_loaded, drawn_charts, open_page  # noqa: F401 (browser: a fixture)
from test_tracking import tensorboard_scalars

from conftest import read_jsonl

TINY_LLAMA = ("llama:hidden_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2,"
              "intermediate_size=64,max_position_embeddings=64")
# A reward with spread on a random model: the parity of the first token, plus the length.
REWARD = '''
def parity(prompts, completions, completion_ids, **kwargs):
    return [float(ids[0] % 2) + len(ids) / 10 for ids in completion_ids]
'''
RL_METRICS = ("reward", "reward_parity", "reward_exact-match", "zero_spread_share", "completion_length",
              "truncated_share", "generation_seconds", "clip_ratio", "kl")  # kl: with --kl-beta


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl-outputs")
    (root / "rewards.py").write_text(REWARD)
    out = root / "run"
    effitrain.train(dict(model=TINY_LLAMA, task="causal-lm", data="addition", rl="grpo", max_steps=3,
                         max_train_samples=64, max_eval_samples=16, num_generations=2, max_new_tokens=4,
                         batch_size=8, log_every=1, eval_every=2, lr=2e-3, kl_beta=0.04, warmup_ratio=0.0,
                         precision="fp32",
                         reward=[f"{root / 'rewards.py'}:parity", "exact-match"], reward_weights=[1.0, 0.5],
                         report_to="tensorboard", output_dir=str(out)))
    return out


def steps_of(run_dir) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "log.jsonl") if "split" not in r and "lr" in r]


def figure_svg(page: str, chart: str) -> ElementTree.Element:
    """The <svg> of the page's figure data-chart=`chart`, as XML."""
    found = re.search(rf'<figure data-chart="{chart}">.*?(<svg.*?</svg>)', page)
    assert found, chart
    return ElementTree.fromstring(found.group(1))


def y_axis(drawn: ElementTree.Element):
    """Pixel -> value from the chart's own y tick labels (the texts right-aligned left of the plot)."""
    ticks = [(float(t.get("y")) - 4, float(t.text)) for t in drawn.iter("text") if t.get("text-anchor") == "end"]
    (y0, v0), (y1, v1) = ticks[0], ticks[-1]
    return lambda y: v0 + (y - y0) * (v1 - v0) / (y1 - y0), abs((v1 - v0) / (y1 - y0))


def test_the_page_holds_the_reward_curve_at_the_logged_values(rl_run):
    steps = steps_of(rl_run)
    validation = [r for r in read_jsonl(rl_run / "log.jsonl") if r.get("split") == "validation"]
    assert [r["step"] for r in steps] == [1, 2, 3] and [r["step"] for r in validation] == [2, 3]
    assert all(r["reward"] == pytest.approx(r["reward_parity"] + 0.5 * r["reward_exact-match"]) for r in steps)
    assert len({r["reward"] for r in steps}) > 1 or steps[0]["reward"] > 0  # a curve with something to show
    page = (rl_run / "report.html").read_text()
    assert "Reward (train: sampled, weighted; validation: greedy)" in page
    drawn = figure_svg(page, "reward")
    value_at, per_pixel = y_axis(drawn)
    lines = [[tuple(map(float, xy.split(","))) for xy in re.findall(r"[\d.]+,[\d.]+", p.get("d"))]
             for p in drawn.iter("path")]
    assert len(lines) == 4  # train, validation, then each reward function's train line
    for line, records, key in ((lines[0], steps, "reward"), (lines[1], validation, "reward"),
                               (lines[2], steps, "reward_parity"), (lines[3], steps, "reward_exact-match")):
        assert [value_at(y) for _, y in line] == pytest.approx([r[key] for r in records], abs=0.06 * per_pixel), key
    circles = [c.find("title").text for c in drawn.iter("circle")]
    assert circles == [f"validation reward, step {r['step']}: {svg.number(r['reward'])}" for r in validation]


def test_the_page_splits_each_step_into_generation_and_update(rl_run):
    steps = steps_of(rl_run)
    page = (rl_run / "report.html").read_text()
    bars = list(figure_svg(page, "step-split").iter("g"))
    assert [int(b.get("data-step")) for b in bars] == [1, 2, 3]
    previous = 0.0
    for bar, record in zip(bars, steps):
        step_seconds = record["elapsed_seconds"] - previous  # one step per window (--log-every 1)
        previous = record["elapsed_seconds"]
        assert float(bar.get("data-generation")) == record["generation_seconds"]
        assert float(bar.get("data-update")) == pytest.approx(step_seconds - record["generation_seconds"], abs=1e-12)
        assert 0 < record["generation_seconds"] < step_seconds
        heights = [float(rect.get("height")) for rect in bar.iter("rect")]
        assert len(heights) == 2 and heights[1] / heights[0] == pytest.approx(
            float(bar.get("data-update")) / record["generation_seconds"], rel=0.05)  # stacked: drawn to scale
    generation = sum(r["generation_seconds"] for r in steps)
    total = steps[-1]["elapsed_seconds"]
    assert f"<td>generation</td><td>{svg.number(generation / 3, 3)}</td><td>{svg.number(generation, 3)}</td>" \
           f"<td>{generation / total:.1%}</td>" in page
    assert f"({generation / total:.0%} generating)" in page


def test_the_summary_states_the_rl_settings_and_the_last_reward(rl_run):
    page = (rl_run / "report.html").read_text()
    said = ("grpo, 2 completions per prompt of at most 4 tokens at temperature 1, dapo loss, rewards scaled by "
            f"group, clip 0.2, KL beta 0.04; rewards {rl_run.parent / 'rewards.py'}:parity x 1, exact-match x 0.5")
    assert f"<td>online RL</td><td>{said}</td>" in page
    last = steps_of(rl_run)[-1]["reward"]
    assert f"<td>train reward (last window)</td><td>{svg.number(last)}</td>" in page
    metrics = json.loads((rl_run / "metrics.json").read_text())
    assert metrics["train_metrics"] == {k: v for k, v in steps_of(rl_run)[-1].items() if k in RL_METRICS}


def test_the_trackers_hold_every_rl_metric(rl_run):
    want: dict[str, dict[int, float]] = {}
    for record in read_jsonl(rl_run / "log.jsonl"):
        split = record.get("split") or "train"
        names = RL_METRICS if split == "train" else [k for k in record if k not in ("step", "epoch", "split")]
        for name in names:
            want.setdefault(f"{split}/{name}", {})[record["step"]] = record[name]
    assert {f"train/{name}" for name in RL_METRICS} <= set(want) and "validation/reward" in want
    got = tensorboard_scalars(rl_run)
    for tag, values in want.items():
        assert dict(got[tag]) == pytest.approx(values, rel=1e-6, abs=1e-12), tag  # event files hold float32


def test_the_model_card_states_the_rl_settings_and_the_final_reward(rl_run):
    card = (rl_run / "model" / "README.md").read_text()
    metrics = json.loads((rl_run / "metrics.json").read_text())
    assert "online RL: grpo, 2 completions per prompt of at most 4 tokens at temperature 1, dapo loss, rewards " \
           f"scaled by group, clip 0.2, KL beta 0.04; rewards `{rl_run.parent / 'rewards.py'}:parity` x 1, " \
           "`exact-match` x 0.5" in card
    assert (f"Final reward (weighted): {steps_of(rl_run)[-1]['reward']:.4f} on the last logged window's sampled "
            f"completions, {metrics['validation']['reward']:.4f} greedy on the validation prompts, "
            f"{metrics['test']['reward']:.4f} greedy on the test prompts.") in card


def test_the_rl_page_in_chromium(rl_run, browser, tmp_path):  # noqa: F811 (the fixture)
    from selenium.webdriver.common.by import By

    page, shot = rl_run / "report.html", tmp_path / "rl.png"
    check_loaded(open_page(browser, page, shot), page, shot)
    charts = drawn_charts(browser)
    assert charts["reward"] == 4, charts  # the weighted reward (train, validation) and each function's
    bars = browser.find_elements(By.CSS_SELECTOR, "figure[data-chart=step-split] svg.split g rect")
    assert len(bars) == 6 and all(bar.rect["width"] > 20 and bar.rect["height"] > 0 for bar in bars)
    # generation (drawn first) sits on the axis, its update right above it
    for generation, update in zip(bars[::2], bars[1::2]):
        assert update.rect["y"] + update.rect["height"] == pytest.approx(generation.rect["y"], abs=1.5)


# --- the split's arithmetic, and what a run without RL shows ------------------------------------------

def test_windows_of_several_steps_and_a_skipped_window(tmp_path):
    """--log-every 2: a window's seconds per step is its training seconds over its steps; a window whose
    steps were all skipped logs no generation_seconds and only moves the start of the next."""
    records = [{"step": 2, "lr": 1, "loss": 0.1, "reward": 0.5, "generation_seconds": 0.25, "elapsed_seconds": 1.0},
               {"step": 4, "lr": 1, "loss": None, "reward": None, "generation_seconds": None, "elapsed_seconds": 1.5},
               {"step": 6, "lr": 1, "loss": 0.2, "reward": 0.7, "generation_seconds": 0.5, "elapsed_seconds": 3.5},
               {"step": 7, "lr": 1, "loss": 0.2, "reward": 0.9, "generation_seconds": 0.5, "elapsed_seconds": 4.0}]
    splits = report_runs.step_splits(records)
    assert [(s.step, s.steps, s.generation, s.update) for s in splits] == [(2, 2, 0.25, 0.25), (6, 2, 0.5, 0.5),
                                                                             (7, 1, 0.5, 0.0)]
    [merged] = report_runs.merged_splits(splits, 1)
    assert (merged.step, merged.steps) == (7, 5)
    assert merged.generation == pytest.approx((0.25 * 2 + 0.5 * 2 + 0.5) / 5)
    assert merged.update == pytest.approx((0.25 * 2 + 0.5 * 2) / 5)
    assert len(report_runs.merged_splits(splits * 100, svg.MAX_BARS)) <= svg.MAX_BARS
    (tmp_path / "config.yaml").write_text("task: causal-lm\nrl: grpo\n")
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = report_page.render(report_runs.find_runs([str(tmp_path)]))
    assert "<td>generation</td><td>0.4</td><td>2</td><td>57.1%</td>" in page  # 2 s of the 3.5 s of 5 steps counted


def test_a_run_without_rl_shows_none_of_it(tmp_path):
    """DPO's log has reward_* columns of its own: no reward chart, no split, no RL row."""
    (tmp_path / "config.yaml").write_text("task: causal-lm\npreference: dpo\n")
    records = [{"step": s, "lr": 1e-4, "loss": 0.69, "rewards_chosen": 0.01 * s, "reward_margin": 0.02 * s,
                "elapsed_seconds": 0.3 * s} for s in (1, 2)]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    [run] = report_runs.find_runs([str(tmp_path)])
    assert not run.is_rl and run.reward_functions() == [] and report_runs.step_splits(run.steps) == []
    page = report_page.render([run])
    assert 'data-chart="reward"' not in page and "step-split" not in page and "online RL" not in page
    assert "train reward" not in page and 'data-chart="loss"' in page
