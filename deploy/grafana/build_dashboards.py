"""spotrl's Grafana dashboards, written as JSON into the Helm chart (deploy/helm/spotrl/dashboards/).

    python deploy/grafana/build_dashboards.py          # rewrite the JSON files
    python deploy/grafana/build_dashboards.py --check  # fail if they differ from what this builds

The chart globs that folder into ConfigMaps for Grafana's dashboard sidecar. Each dashboard has
a ``datasource`` variable (any Prometheus) and a ``run`` variable (the runs the API's /metrics
lists). Every query reads one scrape job, the API's /metrics (services/control/api/metrics.py), except
GPU utilization, which joins NVIDIA DCGM exporter's ``DCGM_FI_DEV_GPU_UTIL{pod}`` to
``spotrl_pod_info{pod}``: if your Prometheus renames dcgm-exporter's ``pod`` label to
``exported_pod`` (a ServiceMonitor without ``honorLabels: true``), relabel it back.

tests/deploy/test_dashboards.py runs every query below against a real Prometheus scraping a run.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "helm" / "spotrl" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
R = 'run="$run"'  # the run selector of every spotrl series
RATE = "[$__rate_interval]"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # or "stat"
    description: str = ""
    extra: dict = field(default_factory=dict)


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


# Every API replica exports the same state-store-derived series (each scrape reads the store), so
# each query first takes one replica's value: ``max without (instance, pod)``. (``pod`` is the
# scraped API pod's label under Kubernetes service discovery; ``spotrl_pod_info`` carries its
# own ``pod``, the workload's, and is deduplicated by its labels instead.)
ONE = "max without (instance, pod)"


def s(name: str, where: str = "") -> str:
    """One replica's ``name`` series of the selected run, ``where`` adding matchers."""
    return f"{ONE} ({name}{{{R}{where}}})"


def rate(name: str, where: str = "", fn: str = "rate", window: str = RATE) -> str:
    """One replica's per-second rate (or ``fn``: increase) of the counter ``name``."""
    return f"{ONE} ({fn}({name}{{{R}{where}}}{window}))"


def cost() -> list[Panel]:
    spent = f"sum({s('spotrl_run_cost_dollars_total')})"
    return [
        Panel("Dollars spent", (q(spent, "spent"),), unit="currencyUSD", kind="stat"),
        Panel(
            "$/h now",
            (q(f"sum({s('spotrl_cost_dollars_per_hour')})", "$/h"),),
            unit="currencyUSD",
            kind="stat",
            description="What the run's running pods cost per hour at this moment.",
        ),
        Panel(
            "Savings vs always-on",
            (q(s("spotrl_run_savings_ratio"), "x cheaper"),),
            unit="x",
            kind="stat",
            description="Always-on on-demand dollars for the same work over dollars spent (2 = half the price).",
        ),
        Panel(
            "Efficiency vs the lower bound",
            (q(s("spotrl_run_cost_efficiency"), "efficiency"),),
            unit="percentunit",
            kind="stat",
            description="Lower-bound dollars (busy pod seconds at the cheapest price) over dollars spent.",
        ),
        Panel(
            "Dollars spent by role and capacity type",
            (q(f"sum by (role, capacity_type) ({s('spotrl_run_cost_dollars_total')})", "{{role}} {{capacity_type}}"),),
            unit="currencyUSD",
        ),
        Panel(
            "$/h now by role and capacity type",
            (q(f"sum by (role, capacity_type) ({s('spotrl_cost_dollars_per_hour')})", "{{role}} {{capacity_type}}"),),
            unit="currencyUSD",
        ),
        Panel(
            "Spent vs always-on vs lower bound",
            (
                q(spent, "spent"),
                q(s("spotrl_run_always_on_dollars"), "always-on on-demand"),
                q(s("spotrl_run_lower_bound_dollars"), "lower bound"),
            ),
            unit="currencyUSD",
        ),
        Panel(
            "Savings ratio and efficiency over time",
            (
                q(s("spotrl_run_savings_ratio"), "savings vs always-on (x)"),
                q(s("spotrl_run_cost_efficiency"), "efficiency vs lower bound"),
            ),
        ),
    ]


def utilization() -> list[Panel]:
    pods = f"max by (run, role, capacity_type, instance_type, pod) (spotrl_pod_info{{{R}}})"
    join = f"DCGM_FI_DEV_GPU_UTIL * on (pod) group_left (run, role, capacity_type, instance_type) {pods}"
    training_pods = rate("spotrl_pod_seconds_total", ', role="training"')
    training_running = f"sum({training_pods})"
    return [
        Panel(
            "GPU utilization by role",
            (q(f"avg by (role) ({join})", "{{role}}"),),
            unit="percent",
            description="DCGM exporter's DCGM_FI_DEV_GPU_UTIL joined on pod to spotrl_pod_info.",
        ),
        Panel("GPU utilization by pod", (q(f"avg by (pod, role) ({join})", "{{pod}}"),), unit="percent"),
        Panel(
            "Training busy vs idle",
            (
                q(f"clamp_max({training_running}, 1)", "training job running"),
                q(f"1 - clamp_max({training_running}, 1)", "no training job (idle on always-on)"),
                q(f"sum({rate('spotrl_training_busy_seconds_total')})", "iteration work"),
            ),
            unit="percentunit",
            description="Share of wall time a training pod runs; an always-on training GPU would idle the rest.",
        ),
        Panel(
            "Rollout samples/s per worker",
            (q(f"sum by (worker) ({rate('spotrl_worker_samples_produced_total')})", "{{worker}}"),),
            unit="short",
        ),
        Panel(
            "Rollout generating share per worker",
            (q(f"sum by (worker) ({rate('spotrl_worker_generation_seconds_total')})", "{{worker}}"),),
            unit="percentunit",
            description="Seconds spent generating per second of wall time.",
        ),
        Panel(
            "Rollout generation batch per worker",
            (q(f"max by (worker) ({s('spotrl_worker_generation_batch')})", "{{worker}}"),),
            unit="short",
            description="The most sequences a worker generated at once in its latest batch: sized from its free "
            "memory, grown while there is room, halved on an out-of-memory error.",
        ),
        Panel(
            "Running pods by role and capacity type",
            (q(f"sum by (role, capacity_type) ({s('spotrl_pods')})", "{{role}} {{capacity_type}}"),),
        ),
    ]


def pipeline() -> list[Panel]:
    return [
        Panel(
            "Prompt backlog",
            (q(s("spotrl_prompt_backlog"), "prompts queued"),),
            description="Prompts published and not yet generated from.",
        ),
        Panel(
            "Sample backlog",
            (q(s("spotrl_sample_backlog"), "samples queued"),),
            description="Samples queued and not yet trained.",
        ),
        Panel(
            "Sample staleness (policy versions)",
            (q(s("spotrl_sample_staleness_mean"), "mean"), q(s("spotrl_sample_staleness_max"), "max")),
            description="Versions between the policy that generated a trained sample and the policy updated, latest iteration.",
        ),
        Panel(
            "Dropped samples by reason",
            (q(f"sum by (reason) ({s('spotrl_samples_dropped_by_reason_total')})", "{{reason}}"),),
        ),
        Panel(
            "Samples/s produced and trained",
            (
                q(f"sum({rate('spotrl_samples_produced_total')})", "produced"),
                q(f"sum({rate('spotrl_samples_trained_total')})", "trained"),
            ),
        ),
        Panel("Policy version", (q(s("spotrl_policy_version"), "version"),)),
    ]


def reward_cache() -> list[Panel]:
    name = "spotrl_reward_cache_requests_total"
    hit, looked_up = ', result="hit"', ', result=~"hit|miss"'

    def ratio(fn: str, window: str) -> str:
        return f"sum({rate(name, hit, fn, window)}) / sum({rate(name, looked_up, fn, window)})"

    return [
        Panel(
            "Hit rate (dashboard range)",
            (q(ratio("increase", "[$__range]"), "hit rate"),),
            unit="percentunit",
            kind="stat",
        ),
        Panel("Hit rate", (q(ratio("rate", RATE), "hit rate"),), unit="percentunit"),
        Panel(
            "Requests/s by result",
            (q(f"sum by (result) ({rate(name)})", "{{result}}"),),
            description="Keys looked up (hit, miss) and keys not looked up or written because the cache failed (error).",
        ),
        Panel("Requests by result", (q(f"sum by (result) ({s(name)})", "{{result}}"),)),
    ]


def training() -> list[Panel]:
    return [
        Panel("Mean reward", (q(s("spotrl_training_mean_reward"), "mean reward"),)),
        Panel(
            "Held-out eval",
            (q(s("spotrl_eval_score"), "{{metric}}"),),
            description="The latest eval of a policy version on the held-out prompts (runs with an `eval` section): "
            "mean score and each pass@k.",
        ),
        Panel("KL", (q(s("spotrl_training_kl"), "KL"),)),
        Panel("Clip fraction", (q(s("spotrl_training_clip_fraction"), "actor/pg_clipfrac"),), unit="percentunit"),
        Panel(
            "Entropy",
            (q(s("spotrl_training_entropy"), "actor/entropy"),),
            description="Reported by runs with training.entropy_coef > 0.",
        ),
        Panel("Step seconds", (q(s("spotrl_training_step_seconds"), "seconds"),), unit="s"),
        Panel("Iteration", (q(s("spotrl_training_iteration"), "iteration"),)),
    ]


def preemptions() -> list[Panel]:
    spot = ', capacity_type="spot"'
    return [
        Panel(
            "Spot preemptions",
            (q(f"sum({s('spotrl_spot_preemptions_total')})", "preemptions"),),
            kind="stat",
            description="Spot pods that ended killed by a signal.",
        ),
        Panel(
            "Spot preemptions by instance type",
            (q(f"sum by (instance_type) ({s('spotrl_spot_preemptions_total')})", "{{instance_type}}"),),
        ),
        Panel(
            "Spot pods ended by outcome",
            (q(f"sum by (outcome) ({s('spotrl_pods_ended_total', spot)})", "{{outcome}}"),),
        ),
        Panel("Running spot pods", (q(f"sum by (instance_type) ({s('spotrl_pods', spot)})", "{{instance_type}}"),)),
        Panel(
            "Spot pods waiting for capacity",
            (q(f"sum by (instance_type) ({s('spotrl_pods_waiting_for_node', spot)})", "{{instance_type}}"),),
            description="Launched with no node yet: the zone has no spot capacity of that type. Nothing is billed "
            "for them; with a deadline at risk, cost-aware starts on-demand workers in their place.",
        ),
    ]


DASHBOARDS = {
    "cost": ("Cost", cost),
    "utilization": ("Utilization", utilization),
    "pipeline": ("Pipeline", pipeline),
    "reward-cache": ("Reward cache", reward_cache),
    "training": ("Training", training),
    "spot-preemptions": ("Spot preemptions", preemptions),
}


def panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    width = 6 if panel.kind == "stat" else 12
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 4 if panel.kind == "stat" else 8, "w": width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}}
        if panel.kind == "timeseries"
        else {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend or "__auto"}
            for i, t in enumerate(panel.queries)
        ],
    }


def dashboard(slug: str, title: str, panels: list[Panel]) -> dict:
    laid_out, x, y, row_height = [], 0, 0, 0
    for pid, panel in enumerate(panels, start=1):
        p = panel_json(panel, pid, x, y)
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y = 0, y + row_height
            row_height = 0
            p["gridPos"].update(x=x, y=y)
        laid_out.append(p)
        x, row_height = x + w, max(row_height, h)
    return {
        "uid": f"spotrl-{slug}",
        "title": f"spotrl / {title}",
        "tags": ["spotrl"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "graphTooltip": 1,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                {
                    "name": "run",
                    "label": "Run",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": {"query": "label_values(spotrl_policy_version, run)", "refId": "run"},
                    "definition": "label_values(spotrl_policy_version, run)",
                    "refresh": 2,
                    "sort": 2,
                    "current": {},
                    "hide": 0,
                },
            ]
        },
        "annotations": {"list": []},
        "links": [
            {"type": "dashboards", "tags": ["spotrl"], "asDropdown": True, "title": "spotrl", "includeVars": True}
        ],
        "panels": laid_out,
    }


def build() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {
        f"{slug}.json": json.dumps(dashboard(slug, title, make()), indent=2) + "\n"
        for slug, (title, make) in DASHBOARDS.items()
    }


def main(argv: list[str]) -> int:
    files = build()
    if "--check" in argv:
        stale = [name for name, text in files.items() if not (OUT / name).exists() or (OUT / name).read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
