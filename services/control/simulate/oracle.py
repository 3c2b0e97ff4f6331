"""The offline optimum: the cheapest schedule an omniscient scheduler could run on a spot trace
with the levers the cost policies have (``bench/cost_policies.py --oracle`` sets it beside them).

The model (what ``services.control.simulate.world`` simulates, seen from above):

- ``N = iterations`` training jobs, each ``T = training_minutes`` of update on the training
  instance type, one at a time; job ``j`` is *launched* at ``L_j``, when batch ``j`` is complete.
- Batch ``j + 1`` is generated between ``L_j`` and ``L_{j+1}``: ``plan`` publishes prompts one
  batch ahead of the trainer, so the next batch's prompts come when a job is launched; with a
  staleness bound of 0 only from the job's end (what is made while it trains is dropped). The
  first batch is generated from the rollout workers' start-up ``S`` on.
- Rollout is a fluid: a batch is ``D = batch_samples / rate`` worker-seconds of generation, done
  by at most ``max_workers`` workers at a time, of which at most the trace's spot capacity on
  spot (each second at the catalog's spot price, or the trace's price of that tick), the rest
  on-demand. A window's spot seconds are used first, in time order; on-demand fills the rest.
- A training node (billed per second at its capacity's price) is either *held* from one job's
  end to the next launch (a standby, or the node a job left: its idle seconds are billed, and the
  next job starts at its launch, on the node's capacity), or a *new* machine, which bills its
  start-up ``S`` once: launched up to ``S`` before a launch (a standby warming up) or at it (a
  cold start), so that its job starts anywhere from its launch to ``S`` after. So a job after a
  gap ``g`` pays ``min(g, S)`` of node time, and a new machine lets its job end as the next batch
  completes. The first job pays ``S``.
- Spot training (``training_capacity`` spot or auto, and a ``training_trace``): a job may run on a
  node of the training trace instead, at the training type's spot price (the catalog's, or the
  training trace's of each tick). A job whose update meets no tick of the trace without a node
  costs ``T`` at spot. One that does is preempted there and keeps its update (with
  ``spot_notice_seconds`` 0, only its last periodic checkpoint, every
  ``training.checkpoint_every_s`` of the attempt), then either *waits*: the trace's next node, a
  restart's start-up ``S`` on it and the update left, and so at each later preemption; or
  *switches*: a new on-demand node at once, ``S`` and the update left at on-demand. A spot job
  launched while the trace has no node waits for one and starts it up then.
- Back to back (a staleness bound of 1 or more): two jobs may run as a *pair* on one node, the
  second taking the node the first leaves at once. The pair's two batches are generated in one
  window, from the launch before it to the second job's launch; the first job starts a job's time
  before that launch, on a new node (on-demand, or spot where the training trace has a node from
  its start-up to the second job's end), after the job before it has ended.
- The run ends with the last job, before the deadline (if any) and the workload's horizon.
- A job of several nodes (``training_nodes``) is one "node" here at their summed price: they boot
  at once, and on the training trace a cell has it only with that many nodes free.

The optimum is a dynamic program over the jobs (a pair's second job reached from the job before
the pair, with twice the work in its window: ``_next_pair``), its state a job's launch on a grid of
``step_seconds`` and how the job ran (``Ran``: on-demand or on spot without a preemption, its
node held or new; or on spot with one, waited or switched): each job's value is a min over the
previous job's launches and states of a held node's gap or a new machine's ``S``, plus the
cheapest generation of its batch in between, plus the job's own node time. The transitions to a
new machine are one sliding-window minimum over the previous launches per kind of end (a
window's generation costs a function of where it starts plus one of where it ends, split at
where spot capacity alone covers the batch), so a job costs O(grid x (T + 2 S) / step) and a
run N times that (a few seconds a trace on the bench's workload).

Approximations, each making the optimum cheaper than the simulator can be unless it says otherwise:

- generation is a fluid: no group lost to a preemption, no worker idle for a prompt, whole
  workers and groups not required; rollout workers' start-ups are not billed (a pool held
  across batches pays them once: some cents a run on the bench's workload) nor do they take
  spot capacity while they start;
- a spot worker may go on for ``spot_notice_seconds`` after its capacity went, as a preempted
  one does: capacity is the trace's most over that notice (also for a worker launched within it);
- the prompts of the next batch come at the launch, not the tick after; the billed minimum is
  not added (a machine runs at least ``S + T``);
- a pair's first job may start before its own batch is complete (only the two batches together
  must be by the second launch), and the pair's second batch may be begun before the job before
  the pair has ended;
- with a staleness bound of 0, the next batch is taken to start at the earliest end of the job
  (``T`` after its launch) even where the new machine chose a later one or a preemption delayed it;
- a spot training node held between jobs, or warming up before its launch, is not preempted
  there (a start-up before the launch is priced at the launch's tick);
- a spot job that met a preemption (or waited for its first node): the next launch may come as
  soon as the earliest end of this job or of any later launch of it (ends made monotone in the
  launch: at most ``S`` early, next to a drop), and a node held after it idles unbilled for up
  to ``4 S`` (the simulator ends such a job a tick or two later than the model, or two start-ups
  later where it waited for spot before going on-demand);
- with ``training_capacity`` spot, the oracle may still train on-demand (the simulator never does);
- launches lie on the grid of ``step_seconds`` (the simulator's on its tick, 10 s): a node gap
  between grid points is not available (at most ``step_seconds`` of a node per job). This one
  errs dear;
- on a trace with prices, a window's spot seconds are used in time order, not cheapest first.
  This one errs either way;
- a spot job switches to on-demand only at its first preemption: where a deadline hurries a job
  that meets two preemptions or more, the simulator's later switch may cost less than both the
  oracle's waiting (too late) and its early switch. This one errs dear, only there.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, replace
from enum import IntEnum

from contracts.training import TrainingCapacity
from services.control.cost.billing import RolloutTerms
from services.control.cost.lower_bound import Busy, lower_bound_dollars
from services.control.simulate.traces import SpotTrace
from services.control.simulate.workload import Workload
from services.domain.names import ROLE_ROLLOUT, ROLE_TRAINING
from services.domain.runspec import CostPolicy
from services.ports.prices.catalog import PriceCatalog, load_catalog

_EPS = 1e-9
# How a job's node came: held from the previous job (starts at launch), new (pays S), or the node of
# the first job of a pair whose second it is (the pair's two batches generated in one window).
HELD, NEW, PAIRED = 0, 1, 2
# A node held after a job that switched to on-demand idles unbilled this many start-ups (see the docstring).
_FREE_HOLD_STARTUPS = 4.0


class Ran(IntEnum):
    """How a job ran: with its launch, a state of the dynamic program."""

    ON_DEMAND_HELD = 0  # on-demand, on the node the last job left (it starts at its launch)
    ON_DEMAND_NEW = 1  # on-demand, on a new node (its start-up billed; it starts within S of its launch)
    SPOT_HELD = 2  # on spot and met no preemption, on the spot node the last job left
    SPOT_NEW = 3  # on spot and met no preemption, on a new spot node
    WAITED = 4  # on spot, met a preemption (or waited for its first node) and waited for spot each time
    SWITCHED = 5  # on spot until its first preemption, then on a new on-demand node

    @property
    def disrupted(self) -> bool:
        """Met a preemption (or waited for a node): its end is the spot walk's, not ``T`` after its launch."""
        return self >= Ran.WAITED


_CLEAN = (Ran.ON_DEMAND_HELD, Ran.ON_DEMAND_NEW, Ran.SPOT_HELD, Ran.SPOT_NEW)


@dataclass(frozen=True)
class OracleBatch:
    """One training job and the generation of its batch, in seconds from the run's start."""

    launch: float  # the batch is complete and its job launched
    generated_from: float  # its batch's generation window's start
    job_start: float  # its update's start (on a spot node that waited for one: when that node was up)
    spot_seconds: float  # generation worker-seconds on spot capacity
    on_demand_seconds: float  # and on on-demand
    new_node: bool  # the job's node is a new machine (start-up billed), else one held from the last job
    ran: Ran = Ran.ON_DEMAND_NEW  # on which capacity, and what preemptions did to it
    job_end: float = 0.0
    training_preemptions: int = 0  # the job's spot node taken back while it trained


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

    @property
    def spot_jobs(self) -> int:
        """Jobs that started on a spot training node."""
        return sum(b.ran not in (Ran.ON_DEMAND_HELD, Ran.ON_DEMAND_NEW) for b in self.batches)

    @property
    def training_preemptions(self) -> int:
        return sum(b.training_preemptions for b in self.batches)


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
    share: float = 1.0,
) -> _Capacity:
    """The spot workers a schedule may use in each of ``cells`` cells of ``step`` seconds (the
    trace's capacity at the cell's start): the most over the ``notice_seconds`` before it (a
    preempted worker works on through its notice), at most ``most``, none where spot costs
    ``on_demand_price`` or more (per hour, as ``spot_price``, the catalog's when the trace has no prices);
    a worker pays ``share`` of a node's price (``RolloutTerms``)."""
    raw = [trace.at(i * step) for i in range(cells)]
    notice = math.ceil(notice_seconds / step - _EPS)
    spot_sums, dollar_sums = [0.0], [0.0]
    for i in range(cells):
        price = trace.price_at(i * step) if trace.prices is not None else spot_price
        n = min(most, max(raw[max(0, i - notice) : i + 1])) if price < on_demand_price else 0
        spot_sums.append(spot_sums[-1] + n * step)
        dollar_sums.append(dollar_sums[-1] + n * step * price * share / 3600.0)
    return _Capacity(step, tuple(spot_sums), tuple(dollar_sums))


@dataclass(frozen=True)
class _SpotNodes:
    """The training trace on the grid: whether cell ``i`` has a node (its capacity at the cell's
    start), and one node's spot dollars cumulated from 0 to each cell's start."""

    step: float
    up: tuple[bool, ...]
    dollars: tuple[float, ...]  # len(up) + 1 sums
    next_down: tuple[int, ...]  # the first cell at or after each without a node (len(up): none)
    next_up: tuple[int, ...]  # the first cell at or after each with one (len(up): none)
    flat_per_s: float | None  # the price per second where the trace carries none (the catalog's)

    @classmethod
    def of(cls, trace: SpotTrace, step: float, cells: int, spot_price: float, nodes: int = 1) -> _SpotNodes:
        """``nodes``: a job's nodes, which a cell has only with that much capacity, and which are its
        "node" here (their summed price; ``spot_price`` is one's)."""
        up = tuple(trace.at(i * step) >= nodes for i in range(cells))
        sums = [0.0]
        for i in range(cells):
            price = trace.price_at(i * step) if trace.prices is not None else spot_price
            sums.append(sums[-1] + step * price * nodes / 3600.0)
        next_down, next_up = [cells] * (cells + 1), [cells] * (cells + 1)
        for i in range(cells - 1, -1, -1):
            next_down[i] = next_down[i + 1] if up[i] else i
            next_up[i] = i if up[i] else next_up[i + 1]
        flat = None if trace.prices is not None else spot_price * nodes / 3600.0
        return cls(step, up, tuple(sums), tuple(next_down), tuple(next_up), flat)

    def gap_dollars(self, t: float, gap: float) -> float:
        """One spot node's dollars for the ``gap`` seconds before ``t``."""
        return gap * self.flat_per_s if self.flat_per_s is not None else self.dollars_between(t - gap, t)

    def dollars_between(self, a: float, b: float) -> float:
        """One spot node's dollars from ``a`` to ``b`` seconds (each cell's seconds at its price)."""
        return self._at(b) - self._at(a)

    def price_per_s(self, cell: int) -> float:
        """One spot node's dollars per second in cell ``cell``."""
        cell = min(cell, len(self.dollars) - 2)
        return (self.dollars[cell + 1] - self.dollars[cell]) / self.step

    def _at(self, t: float) -> float:
        sums, i = self.dollars, min(max(0, int(t // self.step)), len(self.dollars) - 2)
        return sums[i] + (sums[i + 1] - sums[i]) * (t - i * self.step) / self.step


@dataclass(frozen=True)
class _SpotJob:
    """A spot job launched at a grid point, as the training trace lets it run (dollars of its own
    node time: its first start-up only where it waited for its first node, restarts always)."""

    clean: bool  # a node up at its launch and through its update: T at spot
    startup: float  # a new node's start-up before the launch (0 where it waited for its first node)
    start: float  # its update's start
    waited: float  # dollars, waiting for spot at each preemption
    waited_end: float
    preemptions: int  # waiting so
    switched: float  # dollars, going on-demand at its first preemption (inf: it meets none)
    switched_end: float


def _spot_jobs(
    nodes: _SpotNodes,
    launches: int,
    *,
    train_s: float,
    startup_s: float,
    od_per_s: float,
    notice_s: float,
    checkpoint_every_s: float,
    end_by: float,
) -> list[_SpotJob]:
    """Each launch's spot job (the module's model): the update run in the attempts the trace allows."""
    step, cells = nodes.step, len(nodes.up)
    jobs = []
    for c in range(launches):
        i = c
        if nodes.up[c]:
            start, ready, startup = c * step, c * step, startup_s * nodes.price_per_s(c)
        else:  # its first node comes when the trace has one, and starts up then
            i = nodes.next_up[c]
            start, ready, startup = i * step, i * step + startup_s, 0.0
        first_ready = ready
        left, dollars, preemptions = train_s, 0.0, 0
        switched = switched_end = waited = waited_end = math.inf
        while i < cells:
            down = nodes.next_down[i]
            drop = down * step if down < cells else math.inf
            if drop >= ready + left - _EPS:
                waited_end = ready + left
                waited = dollars + nodes.dollars_between(start, waited_end)
                break
            dollars += nodes.dollars_between(start, drop)
            done = max(0.0, drop - ready)
            left -= done if notice_s > 0 else math.floor(done / checkpoint_every_s + _EPS) * checkpoint_every_s
            preemptions += 1
            if preemptions == 1:
                switched, switched_end = dollars + od_per_s * (startup_s + left), drop + startup_s + left
            i = nodes.next_up[down]
            start, ready = i * step, i * step + startup_s
        if waited_end > end_by + _EPS:
            waited = waited_end = math.inf
        if switched_end > end_by + _EPS:
            switched = switched_end = math.inf
        clean = nodes.up[c] and preemptions == 0
        jobs.append(_SpotJob(clean, startup, first_ready, waited, waited_end, preemptions, switched, switched_end))
    return jobs


@dataclass(frozen=True)
class _Model:
    """A run's figures in seconds and dollars per second, its trace's spot capacity and (with spot
    training) each launch's spot job; with the generation windows' job-independent sums."""

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
    end_by: float
    cap: _Capacity
    spot_jobs: tuple[_SpotJob, ...] | None  # per launch; None: no spot training
    spot_nodes: _SpotNodes | None
    # Per launch c, the window that starts after it (c x step + shift): the capacity's sums there,
    # and what a batch spot alone covers costs from there.
    spot_s: tuple[float, ...] = ()
    dollars_s: tuple[float, ...] = ()
    covered: tuple[float, ...] = ()

    @property
    def first(self) -> int:
        """The fewest grid steps from a launch to the next: the job (``T``) done and the window long
        enough for ``most`` workers."""
        return max(1, self.after_train, self.after_work)

    @property
    def after_train(self) -> int:
        return math.ceil(self.train_s / self.step - _EPS)

    @property
    def after_work(self) -> int:
        return math.ceil((self.work_s / self.most + self.shift) / self.step - _EPS)

    def with_windows(self) -> _Model:
        starts = [c * self.step + self.shift for c in range(self.launches)]
        spot_s = tuple(self.cap.spot_at(t) for t in starts)
        dollars_s = tuple(self.cap.dollars_at(t) for t in starts)
        covered = tuple(_covered(self, s, d) for s, d in zip(spot_s, dollars_s, strict=True))
        return replace(self, spot_s=spot_s, dollars_s=dollars_s, covered=covered)


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


def _between(m: _Model, c: int, end: int) -> float:
    """The generation's dollars of the batch between launch ``c`` and launch ``end`` (long enough for ``most``)."""
    spot = m.cap.spot[end] - m.spot_s[c]
    if spot >= m.work_s - _EPS:
        return m.covered[c]
    return m.cap.dollars[end] - m.dollars_s[c] + m.od_per_s * (m.work_s - spot)


def _job_dollars(m: _Model, c: int, ran: Ran) -> float:
    """A job's own node time at launch ``c`` (its update, and on spot its restarts), no start-up or gap."""
    if ran in (Ran.ON_DEMAND_HELD, Ran.ON_DEMAND_NEW):
        return m.train_s * m.node_per_s
    job = m.spot_jobs[c]
    return job.switched if ran == Ran.SWITCHED else job.waited


def _job_end(m: _Model, c: int, ran: Ran) -> float:
    """A job's end as the transitions after it take it (a new node's job may end up to ``S`` later)."""
    if ran == Ran.WAITED:
        return m.spot_jobs[c].waited_end
    if ran == Ran.SWITCHED:
        return m.spot_jobs[c].switched_end
    return c * m.step + m.train_s


def _new_node_windows(m: _Model, best: list[float], hi: list[int]) -> tuple[list[float], list[int]]:
    """For each launch ``end``: the least of ``best[c]`` plus the generation between ``c`` and
    ``end``, over ``c <= hi[end]`` (``hi`` nondecreasing), and its ``c``. Split at alpha(end), the
    last ``c`` whose window spot covers: covered ones by a prefix minimum, the others by a sliding one."""
    k = m.launches
    inf = math.inf
    prefix, prefix_at = [inf] * k, [-1] * k
    for c in range(k):
        v = best[c] + m.covered[c]
        if c and prefix[c - 1] <= v:
            prefix[c], prefix_at[c] = prefix[c - 1], prefix_at[c - 1]
        else:
            prefix[c], prefix_at[c] = v, c
    uncovered = [b - d + m.od_per_s * s for b, d, s in zip(best, m.dollars_s, m.spot_s, strict=True)]
    out, out_at = [inf] * k, [-1] * k
    window: deque[int] = deque()
    alpha, pushed = -1, 0
    for end in range(k):
        h = hi[end]
        if h < 0:
            continue
        while pushed <= h:
            while window and uncovered[window[-1]] > uncovered[pushed]:  # ties: the earliest launch
                window.pop()
            window.append(pushed)
            pushed += 1
        while alpha + 1 < k and m.spot_s[alpha + 1] <= m.cap.spot[end] - m.work_s + _EPS:
            alpha += 1
        while window and window[0] <= alpha:
            window.popleft()
        v, c = inf, -1
        if alpha >= 0:
            v, c = prefix[min(alpha, h)], prefix_at[min(alpha, h)]
        if window:
            cost = uncovered[window[0]] + m.cap.dollars[end] + m.od_per_s * (m.work_s - m.cap.spot[end])
            if cost < v or (cost == v and window[0] < c):
                v, c = cost, window[0]
        out[end], out_at[end] = v, c
    return out, out_at


def _hi_after(m: _Model, ends: list[float]) -> list[int]:
    """For each launch: the last earlier launch whose job (ending at ``ends``, made monotone: the
    least end of it and any later launch) has ended, and whose window fits the batch."""
    k, lead = m.launches, max(1, m.after_work)
    cells = [math.ceil(e / m.step - _EPS) if e < math.inf else k for e in ends]
    for c in range(k - 2, -1, -1):
        cells[c] = min(cells[c], cells[c + 1])
    hi, last = [-1] * k, -1
    for end in range(k):
        while last + 1 < k and cells[last + 1] <= end:
            last += 1
        hi[end] = min(last, end - lead)
    return hi


def _cheapest_clean(value: list[list[float]]) -> tuple[list[float], list[Ran]]:
    """Per launch, the least value over the states of a job that met no preemption, and that state."""
    k = len(value[0])
    clean, clean_ran = [math.inf] * k, [Ran.ON_DEMAND_HELD] * k
    for ran in _CLEAN:
        for c, v in enumerate(value[ran]):
            if v < clean[c]:
                clean[c], clean_ran[c] = v, ran
    return clean, clean_ran


Parent = tuple[int, Ran, int]  # the previous job's launch and state, and this job's node (HELD or NEW)


def _next_job(m: _Model, value: list[list[float]]) -> tuple[list[list[float]], list[list[Parent | None]]]:
    """One step of the dynamic program: from the values of job ``j``'s launches in each state to
    job ``j + 1``'s, with each one's parent."""
    inf, k, step = math.inf, m.launches, m.step
    out = [[inf] * k for _ in Ran]
    parent: list[list[Parent | None]] = [[None] * k for _ in Ran]
    spot_jobs = m.spot_jobs
    job_od, startup_od = m.train_s * m.node_per_s, m.startup_s * m.node_per_s

    def spot_job(c2: int, base: float, came: Parent) -> None:
        """Job ``j + 1`` on spot at ``c2``, its node (``came``) costing ``base`` with the generation."""
        job = spot_jobs[c2]
        node_new = came[2] == NEW
        if node_new:
            base += job.startup
        offers = (
            ((Ran.SPOT_NEW if node_new else Ran.SPOT_HELD, job.waited),)
            if job.clean
            else ((Ran.WAITED, job.waited), (Ran.SWITCHED, job.switched))
        )
        for ran, dollars in offers:
            v = base + dollars
            if v < out[ran][c2]:
                out[ran][c2], parent[ran][c2] = v, came

    # A new node: after any state, its end as each kind of job ends.
    clean, clean_ran = _cheapest_clean(value)
    first = m.first
    groups = [(clean, clean_ran, [end - first for end in range(k)])]
    if spot_jobs is not None:
        for ran in (Ran.WAITED, Ran.SWITCHED):
            ends = [math.inf if spot_jobs[c].clean else _job_end(m, c, ran) for c in range(k)]
            groups.append((value[ran], [ran] * k, _hi_after(m, ends)))
    base, base_from = [inf] * k, [None] * k
    for best, rans, hi in groups:
        vals, at = _new_node_windows(m, best, hi)
        for end in range(k):
            if vals[end] < base[end]:
                base[end], base_from[end] = vals[end], (at[end], rans[at[end]])
    for end in range(k):
        if base[end] == inf:
            continue
        c, ran = base_from[end]
        out[Ran.ON_DEMAND_NEW][end] = base[end] + startup_od + job_od
        parent[Ran.ON_DEMAND_NEW][end] = (c, ran, NEW)
        if spot_jobs is not None:
            spot_job(end, base[end], (c, ran, NEW))

    # A held node after a job that met no preemption: it idles from the job's end to this launch,
    # for less than S (else a new one is cheaper). A held node's job started at its launch, a new
    # node's up to S after: a held launch comes less than T + 2 S after the last one.
    od_held, od_new = value[Ran.ON_DEMAND_HELD], value[Ran.ON_DEMAND_NEW]
    spot_held, spot_new = value[Ran.SPOT_HELD], value[Ran.SPOT_NEW]
    nodes = m.spot_nodes
    startup_s, od_per_s = m.startup_s, m.node_per_s
    last_held = math.ceil((m.train_s + 2 * startup_s) / step - _EPS)
    # Per grid steps back to the last launch: the node's gap after a held node's job (it started
    # at its launch) and after a new node's (it started up to S after), earliest launch first.
    backs = []
    for back in range(last_held, first - 1, -1):
        gap_held = back * step - m.train_s
        backs.append((back, gap_held, max(0.0, gap_held - startup_s)))
    for end in range(first, k):
        t = end * step
        clean = spot_jobs is not None and spot_jobs[end].clean
        for back, gap_held, gap_new in backs:  # earliest first: ties keep it
            if back > end:
                continue
            c = end - back
            v, gap, ran = od_new[c], gap_new, Ran.ON_DEMAND_NEW
            if gap_held < startup_s and od_held[c] + gap_held * od_per_s < v + gap_new * od_per_s:
                v, gap, ran = od_held[c], gap_held, Ran.ON_DEMAND_HELD
            od = v + gap * od_per_s if v < inf and gap < startup_s else inf
            sp, sp_ran = inf, Ran.SPOT_NEW
            if nodes is not None and (spot_new[c] < inf or spot_held[c] < inf):
                if gap_new < startup_s:
                    sp = spot_new[c] + nodes.gap_dollars(t, gap_new)
                if gap_held < startup_s and (h := spot_held[c] + nodes.gap_dollars(t, gap_held)) < sp:
                    sp, sp_ran = h, Ran.SPOT_HELD
            if od == inf and sp == inf:
                continue
            dollars = _between(m, c, end)
            if od + dollars + job_od < out[Ran.ON_DEMAND_HELD][end]:
                out[Ran.ON_DEMAND_HELD][end] = od + dollars + job_od
                parent[Ran.ON_DEMAND_HELD][end] = (c, ran, HELD)
            if sp == inf:
                continue
            if clean:
                if (v := sp + dollars + spot_jobs[end].waited) < out[Ran.SPOT_HELD][end]:
                    out[Ran.SPOT_HELD][end], parent[Ran.SPOT_HELD][end] = v, (c, sp_ran, HELD)
            else:
                spot_job(end, sp + dollars, (c, sp_ran, HELD))

    # A held node after a job that met a preemption: after one that waited, its spot node idles from
    # the job's end, for less than S; after one that switched, its on-demand node idles unbilled
    # for a while (the docstring).
    if spot_jobs is not None:
        lead = max(1, m.after_work)
        for ran in (Ran.WAITED, Ran.SWITCHED):
            for c, v in enumerate(value[ran]):
                if v == inf:
                    continue
                job_end = _job_end(m, c, ran)
                lo = max(c + lead, math.ceil(job_end / step - _EPS))
                last = job_end + (m.startup_s if ran == Ran.WAITED else _FREE_HOLD_STARTUPS * m.startup_s)
                for end in range(lo, min(k, math.ceil(last / step - _EPS))):
                    here = v + _between(m, c, end)
                    if ran == Ran.WAITED:
                        spot_job(end, here + nodes.gap_dollars(end * step, end * step - job_end), (c, ran, HELD))
                    elif here + job_od < out[Ran.ON_DEMAND_HELD][end]:
                        out[Ran.ON_DEMAND_HELD][end] = here + job_od
                        parent[Ran.ON_DEMAND_HELD][end] = (c, ran, HELD)
    return out, parent


def _pair_ends(m: _Model, c: int) -> tuple[float, float]:
    """A pair whose second job is launched at ``c``: its first job's node comes up (its launch, a
    start-up before the first job starts) and the second job's end."""
    launch = c * m.step
    return launch - m.train_s - m.startup_s, launch + m.train_s


def _pair_spot_dollars(m: _Model, c: int) -> float:
    """A pair on one spot training node (second launch ``c``): its start-up and both jobs at spot,
    where the training trace has a node throughout (inf where it has not)."""
    nodes = m.spot_nodes
    if nodes is None:
        return math.inf
    up, end = _pair_ends(m, c)
    first, last = math.floor(up / m.step + _EPS), math.ceil(end / m.step - _EPS)
    if up < 0 or last > len(nodes.up) or nodes.next_down[first] < last:
        return math.inf
    return nodes.dollars_between(up, end)


def _next_pair(
    m: _Model, pair_m: _Model, value: list[list[float]]
) -> tuple[list[list[float]], list[list[Parent | None]]]:
    """Back to back: the values of the second job of a pair (jobs ``j + 1`` and ``j + 2``) from job
    ``j``'s. The pair's two batches are generated in one window from job ``j``'s launch (``pair_m``:
    twice the work) to the second job's launch; the first job runs on a new node (on-demand, or on
    spot where the training trace has a node throughout) the job's time before that launch, and the
    second on the node it leaves. Its own batch being complete before it starts is not required
    (it errs cheap); job ``j`` has ended before the first job's node is launched."""
    inf, k, step = math.inf, m.launches, m.step
    out = [[inf] * k for _ in Ran]
    parent: list[list[Parent | None]] = [[None] * k for _ in Ran]
    before = math.ceil((2 * m.train_s + m.startup_s) / step - _EPS)  # a clean job's launch to the pair's second
    clean, clean_ran = _cheapest_clean(value)
    groups = [(clean, clean_ran, [end - max(before, pair_m.after_work, 1) for end in range(k)])]
    if m.spot_jobs is not None:
        for ran in (Ran.WAITED, Ran.SWITCHED):
            ends = [
                math.inf if m.spot_jobs[c].clean else _job_end(m, c, ran) + m.train_s + m.startup_s for c in range(k)
            ]
            groups.append((value[ran], [ran] * k, _hi_after(pair_m, ends)))
    node_od = (m.startup_s + 2 * m.train_s) * m.node_per_s
    for best, rans, hi in groups:
        vals, at = _new_node_windows(pair_m, best, hi)
        for end in range(k):
            if vals[end] == inf:
                continue
            came = (at[end], rans[at[end]], PAIRED)
            if vals[end] + node_od < out[Ran.ON_DEMAND_HELD][end]:
                out[Ran.ON_DEMAND_HELD][end], parent[Ran.ON_DEMAND_HELD][end] = vals[end] + node_od, came
            spot = _pair_spot_dollars(m, end)
            if vals[end] + spot < out[Ran.SPOT_HELD][end]:
                out[Ran.SPOT_HELD][end], parent[Ran.SPOT_HELD][end] = vals[end] + spot, came
    return out, parent


def oracle(
    trace: SpotTrace,
    workload: Workload = Workload(),
    catalog: PriceCatalog | None = None,
    step_seconds: float = 30.0,
    training_trace: SpotTrace | None = None,
) -> OracleResult:
    """The cheapest schedule of ``workload`` on ``trace`` (spot rollout nodes) and, where the
    workload's ``training_capacity`` lets jobs run on spot, ``training_trace`` (spot training
    nodes; None: none ever) (the module's model), launches on a grid of ``step_seconds`` (best a
    divisor of the traces' ticks, the start-up and the training time)."""
    catalog = catalog or load_catalog()
    w = workload
    currency = catalog.currency_of([w.rollout_instance_type, w.training_instance_type])
    spec = w.spec(CostPolicy.COST_AWARE)
    rollout, node = catalog.get(w.rollout_instance_type), catalog.get(w.training_instance_type)
    share = RolloutTerms(spec.rollout.gpus_per_worker).share(ROLE_ROLLOUT, rollout)
    # A job of several nodes is one "node" of their summed price, its nodes all booting at once.
    training = replace(node, on_demand=node.on_demand * w.training_nodes, spot=node.spot * w.training_nodes)
    train_s, startup_s = w.training_minutes * 60.0, w.startup_seconds
    work_s = w.batch_samples / (w.worker_samples_per_hour / 3600.0)
    jobs = spec.iterations or 0
    end_by = (
        w.horizon_days * 86400.0 if w.deadline_seconds is None else min(w.horizon_days * 86400.0, w.deadline_seconds)
    )
    launches = max(0, math.floor((end_by - train_s) / step_seconds + _EPS) + 1)
    shift = train_s if spec.staleness_bound == 0 else 0.0
    cells = launches + math.ceil(shift / step_seconds) + 2
    spot_training = spec.training.capacity != TrainingCapacity.ON_DEMAND and training_trace is not None
    nodes = (
        _SpotNodes.of(training_trace, step_seconds, math.ceil(end_by / step_seconds) + 2, node.spot, w.training_nodes)
        if spot_training
        else None
    )
    m = _Model(
        step=step_seconds,
        jobs=jobs,
        train_s=train_s,
        startup_s=startup_s,
        work_s=work_s,
        most=spec.rollout.max_workers,
        node_per_s=training.on_demand / 3600.0,
        od_per_s=rollout.on_demand * share / 3600.0,
        shift=shift,
        launches=launches,
        end_by=end_by,
        cap=spot_capacity(
            trace,
            step_seconds,
            cells,
            most=spec.rollout.max_workers if spec.rollout.spot else 0,
            notice_seconds=w.spot_notice_seconds,
            spot_price=rollout.spot,
            on_demand_price=rollout.on_demand,
            share=share,
        ),
        spot_jobs=None
        if nodes is None
        else tuple(
            _spot_jobs(
                nodes,
                launches,
                train_s=train_s,
                startup_s=startup_s,
                od_per_s=training.on_demand / 3600.0,
                notice_s=w.spot_notice_seconds,
                checkpoint_every_s=spec.training.checkpoint_every_s,
                end_by=end_by,
            )
        ),
        spot_nodes=nodes,
    ).with_windows()
    lower_bound = _lower_bound(trace, training_trace, w, catalog, spec.training.capacity, jobs * work_s, jobs * train_s)
    unfinished = OracleResult(currency, math.inf, math.inf, round(lower_bound, 4), math.inf, math.inf, (), False)
    if jobs == 0 or launches == 0:
        return unfinished

    # The first job: its batch generated from the workers' start-up on, its node new.
    first_spot, first_dollars = m.cap.spot_at(startup_s), m.cap.dollars_at(startup_s)
    value = [[math.inf] * launches for _ in Ran]
    for c in range(launches):
        dollars = _window(m, startup_s, first_spot, first_dollars, c)[0]
        value[Ran.ON_DEMAND_NEW][c] = dollars + startup_s * m.node_per_s + train_s * m.node_per_s
        if m.spot_jobs is not None:
            job = m.spot_jobs[c]
            if job.clean:
                value[Ran.SPOT_NEW][c] = dollars + job.startup + job.waited
            else:
                value[Ran.WAITED][c] = dollars + job.startup + job.waited
                value[Ran.SWITCHED][c] = dollars + job.startup + job.switched
    pair_m = replace(m, work_s=2 * m.work_s).with_windows() if spec.staleness_bound >= 1 else None
    values, parents = [value], []
    for j in range(1, jobs):
        value, parent = _next_job(m, values[-1])
        if pair_m is not None and j >= 2:  # the second job of a pair whose first follows job j - 2
            paired, pair_parent = _next_pair(m, pair_m, values[-2])
            for ran in (Ran.ON_DEMAND_HELD, Ran.SPOT_HELD):
                for c, v in enumerate(paired[ran]):
                    if v < value[ran][c]:
                        value[ran][c], parent[ran][c] = v, pair_parent[ran][c]
        values.append(value)
        parents.append(parent)
    # The last job ends within the deadline and horizon; of the schedules within float noise of the
    # cheapest, the one that ends first.
    ends = [
        (v, _job_end(m, c, ran), ran, c)
        for ran in Ran
        for c, v in enumerate(value[ran])
        if v < math.inf and _job_end(m, c, ran) <= end_by + _EPS
    ]
    if not ends:
        return unfinished
    cheapest = min(v for v, *_ in ends)
    total, _, ran, last = min(
        (e for e in ends if e[0] <= cheapest + 1e-9 * (1 + cheapest)), key=lambda e: (e[1], e[2], e[3])
    )
    chain: list[tuple[int, Ran, int]] = []
    c, state, j = last, ran, jobs - 1
    while j > 0:
        prev_c, prev_ran, node = parents[j - 1][state][c]
        chain.append((c, state, node))
        if node == PAIRED:  # its first job is the one before it, on its node: both come from job j - 2
            j -= 1
            chain.append((c, state, PAIRED))
        c, state, j = prev_c, prev_ran, j - 1
    chain.append((c, state, NEW))
    chain.reverse()
    return _result(m, pair_m, chain, total, currency, lower_bound)


def _lower_bound(
    trace: SpotTrace,
    training_trace: SpotTrace | None,
    w: Workload,
    catalog: PriceCatalog,
    capacity: TrainingCapacity,
    rollout_busy: float,
    training_busy: float,
) -> float:
    """The simulator's lower bound (``services.control.cost.lower_bound``) of the run's busy seconds."""
    rollout, training = catalog.get(w.rollout_instance_type), catalog.get(w.training_instance_type)
    if trace.prices is not None:  # the cheapest spot tick's: no schedule pays less for a busy second
        rollout = replace(rollout, spot=trace.cheapest_price())
    if training_trace is not None and training_trace.prices is not None:
        training = replace(training, spot=training_trace.cheapest_price())
    share = RolloutTerms(w.gpus_per_worker).share(ROLE_ROLLOUT, rollout)
    busy = [
        Busy(ROLE_ROLLOUT, rollout_busy, rollout, share),
        Busy(ROLE_TRAINING, training_busy * w.training_nodes, training),
    ]
    return lower_bound_dollars(busy, capacity != TrainingCapacity.ON_DEMAND)


def _result(
    m: _Model,
    pair_m: _Model | None,
    chain: list[tuple[int, Ran, int]],
    total: float,
    currency: str,
    lower_bound: float,
) -> OracleResult:
    """The schedule of the launches, states and nodes ``chain`` (the dynamic program's), its costs recounted."""
    batches: list[OracleBatch] = []
    node_dollars = rollout_dollars = 0.0
    job_end = -math.inf
    j = 0
    while j < len(chain):
        c, ran, node = chain[j]
        launch = c * m.step
        start = m.startup_s if j == 0 else chain[j - 1][0] * m.step + m.shift
        if node == PAIRED:  # a pair: this job and the next, launched at ``c`` on its node (``_next_pair``)
            assert pair_m is not None
            dollars, spot = _window(pair_m, start, m.cap.spot_at(start), m.cap.dollars_at(start), c)
            rollout_dollars += dollars
            on_spot = ran == Ran.SPOT_HELD
            node_dollars += _pair_spot_dollars(m, c) if on_spot else (m.startup_s + 2 * m.train_s) * m.node_per_s
            up, job_end = _pair_ends(m, c)
            first_spot = min(spot, m.work_s)
            first_ran = Ran.SPOT_NEW if on_spot else Ran.ON_DEMAND_NEW
            batches.append(
                OracleBatch(up, start, launch - m.train_s, first_spot, m.work_s - first_spot, True, first_ran, launch)
            )
            second_spot = spot - first_spot
            batches.append(OracleBatch(launch, start, launch, second_spot, m.work_s - second_spot, False, ran, job_end))
            j += 2
            continue
        dollars, spot = _window(m, start, m.cap.spot_at(start), m.cap.dollars_at(start), c)
        rollout_dollars += dollars
        on_spot = ran not in (Ran.ON_DEMAND_HELD, Ran.ON_DEMAND_NEW)
        preemptions = 0
        if node == NEW:
            node_dollars += m.spot_jobs[c].startup if on_spot else m.startup_s * m.node_per_s
        elif chain[j - 1][1] != Ran.SWITCHED:  # the node idled from the last job's end (after a switch: unbilled)
            gap = launch - job_end
            node_dollars += m.spot_nodes.gap_dollars(launch, gap) if on_spot else gap * m.node_per_s
        node_dollars += _job_dollars(m, c, ran)
        if ran.disrupted:
            job = m.spot_jobs[c]
            job_start, job_end = job.start, _job_end(m, c, ran)
            preemptions = job.preemptions if ran == Ran.WAITED else 1
        elif node == NEW:
            # A new node's job starts as late as lets it end by the next launch (at most S after its own).
            following = chain[j + 1] if j + 1 < len(chain) else None
            slack = 0.0 if following is None or following[2] != HELD else following[0] * m.step - launch - m.train_s
            job_start = launch + min(m.startup_s, max(0.0, slack))
            job_end = job_start + m.train_s
        else:
            job_start, job_end = launch, launch + m.train_s
        batches.append(
            OracleBatch(launch, start, job_start, spot, m.work_s - spot, node == NEW, ran, job_end, preemptions)
        )
        j += 1
    dollars = node_dollars + rollout_dollars
    assert math.isclose(dollars, total, rel_tol=1e-9, abs_tol=1e-6), (
        "the schedule recounted costs what the dynamic program found"
    )
    return OracleResult(
        currency=currency,
        dollars=round(dollars, 4),
        wall_seconds=round(job_end, 1),
        lower_bound_dollars=round(lower_bound, 4),
        training_dollars=round(node_dollars, 4),
        rollout_dollars=round(rollout_dollars, 4),
        batches=tuple(batches),
    )
