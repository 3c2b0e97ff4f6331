"""The offline optimum: the cheapest schedule an omniscient scheduler could run on a spot trace
with the levers the cost policies have (``bench/cost_policies.py --oracle`` sets it beside them).

The model (what ``services.control.simulate.world`` simulates, seen from above):

- ``N = iterations`` training jobs, each of ``T = training_minutes`` on the training instance type
  (on-demand), one at a time; job ``j`` is *launched* at ``L_j``, when batch ``j`` is complete.
- Batch ``j + 1`` is generated between ``L_j`` and ``L_{j+1}``: ``plan`` publishes prompts one
  batch ahead of the trainer, so the next batch's prompts come when a job is launched; with a
  staleness bound of 0 only from the job's end (what is made while it trains is dropped). The
  first batch is generated from the rollout workers' start-up ``S`` on.
- Rollout is a fluid: a batch is ``D = batch_samples / rate`` worker-seconds of generation, done
  by at most ``max_workers`` workers at a time, of which at most the trace's spot capacity on
  spot (each second at the catalog's spot price, or the trace's price of that tick), the rest
  on-demand. A window's spot seconds are used first, in time order; on-demand fills the rest.
- A training node (billed per second, on-demand) is either *held* from one job's end to the next
  launch (a standby, or the node a job left: its idle seconds are billed, and the next job starts
  at its launch), or a *new* machine, which bills its start-up ``S`` once: launched up to ``S``
  before a launch (a standby warming up) or at it (a cold start), so that its job starts anywhere
  from its launch to ``S`` after. So a job after a gap ``g`` pays ``min(g, S)`` of node time,
  and a new machine lets its job end as the next batch completes. The first job pays ``S``.
- The run ends with the last job, before the deadline (if any) and the workload's horizon.

The optimum is a dynamic program over the jobs, its state a job's launch on a grid of
``step_seconds`` and whether its node was held (its job started at launch) or new (its start
free within ``S``): each job's value is a min over the previous job's launches of the held
node's gap or a new machine's ``S``, plus the cheapest generation of its batch in between. The
transitions to a new machine are one sliding-window minimum over the previous launches (a
window's generation costs a function of where it starts plus one of where it ends, split at
where spot capacity alone covers the batch), so a job costs O(grid) and a run O(N x grid).

Approximations (each makes the optimum cheaper than the simulator can be, except the last two):

- generation is a fluid: no group lost to a preemption, no worker idle for a prompt, whole
  workers and groups not required; rollout workers' start-ups are not billed (a pool held
  across batches pays them once: some cents a run on the bench's workload) nor do they take
  spot capacity while they start;
- a spot worker may go on for ``spot_notice_seconds`` after its capacity went, as a preempted
  one does: capacity is the trace's most over that notice (also for a worker launched within it);
- the prompts of the next batch come at the launch, not the tick after; the billed minimum is
  not added (a machine runs at least ``S + T``);
- with a staleness bound of 0, the next batch is taken to start at the earliest end of the job
  (its node's start-up ``S`` after launch at most) even where the new machine chose a later one;
- launches lie on the grid of ``step_seconds`` (the simulator's on its tick, 10 s): a node gap
  between grid points is not available (at most ``step_seconds`` of a node per job);
- on a trace with prices, a window's spot seconds are used in time order, not cheapest first.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

from services.control.simulate.traces import SpotTrace
from services.control.simulate.workload import Workload
from services.domain.runspec import CostPolicy
from services.ports.prices.catalog import PriceCatalog, load_catalog

_EPS = 1e-9
HELD, NEW = 0, 1  # how a job's node came: held from the previous job (starts at launch), or new (pays S)


@dataclass(frozen=True)
class OracleBatch:
    """One training job and the generation of its batch, in seconds from the run's start."""

    launch: float  # the batch is complete and its job launched
    generated_from: float  # its batch's generation window's start
    job_start: float
    spot_seconds: float  # generation worker-seconds on spot capacity
    on_demand_seconds: float  # and on on-demand
    new_node: bool  # the job's node is a new machine (start-up billed), else one held from the last job


@dataclass(frozen=True)
class OracleResult:
    """The cheapest schedule's figures; money in ``currency``. ``finished`` False: no schedule ends
    within the deadline and the horizon (``dollars`` is then inf)."""

    currency: str
    dollars: float
    wall_seconds: float
    lower_bound_dollars: float  # as the simulator's: busy seconds at the cheapest prices
    training_dollars: float  # jobs, start-ups and held nodes
    rollout_dollars: float
    batches: tuple[OracleBatch, ...]
    finished: bool = True

    @property
    def new_nodes(self) -> int:
        return sum(b.new_node for b in self.batches)


@dataclass(frozen=True)
class _Capacity:
    """Spot generation the trace allows, cumulated over grid cells of ``step`` seconds:
    ``spot[i]`` worker-seconds and ``dollars[i]`` their cost from 0 to ``i * step``, linear within a cell."""

    step: float
    spot: tuple[float, ...]
    dollars: tuple[float, ...]

    def _at(self, sums: tuple[float, ...], t: float) -> float:
        i = min(max(0, int(t // self.step)), len(sums) - 2)
        return sums[i] + (sums[i + 1] - sums[i]) * (t - i * self.step) / self.step

    def spot_at(self, t: float) -> float:
        return self._at(self.spot, t)

    def dollars_at(self, t: float) -> float:
        return self._at(self.dollars, t)

    def when_spot_reaches(self, seconds: float) -> float:
        """The earliest time the cumulated spot worker-seconds reach ``seconds`` (inf: never)."""
        if seconds > self.spot[-1] + _EPS:
            return math.inf
        i = min(max(0, bisect.bisect_left(self.spot, seconds - _EPS) - 1), len(self.spot) - 2)
        rate = self.spot[i + 1] - self.spot[i]
        return i * self.step + (self.step * max(0.0, seconds - self.spot[i]) / rate if rate > 0 else 0.0)


def spot_capacity(
    trace: SpotTrace,
    step: float,
    cells: int,
    *,
    most: int,
    notice_seconds: float,
    spot_price: float,
    on_demand_price: float,
) -> _Capacity:
    """The spot workers a schedule may use in each of ``cells`` cells of ``step`` seconds (the
    trace's capacity at the cell's start): the most over the ``notice_seconds`` before it (a
    preempted worker works on through its notice), at most ``most``, none where spot costs
    ``on_demand_price`` or more (per hour, as ``spot_price``, the catalog's when the trace has no prices)."""
    raw = [trace.at(i * step) for i in range(cells)]
    notice = math.ceil(notice_seconds / step - _EPS)
    spot_sums, dollar_sums = [0.0], [0.0]
    for i in range(cells):
        price = trace.price_at(i * step) if trace.prices is not None else spot_price
        n = min(most, max(raw[max(0, i - notice) : i + 1])) if price < on_demand_price else 0
        spot_sums.append(spot_sums[-1] + n * step)
        dollar_sums.append(dollar_sums[-1] + n * step * price / 3600.0)
    return _Capacity(step, tuple(spot_sums), tuple(dollar_sums))


@dataclass(frozen=True)
class _Model:
    """A run's figures in seconds and dollars per second, and its trace's spot capacity."""

    step: float
    jobs: int  # N
    train_s: float  # T
    startup_s: float  # S
    work_s: float  # D: generation worker-seconds per batch
    most: int  # workers at a time
    node_per_s: float  # the training node's on-demand price
    od_per_s: float  # an on-demand rollout worker's
    shift: float  # a batch's generation starts this long after the previous launch (T with staleness bound 0)
    launches: int  # grid points a launch may take: the last job ends within the deadline and horizon
    cap: _Capacity


def _covered(m: _Model, spot_start: float, dollars_start: float) -> float:
    """What a batch costs from a start where spot alone covers it (inf: it never does)."""
    t = m.cap.when_spot_reaches(spot_start + m.work_s)
    return math.inf if t == math.inf else m.cap.dollars_at(t) - dollars_start


def _window(m: _Model, start: float, spot_start: float, dollars_start: float, end: int) -> tuple[float, float]:
    """(dollars, spot worker-seconds) of generating a batch from ``start`` to grid point ``end``
    (``spot_start``/``dollars_start``: the capacity's sums at ``start``): spot first, on-demand
    for the rest; dollars inf where even ``most`` workers cannot make it."""
    if (end * m.step - start) * m.most < m.work_s - _EPS:
        return math.inf, 0.0
    spot = m.cap.spot[end] - spot_start
    if spot >= m.work_s - _EPS:
        return _covered(m, spot_start, dollars_start), m.work_s
    return m.cap.dollars[end] - dollars_start + m.od_per_s * (m.work_s - spot), spot


def _next_job(m: _Model, held: list[float], new: list[float]) -> tuple[list[float], list[float], list[tuple[int, int]]]:
    """One step of the dynamic program: from the values of job ``j``'s launches (its node held,
    or new) to job ``j + 1``'s, with each one's best previous (launch, node)."""
    inf, k = math.inf, m.launches
    best = [min(h, n) for h, n in zip(held, new, strict=True)]
    best_node = [HELD if h <= n else NEW for h, n in zip(held, new, strict=True)]
    starts = [c * m.step + m.shift for c in range(k)]
    spot_s = [m.cap.spot_at(t) for t in starts]
    dollars_s = [m.cap.dollars_at(t) for t in starts]
    # A batch spot alone covers costs what its spot seconds cost from its start on, whatever its end.
    covered = [_covered(m, s, d) for s, d in zip(spot_s, dollars_s, strict=True)]
    after_train = math.ceil(m.train_s / m.step - _EPS)  # a launch after the last job's end
    after_work = math.ceil((m.work_s / m.most + m.shift) / m.step - _EPS)  # the window fits the batch
    first = max(1, after_train, after_work)
    # A held node idles less than S (else a new one is as cheap), and a new node's job starts at
    # most S after its launch: a held launch comes less than T + 2 S after the last one.
    last_held = math.ceil((m.train_s + 2 * m.startup_s) / m.step - _EPS)
    held_out, new_out = [inf] * k, [inf] * k
    parent: list[tuple[int, int]] = [(-1, HELD)] * (2 * k)  # [held launches..., new launches...]
    # new: S + min over launches c <= c' - first of best[c] + window(c, c'); split at alpha(c'), the
    # last c whose window spot covers: covered ones by a prefix minimum, the others by a sliding one.
    prefix = [inf] * k
    prefix_at = [-1] * k
    for c in range(k):
        v = best[c] + covered[c]
        if c and prefix[c - 1] <= v:
            prefix[c], prefix_at[c] = prefix[c - 1], prefix_at[c - 1]
        else:
            prefix[c], prefix_at[c] = v, c
    uncovered = [b - d + m.od_per_s * s for b, d, s in zip(best, dollars_s, spot_s, strict=True)]
    window: deque[int] = deque()
    alpha, pushed = -1, 0
    for end in range(first, k):
        hi = end - first
        while pushed <= hi:
            while window and uncovered[window[-1]] > uncovered[pushed]:  # ties: the earliest launch
                window.pop()
            window.append(pushed)
            pushed += 1
        while alpha + 1 < k and spot_s[alpha + 1] <= m.cap.spot[end] - m.work_s + _EPS:
            alpha += 1
        while window and window[0] <= alpha:
            window.popleft()
        cands = []
        if alpha >= 0:
            c = prefix_at[min(alpha, hi)]
            cands.append((prefix[min(alpha, hi)], c))
        if window:
            c = window[0]
            cost = uncovered[c] + m.cap.dollars[end] + m.od_per_s * (m.work_s - m.cap.spot[end])
            cands.append((cost, c))
        if cands:
            v, c = min(cands)
            if v < inf:
                new_out[end] = m.startup_s * m.node_per_s + v
                parent[k + end] = (c, best_node[c])
        # held: the last job's node idles from its end to this launch, for less than S (else a new one is cheaper).
        for back in range(min(end, last_held), first - 1, -1):  # earliest first: ties keep it
            c = end - back
            gap_held = back * m.step - m.train_s  # a held node's job started at its launch
            gap_new = max(0.0, gap_held - m.startup_s)  # a new node's started up to S after
            value, gap, node = new[c], gap_new, NEW
            if gap_held < m.startup_s and held[c] + gap_held * m.node_per_s < value + gap_new * m.node_per_s:
                value, gap, node = held[c], gap_held, HELD
            if value == inf or gap >= m.startup_s:
                continue
            spot = m.cap.spot[end] - spot_s[c]
            if spot >= m.work_s - _EPS:
                dollars = covered[c]
            else:  # (first keeps the window long enough for ``most`` workers)
                dollars = m.cap.dollars[end] - dollars_s[c] + m.od_per_s * (m.work_s - spot)
            v = value + gap * m.node_per_s + dollars
            if v < held_out[end]:
                held_out[end] = v
                parent[end] = (c, node)
    return held_out, new_out, parent


def oracle(
    trace: SpotTrace,
    workload: Workload = Workload(),
    catalog: PriceCatalog | None = None,
    step_seconds: float = 30.0,
) -> OracleResult:
    """The cheapest schedule of ``workload`` on ``trace`` (the module's model), launches on a grid
    of ``step_seconds`` (best a divisor of the trace's tick, the start-up and the training time)."""
    catalog = catalog or load_catalog()
    w = workload
    currency = catalog.currency_of([w.rollout_instance_type, w.training_instance_type])
    spec = w.spec(CostPolicy.COST_AWARE)
    rollout, training = catalog.get(w.rollout_instance_type), catalog.get(w.training_instance_type)
    train_s, startup_s = w.training_minutes * 60.0, w.startup_seconds
    work_s = w.batch_samples / (w.worker_samples_per_hour / 3600.0)
    jobs = spec.iterations or 0
    end_by = (
        w.horizon_days * 86400.0 if w.deadline_seconds is None else min(w.horizon_days * 86400.0, w.deadline_seconds)
    )
    launches = max(0, math.floor((end_by - train_s) / step_seconds + _EPS) + 1)
    shift = train_s if spec.staleness_bound == 0 else 0.0
    cells = launches + math.ceil(shift / step_seconds) + 2
    spot_price = trace.cheapest_price() if trace.prices is not None else rollout.spot
    m = _Model(
        step=step_seconds,
        jobs=jobs,
        train_s=train_s,
        startup_s=startup_s,
        work_s=work_s,
        most=spec.rollout.max_workers,
        node_per_s=training.on_demand / 3600.0,
        od_per_s=rollout.on_demand / 3600.0,
        shift=shift,
        launches=launches,
        cap=spot_capacity(
            trace,
            step_seconds,
            cells,
            most=spec.rollout.max_workers if spec.rollout.spot else 0,
            notice_seconds=w.spot_notice_seconds,
            spot_price=rollout.spot,
            on_demand_price=rollout.on_demand,
        ),
    )
    lower_bound = jobs * (work_s * spot_price + train_s * training.on_demand) / 3600.0
    unfinished = OracleResult(currency, math.inf, math.inf, round(lower_bound, 4), math.inf, math.inf, (), False)
    if jobs == 0 or launches == 0:
        return unfinished

    # The first job: its batch generated from the workers' start-up on, its node new.
    first_spot, first_dollars = m.cap.spot_at(startup_s), m.cap.dollars_at(startup_s)
    held = [math.inf] * launches
    new = [startup_s * m.node_per_s + _window(m, startup_s, first_spot, first_dollars, c)[0] for c in range(launches)]
    parents = []
    for _ in range(jobs - 1):
        held, new, parent = _next_job(m, held, new)
        parents.append(parent)
    cheapest = min(min(h, n) for h, n in zip(held, new, strict=True))
    if cheapest == math.inf:
        return unfinished
    # Of the schedules within float noise of the cheapest, the one that ends first.
    last = next(c for c in range(launches) if min(held[c], new[c]) <= cheapest + 1e-9 * (1 + cheapest))
    total = min(held[last], new[last])
    node = HELD if held[last] <= new[last] else NEW
    chain = [(last, node)]
    for parent in reversed(parents):
        c, node = chain[-1]
        chain.append(parent[c if node == HELD else launches + c])
    chain.reverse()
    return _result(m, chain, total, currency, lower_bound)


def _result(m: _Model, chain: list[tuple[int, int]], total: float, currency: str, lower_bound: float) -> OracleResult:
    """The schedule of the launches and nodes ``chain`` (the dynamic program's), its costs recounted."""
    batches: list[OracleBatch] = []
    node_dollars = rollout_dollars = 0.0
    job_end = -math.inf
    for j, (c, node) in enumerate(chain):
        launch = c * m.step
        start = m.startup_s if j == 0 else chain[j - 1][0] * m.step + m.shift
        dollars, spot = _window(m, start, m.cap.spot_at(start), m.cap.dollars_at(start), c)
        rollout_dollars += dollars
        if node == NEW:
            node_dollars += m.startup_s * m.node_per_s
            # A new node's job starts as late as lets it end by the next launch (at most S after its own).
            following = chain[j + 1] if j + 1 < len(chain) else None
            slack = 0.0 if following is None or following[1] == NEW else following[0] * m.step - launch - m.train_s
            job_start = launch + min(m.startup_s, max(0.0, slack))
        else:
            node_dollars += (launch - job_end) * m.node_per_s
            job_start = launch
        job_end = job_start + m.train_s
        batches.append(OracleBatch(launch, start, job_start, spot, m.work_s - spot, node == NEW))
    training_dollars = node_dollars + m.jobs * m.train_s * m.node_per_s
    dollars = training_dollars + rollout_dollars
    assert math.isclose(dollars, total + m.jobs * m.train_s * m.node_per_s, rel_tol=1e-9, abs_tol=1e-6), (
        "the schedule recounted costs what the dynamic program found"
    )
    return OracleResult(
        currency=currency,
        dollars=round(dollars, 4),
        wall_seconds=round(job_end, 1),
        lower_bound_dollars=round(lower_bound, 4),
        training_dollars=round(training_dollars, 4),
        rollout_dollars=round(rollout_dollars, 4),
        batches=tuple(batches),
    )
