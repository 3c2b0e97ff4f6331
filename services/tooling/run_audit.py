"""The audit of an ended run: the promises of README "Guarantees", checked on what the stores hold.

No prompt lost, no sample trained twice, every queued sample trained or counted dropped (and the
run's counters saying so), every sample generated either queued or dropped by dynamic sampling,
policy versions increasing, every ledger entry closed, no pod left, the run ended.
``spotrl demo --chaos``, tests/test_chaos.py and the end-to-end tests audit their runs with
``audit_run``; each check below adds what it finds to the audit's ``problems``.

Control plane only (no torch): it reads the queue, the object store, the state store and the
launcher.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from contracts.job_result import JobResult
from contracts.messages import PromptMessage
from contracts.samples import Sample, decode_group
from contracts.status import RunStatus
from services.domain.names import ROLLOUT_GROUP, leftover_key, policy_prefix, prompts_topic, result_key, samples_topic
from services.domain.runspec import RunSpec
from services.ports.queue.queue import Queue, Record
from services.ports.state.state_schema import IterationRow, RunRow
from services.ports.wiring import Backends


@dataclass
class Audit:
    """What the stores say about one run, and every broken promise found (``problems``)."""

    run_id: str
    status: str
    produced: int  # samples queued, by the queue
    trained: int  # samples in the stored results' trained ids
    dropped: int  # queued samples in the results' dropped ids and the run's leftovers
    dropped_by_reason: dict[str, int]  # duplicate, stale, uneven, run_ended
    # Samples rollout workers generated and dropped before queueing (DAPO dynamic sampling), by the
    # run's counter: generated = produced + filtered. Never queued, so in none of the figures above.
    filtered: int
    counted: dict[str, int]  # the run's own counters: produced, trained, dropped
    policy_versions: list[int]  # of the recorded iterations, in order
    policy_version: int  # the run's
    prompts_published: int
    prompts_committed: int
    ledger_entries: int
    open_entries: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def lines(self) -> list[str]:
        c = self.counted
        return [
            f"run {self.run_id} {self.status}; policy v{self.policy_version}, iterations' versions {self.policy_versions}",
            f"samples: produced {self.produced}, trained {self.trained}, dropped {self.dropped} "
            f"({', '.join(f'{k} {v}' for k, v in sorted(self.dropped_by_reason.items())) or 'none'}; "
            f"the run counts {c['produced']} / {c['trained']} / {c['dropped']}); "
            f"dropped by dynamic sampling before queueing {self.filtered}",
            f"prompts: published {self.prompts_published}, committed by workers {self.prompts_committed}",
            f"ledger: {self.ledger_entries} entries, {self.open_entries} open",
        ] + [f"PROBLEM: {p}" for p in self.problems]


def audit_run(backends: Backends, run_id: str) -> Audit:
    """Check an ended run against the guarantees, from the queue, the object store, the state
    store and the launcher (module docstring). Problems are collected, not raised."""
    run = backends.state.get_run(run_id)
    spec = RunSpec.from_stored(run.spec)
    problems: list[str] = []
    started = run.started_at is not None
    samples = (
        [s for r in _read_all(backends.queue, samples_topic(run_id)) for s in decode_group(r.value)] if started else []
    )
    iterations = backends.state.iterations(run_id)
    trained, dropped, reasons = _trained_and_dropped(backends, run_id, iterations, problems)
    produced = [s.sample_id for s in samples]
    counted = _check_samples(run, produced, trained, dropped, problems)
    _check_filtered(run, spec, problems)
    versions = _check_policy_versions(backends, run, iterations, samples, problems)
    prompts_committed = _check_prompts(backends, run, spec.samples_per_prompt, samples, problems) if started else 0
    ledger = backends.state.ledger(run_id)
    open_entries = _check_ledger_and_pods(backends, run, ledger, problems)
    return Audit(
        run_id=run_id,
        status=run.status,
        produced=len(produced),
        trained=len(trained),
        dropped=len(dropped),
        dropped_by_reason=dict(reasons),
        filtered=run.samples_filtered,
        counted=counted,
        policy_versions=versions,
        policy_version=run.policy_version,
        prompts_published=run.prompts_published,
        prompts_committed=prompts_committed,
        ledger_entries=len(ledger),
        open_entries=len(open_entries),
        problems=problems,
    )


def _read_all(queue: Queue, topic: str, patience_s: float = 30.0) -> list[Record]:
    """Every record of ``topic``, read by a consumer group of its own (from the start). A broker's
    fetches may come up empty for a while (a consumer just joined): polls go on until every record
    is in, for ``patience_s`` at most."""
    want = sum(queue.end_offsets(topic).values())
    consumer = queue.consumer(topic, f"audit-{uuid.uuid4().hex[:8]}", member_id="audit")
    records: list[Record] = []
    deadline = time.monotonic() + patience_s
    try:
        while len(records) < want and time.monotonic() < deadline:
            records += consumer.poll(1000, timeout_s=1.0)
    finally:
        consumer.close()
    return records


def _trained_and_dropped(
    backends: Backends, run_id: str, iterations: list[IterationRow], problems: list[str]
) -> tuple[list[str], list[str], Counter[str]]:
    """The sample ids each recorded iteration's job wrote as trained or dropped, the run's
    leftovers counted dropped, and the dropped ones by reason."""
    trained: list[str] = []
    dropped: list[str] = []
    reasons: Counter[str] = Counter()
    for it in iterations:
        result = JobResult.from_json(backends.objects.get_bytes(result_key(run_id, it.iteration)))
        trained += result.trained_ids
        for reason, ids in result.dropped.model_dump().items():
            dropped += ids
            reasons[reason] += len(ids)
        if result.policy_version != it.iteration or it.policy_version != it.iteration:
            problems.append(
                f"iteration {it.iteration} published v{result.policy_version}, recorded v{it.policy_version}"
            )
        if (len(result.trained_ids), result.dropped.count()) != (it.samples_trained, it.samples_dropped):
            problems.append(f"iteration {it.iteration}: recorded counts differ from its result")
    # The chunks under runs/<run>/leftover/ (services.control.scheduler.apply), or one leftover.json of older runs.
    for key in backends.objects.list(leftover_key(run_id).removesuffix(".json")):
        if key.endswith(".json"):
            ids = list(json.loads(backends.objects.get_bytes(key))["run_ended"])
            dropped += ids
            reasons["run_ended"] += len(ids)
    # Every published result is a recorded iteration (a job killed after publishing included).
    recorded = {it.iteration for it in iterations}
    for key in backends.objects.list(f"runs/{run_id}/trainer/"):
        if (m := re.search(r"/v(\d+)/result\.json$", key)) and int(m.group(1)) not in recorded:
            problems.append(f"v{m.group(1)} was published (its result is stored) but is not a recorded iteration")
    return trained, dropped, reasons


def _check_samples(
    run: RunRow, produced: list[str], trained: list[str], dropped: list[str], problems: list[str]
) -> dict[str, int]:
    """Each queued sample trained once or dropped, and the run's counters saying so; returns the counters."""
    if len(trained) != len(set(trained)):
        twice = [i for i, k in Counter(trained).items() if k > 1]
        problems.append(f"{len(twice)} samples trained more than once, e.g. {twice[:3]}")
    accounted, queued = Counter(trained + dropped), Counter(produced)
    if accounted != queued:
        missing = list((queued - accounted).elements())
        extra = list((accounted - queued).elements())
        problems.append(
            f"samples neither trained nor dropped: {len(missing)} {missing[:3]}; trained or dropped more often than "
            f"queued (or never queued): {len(extra)} {extra[:3]}"
        )
    counted = {"produced": run.samples_produced, "trained": run.samples_trained, "dropped": run.samples_dropped}
    if counted != {"produced": len(produced), "trained": len(trained), "dropped": len(dropped)}:
        problems.append(
            f"the run counts {counted}, the stores hold produced {len(produced)}, trained {len(trained)}, "
            f"dropped {len(dropped)}"
        )
    if run.samples_produced != run.samples_trained + run.samples_dropped:
        problems.append(
            f"produced {run.samples_produced} != trained {run.samples_trained} + dropped {run.samples_dropped}"
        )
    return counted


def _check_filtered(run: RunRow, spec: RunSpec, problems: list[str]) -> None:
    """Samples dropped before queueing: only by dynamic sampling, and only whole groups. Which
    prompts they were is checked with the prompts (``_check_prompts``)."""
    if run.samples_filtered and not spec.training.dynamic_sampling:
        problems.append(f"{run.samples_filtered} samples dropped before queueing, without dynamic sampling")
    if run.samples_filtered % spec.samples_per_prompt:
        problems.append(
            f"{run.samples_filtered} samples dropped by dynamic sampling: not whole groups of {spec.samples_per_prompt}"
        )


def _check_policy_versions(
    backends: Backends, run: RunRow, iterations: list[IterationRow], samples: list[Sample], problems: list[str]
) -> list[int]:
    """One version per iteration, increasing; the run's is the last and stored; workers never go
    back. Returns the iterations' versions."""
    versions = [it.policy_version for it in iterations]
    if versions != list(range(1, len(versions) + 1)):
        problems.append(f"the iterations' policy versions are {versions}, not 1..{len(versions)}")
    if run.policy_version != (versions[-1] if versions else 0):
        problems.append(
            f"the run reports policy v{run.policy_version}, its last iteration published v{versions[-1] if versions else 0}"
        )
    if versions and not backends.objects.list(policy_prefix(run.id, versions[-1])):
        problems.append(f"policy v{versions[-1]} is not in the object store")
    by_worker: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_worker[s.worker_id].append(s)
    for worker, theirs in by_worker.items():
        seen = [s.policy_version for s in sorted(theirs, key=lambda s: s.created_at)]
        if seen != sorted(seen):
            problems.append(f"worker {worker} generated with policy versions going back: {seen}")
    return versions


def _check_prompts(backends: Backends, run: RunRow, n: int, samples: list[Sample], problems: list[str]) -> int:
    """No prompt lost: each prompt a worker committed became a whole group of samples, queued or
    dropped by dynamic sampling (``n`` samples a group). Returns how many prompts the workers committed.

    Dropped groups are a count, not ids: the committed prompts without a queued group must be at
    most that many groups. At most, not exactly: a worker that counted its drops and died before
    committing its prompts had them redone, and its drops were generated all the same."""
    topic = prompts_topic(run.id)
    prompt_records = _read_all(backends.queue, topic)
    committed = backends.queue.committed(topic, ROLLOUT_GROUP)
    done = [r for r in prompt_records if r.offset < committed.get(r.partition, 0)]
    if len(prompt_records) < run.prompts_published:
        problems.append(f"{run.prompts_published} prompts published, {len(prompt_records)} in the queue")
    groups: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group_id].append(s)
    generated = Counter(g[0].prompt_id for g in groups.values() if len(g) == n)
    if broken := [gid for gid, g in groups.items() if len(g) != n]:
        problems.append(f"{len(broken)} groups of samples are not whole ({n} samples each), e.g. {broken[:3]}")
    wanted = Counter(PromptMessage.decode(r.value).prompt_id for r in done)
    short = {p: (k, generated[p]) for p, k in wanted.items() if generated[p] < k}
    unqueued = sum(k - queued for k, queued in short.values())
    if short and unqueued * n > run.samples_filtered:
        problems.append(
            f"prompts committed without their samples (prompt: committed, queued): {short}; "
            f"{unqueued} groups missing, {run.samples_filtered // n} dropped by dynamic sampling"
        )
    return len(done)


def _check_ledger_and_pods(backends: Backends, run: RunRow, ledger: list[Any], problems: list[str]) -> list[str]:
    """Every ledger entry closed, no pod billed twice over the same seconds, no pod left, the run
    ended. Returns the pods whose entries are still open."""
    open_entries = [e.pod for e in ledger if e.ended_at is None]
    if open_entries:
        problems.append(f"ledger entries still open: {open_entries}")
    by_pod: dict[str, list[Any]] = defaultdict(list)
    for e in ledger:
        by_pod[e.pod].append(e)
    for pod, entries in by_pod.items():
        entries.sort(key=lambda e: e.started_at)
        for a, b in pairwise(entries):
            if a.ended_at is None or b.started_at < a.ended_at:
                problems.append(f"pod {pod} is billed twice from {b.started_at:.3f}")
    if left := [p.name for p in backends.launcher.list(run.id)]:
        problems.append(f"pods left: {left}")
    if not RunStatus(run.status).is_terminal():
        problems.append(f"the run has not ended: {run.status}")
    return open_entries
