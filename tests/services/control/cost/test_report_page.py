"""The run report page: built from a run recorded through the real API and state store, opened in
real headless Chromium (tests/servers/chromium.py), whose rendered DOM holds every point, bar and
preemption mark, and whose screenshot shows each figure's data in its colours."""

from __future__ import annotations

import json
import re
from html import escape
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from contracts.evaluation import EvalResult
from contracts.status import RunStatus
from services.cli.main import app as cli
from services.control.cost import report_page
from services.control.cost.lower_bound import LOWER_BOUND_DEFINITION
from services.control.cost.svg_charts import MARK_COLOR
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_store import StateStore
from tests.iteration_rows import iteration_row
from tests.servers.chromium import ensure_chromium, headless

# The run's record, in seconds from its start: rollout slot 0 on spot is preempted at 300 s and
# relaunched at 360 s; slot 1 falls back to on-demand for a while; three training jobs, one per iteration.
WALL = 1000.0
ROLLOUT = [
    ("rollout-0", "spot", 0, 300, "preempted"),
    ("rollout-0", "spot", 360, 1000, "killed"),
    ("rollout-1", "spot", 0, 450, "preempted"),
    ("rollout-1", "on-demand", 470, 1000, "killed"),
]
TRAINING = [
    ("train-1", "on-demand", 200, 320, "succeeded"),
    ("train-2", "on-demand", 500, 620, "succeeded"),
    ("train-3", "on-demand", 800, 920, "succeeded"),
]
REWARDS = [0.2, 0.45, 0.7]
# The held-out evals of the base model and of v2: mean score and pass@2, dashed beside the reward.
EVALS = {0: {"mean": 0.1, "pass@2": 0.3}, 2: {"mean": 0.5, "pass@2": 0.8}}
# Where the cost curves bend: the run's start and end, every pod's start and end, and, from each
# start, a millisecond on (its billing minimum owed) and a minute on (the minimum used up).
STARTS = {0, 360, 470, 200, 500, 800}
INSTANTS = {*STARTS, 300, 1000, 450, 320, 620, 920} | {t + 1e-3 for t in STARTS} | {t + 60 for t in STARTS}
HOSTILE_NAME = "<script>alert('name')</script>"
SPEC = {
    "model": "tiny",
    "name": HOSTILE_NAME,
    "prompts": [{"prompt": "<img src=x onerror=alert(1)>", "answer": "5"}],
    "batch_samples": 8,
    "iterations": 3,
}
WINDOW = (1000, 1500)


def record_run(
    state: StateStore, catalog: PriceCatalog, run_id: str, *, rollout_instance: str, training_instance: str
) -> None:
    """What the scheduler would have written for the run above, through the state store's API."""
    state.set_status(run_id, RunStatus.RUNNING)
    t0 = state.get_run(run_id).started_at - 2 * WALL  # in the past: nothing of it is "now"
    for entries, role, instance in ((ROLLOUT, "rollout", rollout_instance), (TRAINING, "training", training_instance)):
        for pod, capacity, start, end, outcome in entries:
            state.open_ledger(
                run_id=run_id,
                role=role,
                pod=f"{run_id}-{pod}",
                instance_type=instance,
                capacity_type=capacity,
                price_per_hour=catalog.get(instance).price(capacity),
                price_source="test",
                started_at=t0 + start,
            )
            state.close_ledger(f"{run_id}-{pod}", ended_at=t0 + end, outcome=outcome)
    for i, reward in enumerate(REWARDS, start=1):
        state.record_iteration(
            iteration_row(
                run_id,
                i,
                mean_reward=reward,
                seconds=120.0,
                ended_at=t0 + TRAINING[i - 1][3],
            )
        )
    for version, metrics in EVALS.items():
        state.record_eval(
            run_id,
            EvalResult(
                policy_version=version,
                mean_score=metrics["mean"],
                metrics=metrics,
                prompts=4,
                samples=8,
                seconds=30.0,
                ended_at=t0 + 100 * (version + 1),
            ),
        )
    state.begin_ending(run_id, RunStatus.SUCCEEDED, "reached its iterations")
    state.set_status(run_id, RunStatus.SUCCEEDED)
    state.update_run(run_id, started_at=t0, ended_at=t0 + WALL)


class Figures(HTMLParser):
    """The elements inside each <figure id=...> of a page: figure id -> [(tag, attributes)]."""

    def __init__(self, page: str) -> None:
        super().__init__()
        self.elements: dict[str, list[tuple[str, dict[str, str]]]] = {}
        self._figure: str | None = None
        self.feed(page)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "figure":
            self._figure = a["id"]
            self.elements[self._figure] = []
        elif self._figure is not None:
            self.elements[self._figure].append((tag, a))

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._figure = None

    def count(self, figure: str, tag: str, css: str | None = None) -> int:
        return sum(
            1 for t, a in self.elements[figure] if t == tag and (css is None or css in a.get("class", "").split())
        )

    def series_points(self, figure: str) -> dict[str, int]:
        return {
            a["data-series"]: int(a["data-points"]) for t, a in self.elements[figure] if t == "g" and "data-series" in a
        }


@pytest.fixture
async def report(api: httpx.AsyncClient, tmp_path: Path) -> tuple[str, str, Path]:
    """(run id, the page GET /v1/runs/{id}/report returned, the home of the run's stores)."""
    run = (await api.post("/v1/runs", json=SPEC)).json()
    app = api.app  # type: ignore[attr-defined]
    record_run(
        app.state.backends.state,
        app.state.catalog,
        run["id"],
        rollout_instance=run["spec"]["rollout"]["instance_type"],
        training_instance=run["spec"]["training"]["instance_type"],
    )
    assert (await api.get(f"/v1/runs/{run['id']}")).json()["report_url"] == f"/v1/runs/{run['id']}/report"
    r = await api.get(f"/v1/runs/{run['id']}/report")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == report_page.CSP
    return run["id"], r.text, tmp_path / "home"


def rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def pixels_of(image: Image.Image, box: tuple[int, int, int, int], color: str | None = None) -> int:
    """Pixels in ``box`` of ``color`` (within a little antialiasing), or not white when None."""
    region = np.asarray(image.crop(box).convert("RGB"), dtype=np.int16)
    if color is None:
        return int((region != 255).any(axis=-1).sum())
    return int((np.abs(region - np.array(rgb(color))) <= 24).all(axis=-1).sum())


def test_the_page_holds_the_run_and_nothing_a_client_wrote(report) -> None:
    run_id, page, _ = report
    for client_text in ("alert", "<script", "onerror", "<img"):
        assert client_text not in page
    assert run_id in page
    # Offline: nothing to fetch (the one URL is the SVG namespace, a name, not a resource).
    for fetch in ("src=", "href=", "url(", "@import", "<link", "<script"):
        assert fetch not in page
    assert page.count("://") == page.count('xmlns="http://www.w3.org/2000/svg"') == 4


def test_the_cost_chart_names_its_axes_once_and_tells_spent_from_training(report) -> None:
    _, page, _ = report
    cost = page[page.index('<figure id="cost">') : page.index("</figure>", page.index('<figure id="cost">'))]
    labels = re.findall(r'<text class="label"[^>]*>([^<]*)</text>', cost)
    assert [label for label in labels if "USD" in label] == ["cost (USD)"]  # the y axis, once
    assert report_page.TIME_LABEL in labels  # the x axis
    legend = {
        label: (color, dash)
        for color, dash, label in re.findall(
            r'<g class="legend-item"><line [^>]*stroke="(#\w+)" stroke-width="3"(?: stroke-dasharray="([^"]*)")?/>'
            r"<text[^>]*>([^<]*)</text></g>",
            cost,
        )
    }
    assert set(legend) == {
        "rollout spot",
        "rollout on-demand",
        "training on-demand",
        "spent",
        "always-on on-demand",
        "lower bound",
    }
    spent, training = legend["spent"], legend["training on-demand"]
    assert spent == (report_page.SPENT_COLOR, report_page.SPENT_DASH)
    assert spent[0] != training[0] and spent[1] != training[1]  # another colour and another dash
    assert len(set(legend.values())) == len(legend)  # no two lines drawn alike
    for note in (report_page.SAVINGS_NOTE, LOWER_BOUND_DEFINITION):
        assert f'<p class="note">{escape(note)}</p>' in page


def test_chromium_renders_every_figure(report, tmp_path: Path) -> None:
    _, page, _ = report
    # One Chromium start for the rendered DOM and the screenshot, of a copy of the page with a
    # probe script that measures the figures' boxes (the page has no script, and its policy,
    # kept here, would block one); the probe writes an attribute and changes nothing drawn.
    probe = tmp_path / "probe.html"
    script = (
        "<script>document.body.dataset.boxes = JSON.stringify([...document.querySelectorAll('figure svg')]"
        ".map(s => { const r = s.getBoundingClientRect(); return [s.parentNode.id, r.left, r.top, r.right, r.bottom]; }));</script>"
    )
    probe.write_text(
        page.replace(report_page.CSP, report_page.CSP + "; script-src 'unsafe-inline'").replace(
            "</body>", script + "</body>"
        )
    )
    shot = tmp_path / "report.png"
    dom = headless(
        ensure_chromium(),
        probe.as_uri(),
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        "--force-device-scale-factor=1",
        f"--screenshot={shot}",
        "--dump-dom",
    ).stdout

    figures = Figures(dom)
    assert list(figures.elements) == ["reward", "cost", "rollout-timeline", "training-timeline"]
    assert figures.count("reward", "circle", "point") == len(REWARDS) + 2 * len(EVALS)
    assert figures.series_points("reward") == {
        "mean reward": len(REWARDS),
        "held-out mean": len(EVALS),
        "held-out pass@2": len(EVALS),
    }
    # A line per (role, capacity type), spent, always-on and the lower bound, each bending at every instant.
    assert figures.series_points("cost") == dict.fromkeys(
        ["rollout spot", "rollout on-demand", "training on-demand", "spent", "always-on on-demand", "lower bound"],
        len(INSTANTS),
    )
    assert figures.count("rollout-timeline", "rect", "bar") == len(ROLLOUT)
    assert figures.count("rollout-timeline", "rect", "spot") == 3
    assert figures.count("rollout-timeline", "path", "mark") == 2  # the two preemptions
    assert figures.count("training-timeline", "rect", "bar") == len(TRAINING)
    assert figures.count("training-timeline", "path", "mark") == 0

    boxes = {fid: tuple(round(v) for v in box) for fid, *box in json.loads(_body_attribute(dom, "data-boxes"))}
    image = Image.open(shot)
    assert image.size == WINDOW
    assert all(box[3] <= WINDOW[1] for box in boxes.values()), boxes  # every figure within the screenshot
    for fid, box in boxes.items():
        assert pixels_of(image, box) > 0.01 * (box[2] - box[0]) * (box[3] - box[1]), fid  # not blank
    assert pixels_of(image, boxes["reward"], report_page.REWARD_COLOR) > 300
    assert pixels_of(image, boxes["reward"], report_page.EVAL_COLORS[0]) > 100
    assert pixels_of(image, boxes["cost"], report_page.ALWAYS_ON_COLOR) > 200
    assert pixels_of(image, boxes["cost"], report_page.LOWER_BOUND_COLOR) > 200
    assert pixels_of(image, boxes["rollout-timeline"], report_page.CAPACITY_COLORS["spot"]) > 2000
    assert pixels_of(image, boxes["rollout-timeline"], MARK_COLOR) > 30
    assert pixels_of(image, boxes["training-timeline"], report_page.CAPACITY_COLORS["on-demand"]) > 500


def _body_attribute(dom: str, name: str) -> str:
    class Body(HTMLParser):
        value = ""

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "body":
                self.value = dict(attrs).get(name) or ""

    body = Body()
    body.feed(dom)
    assert body.value, f"the probe script wrote no {name}: {dom[:500]}"
    return body.value


def test_spotrl_report_writes_the_page_the_api_serves(report, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_id, page, home = report
    monkeypatch.setenv("SPOTRL_HOME", str(home))  # `--home` sets it: restored after the test
    out = tmp_path / "cli.html"
    r = CliRunner().invoke(cli, ["report", run_id, "--out", str(out), "--home", str(home)])
    assert r.exit_code == 0, r.output
    assert r.stdout.strip() == str(out)
    assert out.read_text(encoding="utf-8") == page  # the run has ended: its page no longer changes
    r = CliRunner().invoke(cli, ["report", "run-0123456789", "--home", str(home)])
    assert r.exit_code == 2 and "no run 'run-0123456789'" in r.output


async def test_the_openapi_document_lists_the_page(api: httpx.AsyncClient) -> None:
    operation = (await api.get("/openapi.json")).json()["paths"]["/v1/runs/{run_id}/report"]["get"]
    assert list(operation["responses"]["200"]["content"]) == ["text/html"]
    for error in ("401", "404"):  # JSON, like every error
        assert list(operation["responses"][error]["content"]) == ["application/json"]
    run = (await api.get("/openapi.json")).json()["components"]["schemas"]["RunPublic"]
    assert "report_url" in run["required"]
