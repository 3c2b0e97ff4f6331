"""Every panel query of every Grafana dashboard returns data from a real Prometheus scraping a real run.

The test starts `spotrl serve` (API and scheduler, embedded backends), a short run of the tiny
model with one rollout worker killed mid-run (what a spot reclaim looks like to the local
launcher), and Debian's Prometheus scraping the API's /metrics every second. It then runs each
panel's query over the run's time range, the way Grafana would (``$run`` the run,
``$__rate_interval`` 4 s, ``$__range`` the whole span), and fails on any query that Prometheus
refuses or that returns no finite value.

GPU utilization: these machines have no GPU and no DCGM exporter. The series
``DCGM_FI_DEV_GPU_UTIL`` comes from a SMALL TEST EXPORTER in this file (``FakeDcgmExporter``)
that makes up a utilization for each pod the API reports running (``spotrl_pod_info``), with
dcgm-exporter's metric name and labels. It checks the dashboards' join, not any real GPU figure.

No Grafana can be installed here, so no picture of a dashboard: each panel's query result is
drawn as a PNG instead, into ``$SPOTRL_DASHBOARD_PNG_DIR`` or, by default, a ``dashboards/``
folder in the test's temporary directory (the path is printed), for a reviewer to look at.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.ports.launcher.launcher import PodPhase
from services.ports.launcher.local_launcher import LocalLauncher
from tests.servers.process import free_port
from tests.servers.prometheus import Prometheus, ensure_prometheus
from tests.test_end_to_end import Served, served, tiny_spec  # noqa: F401 (served: the fixture)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "deploy" / "helm" / "spotrl" / "dashboards"
SCRAPE_S = 1.0
RATE_INTERVAL = "4s"  # Grafana's $__rate_interval at a 1 s scrape interval: 4 x the interval


class FakeDcgmExporter:
    """A stand-in for NVIDIA's dcgm-exporter, for tests only: ``DCGM_FI_DEV_GPU_UTIL`` for one
    made-up GPU per pod that the API's /metrics lists as running (``spotrl_pod_info``), with
    dcgm-exporter's labels (gpu, UUID, modelName, Hostname, pod, namespace, container). The
    utilization is invented (rollout ~60 %, training ~90 %); only the join is under test."""

    def __init__(self, api: httpx.Client) -> None:
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                body = exporter.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.api = api
        self.text = ""  # what a scrape gets: refreshed from the API in the background, so a scrape never waits on it
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self._threads = [
            threading.Thread(target=self.server.serve_forever, daemon=True),
            threading.Thread(target=self._refresh, daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def _refresh(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(httpx.HTTPError):  # the API is busy or stopping: keep the last answer
                self.text = self.render(self.api.get("/metrics").text)

    @staticmethod
    def render(api_metrics: str) -> str:
        lines = ["# HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).", "# TYPE DCGM_FI_DEV_GPU_UTIL gauge"]
        for family in text_string_to_metric_families(api_metrics):
            if family.name != "spotrl_pod_info":
                continue
            for sample in family.samples:
                pod, role = sample.labels["pod"], sample.labels["role"]
                base = 90.0 if role == "training" else 60.0
                util = base + (sum(map(ord, pod)) + int(time.time())) % 10  # made up, a little movement
                lines.append(
                    f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",UUID="GPU-test-{pod}",modelName="test exporter (no GPU)",'
                    f'Hostname="test",pod="{pod}",namespace="spotrl",container="{role}"}} {util}'
                )
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()


def panel_queries() -> list[tuple[str, dict, dict]]:
    """(dashboard file stem, panel, target) for every target of every dashboard."""
    found = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in board["panels"]:
            for target in panel["targets"]:
                found.append((path.stem, panel, target))
    return found


def as_grafana_would(expr: str, run_id: str, range_s: float) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__range", f"{int(range_s)}s")
    expr = expr.replace("$run", run_id)
    assert "$" not in expr, f"a template variable the test does not know: {expr}"
    return expr


def test_dashboards_are_built_from_the_generator_and_use_the_variables() -> None:
    import runpy

    builder = runpy.run_path(str(ROOT / "deploy" / "grafana" / "build_dashboards.py"))
    assert builder["main"](["--check"]) == 0, "run python deploy/grafana/build_dashboards.py"
    stems = {p.stem for p in DASHBOARDS.glob("*.json")}
    assert stems == {"cost", "utilization", "pipeline", "reward-cache", "training", "spot-preemptions"}
    for stem, panel, target in panel_queries():
        assert panel["datasource"] == target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (
            stem,
            panel["title"],
        )
        assert 'run="$run"' in target["expr"], (stem, panel["title"])  # every query is of the chosen run
    for path in DASHBOARDS.glob("*.json"):
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
        assert variables["run"]["type"] == "query"


def test_every_panel_query_returns_data_from_a_real_run(served: Served, tmp_path: Path) -> None:  # noqa: F811
    prometheus_bin = ensure_prometheus()
    dcgm = FakeDcgmExporter(served.client)
    api_address = str(served.client.base_url).removeprefix("http://").rstrip("/")
    prom = Prometheus(
        prometheus_bin,
        tmp_path / "prometheus",
        free_port(),
        {"spotrl-api": api_address, "dcgm-exporter-test-stand-in": dcgm.address},
        SCRAPE_S,
    )
    try:
        prom.wait_ready()
        started = time.time()
        spec = tiny_spec(
            iterations=1,  # one training job: every training series has a value, and the test stays short
            batch_samples=16,
            rollout={"min_workers": 2, "max_workers": 2, "prompts_per_batch": 1},
            training={
                "learning_rate": 1e-3,
                "micro_batch": 8,
                "entropy_coef": 0.01,
            },  # entropy is reported when it is in the loss
            # Held-out evals of v0 (the baseline) and v1 (the last): the eval panel's series, and the eval pods' path end to end.
            eval={
                "prompts": [{"prompt": "5+5=", "answer": "10"}, {"prompt": "6+6=", "answer": "12"}],
                "samples_per_prompt": 2,
                "max_new_tokens": 4,
                "metrics": ["mean", "pass@2"],
            },
        )
        r = served.client.post("/v1/runs", json=spec)
        assert r.status_code == 201, r.text
        run_id = r.json()["id"]
        victim = _kill_a_worker_once_it_serves(served, run_id)
        run = served.wait_for(run_id, timeout_s=240)
        ended = time.time()
        assert run["status"] == "SUCCEEDED", run["status_reason"]
        # The final state scraped twice (a rate over it needs two samples): two scrapes of the API
        # that began after the run was seen ended, awaited rather than slept for, and the range's
        # last step on or after the second (steps fall on started + k * SCRAPE_S).
        scraped = _api_scraped_after(prom, _api_scraped_after(prom, ended, timeout_s=30), timeout_s=30)
        end = started + math.ceil((scraped - started) / SCRAPE_S) * SCRAPE_S

        out = Path(os.environ.get("SPOTRL_DASHBOARD_PNG_DIR") or tmp_path / "dashboards")
        out.mkdir(parents=True, exist_ok=True)
        results: dict[tuple[str, str], list[tuple[str, list[dict]]]] = {}
        no_data = []
        for stem, panel, target in panel_queries():
            expr = as_grafana_would(target["expr"], run_id, end - started)
            series = prom.query_range(expr, started, end, SCRAPE_S)
            if not any(math.isfinite(float(v)) for s in series for _, v in s["values"]):
                no_data.append(f"{stem} / {panel['title']}: {expr}")
            results.setdefault((stem, panel["title"]), []).append((target.get("legendFormat", ""), series))
        _render(results, out, run_id, started)
        print(f"\npanel query results drawn in {out}")
        if no_data:  # what the scrapes saw, to tell a missing series from failed scrapes
            for expr in (
                "up",
                "scrape_duration_seconds",
                f'{{run="{run_id}", __name__=~"spotrl_reward_cache.*|spotrl_worker_samples.*"}}',
            ):
                for s in prom.query_range(expr, started, end, SCRAPE_S):
                    no_data.append(f"  {s['metric']}: {[v for _, v in s['values']]}")
        assert no_data == [], "panel queries without data:\n" + "\n".join(no_data)

        # The figures a reader looks at first are the right ones.
        def last(expr: str) -> float:
            series = prom.query_range(as_grafana_would(expr, run_id, end - started), started, end, SCRAPE_S)
            return float(series[0]["values"][-1][1])

        cost = served.client.get(f"/v1/runs/{run_id}/cost").json()
        outcomes = {e["pod"]: e.get("outcome") for e in cost["entries"]}
        assert last('sum(spotrl_spot_preemptions_total{run="$run"})') >= 1, f"{victim} was killed unasked: {outcomes}"
        assert last('count(count by (worker) (spotrl_worker_samples_produced_total{run="$run"}))') >= 2
        assert last('sum(spotrl_run_cost_dollars_total{run="$run"})') == pytest.approx(cost["total_dollars"], rel=0.05)
        assert last('spotrl_training_iteration{run="$run"}') == 1
        # An eval per chosen version, each an eval pod billed like any, its latest figures those exported.
        assert [(e["policy_version"], set(e["metrics"])) for e in run["evals"]] == [
            (0, {"mean", "pass@2"}),
            (1, {"mean", "pass@2"}),
        ]
        assert sorted(e["pod"] for e in cost["entries"] if e["role"] == "eval") == [
            f"{run_id}-eval-0",
            f"{run_id}-eval-1",
        ]
        assert all(
            e["capacity_type"] == "spot" and e["ended_at"] is not None for e in cost["entries"] if e["role"] == "eval"
        )
        assert last('spotrl_eval_score{run="$run", metric="mean"}') == pytest.approx(run["evals"][-1]["mean_score"])
        assert run["last_error"] is None
    finally:
        prom.close()
        dcgm.close()


def _api_scraped_after(prom: Prometheus, after: float, timeout_s: float) -> float:
    """The time of the first scrape of the API that began after ``after`` (Prometheus stamps a
    scrape's samples with its start), once Prometheus has it; polled, not slept for. ``timestamp``
    of the bare selector: of an expression (``up == 1``) it is the evaluation time, not the scrape's."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = prom.client.get("/api/v1/query", params={"query": 'timestamp(up{job="spotrl-api"})'})
        result = r.json()["data"]["result"] if r.status_code == 200 else []
        if result and float(result[0]["value"][1]) > after:
            return float(result[0]["value"][1])
        assert time.monotonic() < deadline, f"Prometheus scraped the API no more after the run ended: {r.text}"
        time.sleep(0.05)


def _kill_a_worker_once_it_serves(serving: Served, run_id: str) -> str:
    """SIGKILL one rollout worker's process as soon as it serves the base policy: to the local
    launcher, a spot pod killed unasked (what a reclaim without notice looks like). At once, not
    later: the tiny model generates the whole batch in a second or two, and a worker killed after
    the scheduler asked it to stop would not be a preemption."""
    launcher = LocalLauncher(serving.home / "pods")
    deadline = time.monotonic() + 120
    while True:
        assert time.monotonic() < deadline, "no rollout worker started serving"
        for pod in launcher.list(run_id):
            if (
                pod.role == "rollout"
                and pod.phase == PodPhase.RUNNING
                and pod.pid
                and "serving policy v0" in launcher.logs(pod.name, tail=50)
            ):
                os.kill(pod.pid, signal.SIGKILL)
                return pod.name
        time.sleep(0.05)


def _render(results: dict[tuple[str, str], list[tuple[str, list[dict]]]], out: Path, run_id: str, t0: float) -> None:
    """One PNG per panel: each query's series over the run, legends as the panel names them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for n, ((stem, title), queries) in enumerate(results.items()):
        fig, ax = plt.subplots(figsize=(8, 3.5), dpi=90)
        for legend, series in queries:
            for s in series:
                xs = [float(t) - t0 for t, _ in s["values"]]
                ys = [float(v) for _, v in s["values"]]
                name = re.sub(r"\{\{(\w+)\}\}", lambda m, labels=s["metric"]: labels.get(m.group(1), ""), legend or "")
                ax.plot(xs, ys, label=name if name and name != "__auto" else None)
        ax.set_title(f"{stem}: {title}  (run {run_id})", fontsize=10)
        ax.set_xlabel("seconds since the run was submitted")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / f"{stem}--{n:02d}-{re.sub(r'[^a-z0-9]+', '-', title.lower()).strip('-')}.png")
        plt.close(fig)
