"""Run operations behind the routes: keyword-only functions over the backends, no HTTP here.

Every function takes the caller (``Principal``): a tenant sees, lists and cancels its own runs
only, and another tenant's run is "not found", so that its existence does not leak.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import math
import tempfile
import time
import uuid
from collections.abc import AsyncIterable, AsyncIterator
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import anyio.to_thread

from contracts.model_sources import BUILTIN_MODELS, check_model_source, check_reward_model_dir
from contracts.tensor_parallel import model_heads_config, tensor_parallel_problem
from services.control.api.auth import Principal
from services.control.api.kept import Kept, KeptReader, Shown
from services.control.api.schemas import (
    CostPublic,
    DatasetPublic,
    EvalPublic,
    IterationPublic,
    LedgerEntryPublic,
    PodLogPublic,
    PodPublic,
    PodsPublic,
    RunPublic,
    RunsPublic,
    RunSummaryPublic,
    columns_of,
)
from services.control.api.upload_slots import UploadSlots
from services.control.cost.billing import RolloutTerms
from services.control.cost.lower_bound import LOWER_BOUND_DEFINITION, TrainingTerms
from services.control.cost.report import cost_report
from services.control.cost.report_page import EvalPoint, IterationPoint, report_page
from services.control.tracking.sinks import missing_settings
from services.core.config import Settings
from services.core.server_paths import ServerPathError, check_server_path, url_is_allowed
from services.domain.names import (
    eval_prompts_key,
    pod_log_key,
    pod_logs_prefix,
    prompts_key,
    role_of_pod,
    run_id_of_pod,
    tenant_object_key,
)
from services.domain.prompt_items import DatasetFields, PromptItem
from services.domain.prompts import (
    DEFAULT_FIELDS,
    INLINE,
    PARQUET_MAGIC,
    PARQUET_MEDIA_TYPE,
    STORE_SCHEME,
    InvalidPromptsError,
    JsonlParser,
    load_prompts,
    read_parquet,
    to_jsonl,
)
from services.domain.reward_spec import RewardFn
from services.domain.runspec import RolloutEngine, RunSpec
from services.ports.launcher.launcher import PodNotFoundError
from services.ports.objects.object_store import ObjectNotFoundError
from services.ports.prices.catalog import PriceCatalog
from services.ports.state.state_schema import RunRow
from services.ports.state.state_store import RunNotFoundError, RunView, StateStore
from services.ports.wiring import Backends


class SpecFieldError(ValueError):
    """A run spec this server cannot take, though well formed (a path it does not allow, more
    workers than the operator permits): the API answers 422 naming ``loc``."""

    def __init__(self, loc: tuple[str, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc


class InvalidCursorError(ValueError):
    """A page cursor this API did not hand out (the API answers 400)."""


class PodNotOfRunError(LookupError):
    """No pod of that name belongs to the run, running or ended (the API answers 404)."""


class BodyTooLargeError(ValueError):
    """A request body found over the server's limit while it is read (the API answers 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than this server's limit of {limit} bytes")


MAX_PODS_LISTED = 1000
MAX_LOG_BYTES = 1 << 20  # of one response's log lines: a pod's line may be long
# A run holds up to 100,000 iterations and a ledger entry per pod: a read of it shows the latest
# iterations and one page of its ledger, so that its size does not grow with the run.
DEFAULT_ITERATIONS_SHOWN = 100
MAX_ITERATIONS_SHOWN = 1000
DEFAULT_ENTRIES_PAGE = 100
MAX_ENTRIES_PAGE = 1000
# An upload is parsed in pieces of about this size: each is one hop to a worker thread.
UPLOAD_PIECE_BYTES = 256 << 10


def new_run_id() -> str:
    # Lowercase and short: it prefixes Kubernetes object names (63 characters at most).
    return f"run-{uuid.uuid4().hex[:10]}"


def check_spec_for_server(spec: RunSpec, settings: Settings) -> None:
    """What a well-formed spec must also satisfy on this server: the operator's limits, and
    server paths only inside ``SPOTRL_DATA_DIRS``, naming what they should."""
    allowed = settings.allowed_data_dirs()
    if spec.rollout.max_workers > settings.max_rollout_workers:
        raise SpecFieldError(
            ("body", "rollout", "max_workers"),
            f"this server allows at most {settings.max_rollout_workers} rollout workers per run",
        )
    if spec.training.processes > settings.max_training_processes:
        raise SpecFieldError(
            ("body", "training", "processes"),
            f"this server allows at most {settings.max_training_processes} training processes per job",
        )
    if spec.training.nodes > settings.max_training_nodes:
        raise SpecFieldError(
            ("body", "training", "nodes"),
            f"this server allows at most {settings.max_training_nodes} training nodes per job",
        )
    if spec.model not in BUILTIN_MODELS:
        try:
            check_model_source(str(check_server_path(spec.model, allowed)))
        except (ValueError, OSError) as e:  # ServerPathError included; none repeats the path
            raise SpecFieldError(
                ("body", "model"),
                str(e)
                if isinstance(e, ServerPathError)
                else "no model directory (with config.json) or .gguf file there",
            ) from None
    if spec.rollout.engine == RolloutEngine.VLLM and spec.rollout.gpus_per_worker > 1:
        config = model_heads_config(spec.model)  # a path checked above
        problem = None if config is None else tensor_parallel_problem(config, spec.rollout.gpus_per_worker)
        if problem is not None:
            raise SpecFieldError(("body", "rollout", "gpus_per_worker"), problem)
    missing = missing_settings(spec.tracking, settings)
    if missing:
        raise SpecFieldError(("body", "tracking"), "; ".join(missing))
    allowed_urls = [u.strip() for u in settings.reward_service_urls.split(",") if u.strip()]
    for i, term in enumerate(spec.reward):
        if term.url and not url_is_allowed(term.url, allowed_urls):
            raise SpecFieldError(
                ("body", "reward", str(i), "url"),
                "a reward service must be one the operator allows (SPOTRL_REWARD_SERVICE_URLS); none is"
                if not allowed_urls
                else "a reward service must be one the operator allows (SPOTRL_REWARD_SERVICE_URLS)",
            )
        if term.fn == RewardFn.REWARD_MODEL and term.path:
            try:
                check_reward_model_dir(check_server_path(term.path, allowed))
            except (ValueError, OSError) as e:
                raise SpecFieldError(
                    ("body", "reward", str(i), "path"),
                    str(e) if isinstance(e, ServerPathError) else "no reward model saved by `spotrl train-rm` there",
                ) from None
        if term.fn == RewardFn.FUNCTION and term.path:
            # Its file only: user code is imported (and its signature checked) by the run's pods, never here.
            try:
                if not check_server_path(term.path.rsplit(":", 1)[0], allowed).is_file():
                    raise ValueError
            except (ValueError, OSError) as e:
                raise SpecFieldError(
                    ("body", "reward", str(i), "path"),
                    str(e) if isinstance(e, ServerPathError) else "no Python file there",
                ) from None


def create_run(*, backends: Backends, settings: Settings, principal: Principal, spec: RunSpec) -> RunPublic:
    """Store the run's prompt set and the run (PENDING); the scheduler takes it from there."""
    check_spec_for_server(spec, settings)
    prompts = load_prompts(
        spec.prompts,
        backends.objects,
        tenant=principal.tenant,
        allowed_dirs=settings.allowed_data_dirs(),
        max_bytes=settings.max_dataset_bytes,
        fields=spec.dataset,
    )
    eval_prompts = None
    if spec.eval is not None:  # the held-out set, read and checked as the run's own
        try:
            eval_prompts = load_prompts(
                spec.eval.prompts,
                backends.objects,
                tenant=principal.tenant,
                allowed_dirs=settings.allowed_data_dirs(),
                max_bytes=settings.max_dataset_bytes,
                fields=spec.dataset,
            )
        except InvalidPromptsError as e:
            raise SpecFieldError(("body", "eval", "prompts"), str(e)) from None
    run_id = new_run_id()
    backends.objects.put_bytes(prompts_key(run_id), to_jsonl(prompts))
    stored = spec.model_dump(mode="json")
    if isinstance(spec.prompts, list):
        stored["prompts"] = INLINE  # kept beside the run (prompts_key), not in every read of it
    if eval_prompts is not None:
        backends.objects.put_bytes(eval_prompts_key(run_id), to_jsonl(eval_prompts))
        if isinstance(spec.eval.prompts, list):
            stored["eval"]["prompts"] = INLINE  # kept beside the run (eval_prompts_key)
    row = backends.state.create_run(
        run_id, name=spec.name, spec=stored, tenant=principal.tenant, prompt_count=len(prompts)
    )
    return run_public(
        RunView(row, latest=[], iterations_total=0, ledger=[], reward_failures={}), spent=0.0
    )  # new: no iteration, no ledger yet


async def create_dataset(
    *,
    backends: Backends,
    principal: Principal,
    body: AsyncIterable[bytes],
    max_bytes: int,
    media_type: str | None = None,
    fields: DatasetFields = DEFAULT_FIELDS,
    slots: UploadSlots | None = None,
) -> DatasetPublic:
    """Store an uploaded prompt set among the caller's objects as normalised JSONL, its rows
    mapped by ``fields``. JSONL is parsed line by line as ``body`` arrives, and each prompt is
    written to a temporary file as it is parsed: what is held is one partial line and one piece,
    whatever the set's size, and the upload is refused at its first bad or overlong line, past
    MAX_PROMPTS lines, or past ``max_bytes``, without reading the rest. Parquet (``media_type``
    PARQUET_MEDIA_TYPE, or a body that starts with its magic) cannot be read before its footer,
    at the end: it is spooled to a temporary file, refused as soon as it passes ``max_bytes``,
    then read row group by row group into the JSONL file. The file is then stored from disk
    (``ObjectStore.put_file``). Parsing, writing and storing run in worker threads. Given
    ``slots``, the upload takes one of them before reading anything (TooManyUploadsError when
    none is free)."""
    with slots.hold(principal.tenant) if slots is not None else contextlib.nullcontext():
        return await _create_dataset(
            backends=backends, principal=principal, body=body, max_bytes=max_bytes, media_type=media_type, fields=fields
        )


async def _create_dataset(
    *,
    backends: Backends,
    principal: Principal,
    body: AsyncIterable[bytes],
    max_bytes: int,
    media_type: str | None,
    fields: DatasetFields,
) -> DatasetPublic:
    received = 0

    async def pieces() -> AsyncIterator[bytes]:  # of UPLOAD_PIECE_BYTES or more, the last one shorter
        nonlocal received
        piece = bytearray()
        async for chunk in body:
            received += len(chunk)
            if received > max_bytes:  # the body-size middleware refuses first; this holds without it
                raise BodyTooLargeError(max_bytes)
            piece += chunk
            if len(piece) >= UPLOAD_PIECE_BYTES:
                yield bytes(piece)
                piece.clear()
        yield bytes(piece)

    stream = pieces()
    first = await anext(stream)  # the whole body when shorter than a piece: JSONL or Parquet, by its start
    fd, name = await anyio.to_thread.run_sync(lambda: tempfile.mkstemp(prefix="spotrl-upload-", suffix=".jsonl"))
    path = Path(name)
    try:
        with open(fd, "wb") as out:
            write = _JsonlWriter(out)
            try:
                if media_type == PARQUET_MEDIA_TYPE or first.startswith(PARQUET_MAGIC):
                    spool = await anyio.to_thread.run_sync(tempfile.TemporaryFile)
                    try:
                        await anyio.to_thread.run_sync(spool.write, first)
                        async for piece in stream:
                            await anyio.to_thread.run_sync(spool.write, piece)
                        await anyio.to_thread.run_sync(
                            lambda: read_parquet(spool, "the upload", fields=fields, max_bytes=max_bytes, on_item=write)
                        )
                    finally:
                        await anyio.to_thread.run_sync(spool.close)
                else:
                    parser = JsonlParser("the upload", fields, on_item=write)
                    await anyio.to_thread.run_sync(parser.feed, first)
                    async for piece in stream:
                        await anyio.to_thread.run_sync(parser.feed, piece)
                    await anyio.to_thread.run_sync(parser.finish)
            except InvalidPromptsError as e:
                raise SpecFieldError(("body",), str(e)) from None
            await anyio.to_thread.run_sync(out.flush)
        dataset_id = uuid.uuid4().hex[:16]
        key = f"datasets/{dataset_id}.jsonl"
        await anyio.to_thread.run_sync(backends.objects.put_file, tenant_object_key(principal.tenant, key), path)
    finally:
        await anyio.to_thread.run_sync(lambda: path.unlink(missing_ok=True))
    return DatasetPublic(id=dataset_id, uri=STORE_SCHEME + key, prompts=write.count, bytes=received)


class _JsonlWriter:
    """Writes each prompt item it is given to ``out`` as a line of normalised JSONL (``to_jsonl``'s), and counts them."""

    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.count = 0

    def __call__(self, item: PromptItem) -> None:
        self.out.write(item.model_dump_json().encode())
        self.out.write(b"\n")
        self.count += 1


def run_public(view: RunView, *, spent: float) -> RunPublic:
    """The run as the API shows it, having spent ``spent`` (``spent_dollars`` of its ledger)."""
    row = view.run
    return RunPublic.of(
        row,
        spent,
        iterations=[IterationPublic.model_validate(columns_of(it)) for it in view.latest],
        iterations_total=view.iterations_total,
        spec=RunSpec.from_stored(row.spec),
        reward_failures_by_reason=view.reward_failures,
        evals=[EvalPublic.model_validate(columns_of(e)) for e in view.evals],
        report_url=f"/v1/runs/{row.id}/report",
    )


def _visible_run(state: StateStore, principal: Principal, run_id: str) -> RunRow:
    row = state.get_run(run_id)
    if not principal.sees(row.tenant):
        raise RunNotFoundError(run_id)
    return row


def _reader(kept: Kept | None, catalog: PriceCatalog) -> KeptReader:
    """The request's reader of what the app keeps; without it, of a store that keeps nothing."""
    return (kept if kept is not None else Kept(catalog, max_entries=0, max_shown=0)).reader()


def get_run(
    *,
    backends: Backends,
    catalog: PriceCatalog,
    principal: Principal,
    run_id: str,
    iterations_shown: int = DEFAULT_ITERATIONS_SHOWN,
    kept: Kept | None = None,
) -> RunPublic:
    """The run with its latest ``iterations_shown`` iterations (and the count of all of them); as
    shown before while the run's stamp is the same, else read and built again. One read transaction
    either way, of one statement where the run stands as shown."""
    reader = _reader(kept, catalog)
    shown = reader.shown(run_id, iterations_shown)
    if shown is None:
        view = backends.state.run_view(run_id, latest=iterations_shown, known=reader.known)
    else:
        view = backends.state.run_view(run_id, latest=iterations_shown, known=reader.known, unless_at=shown.stamp)
        if view is None:  # the run stands at the kept stamp, its tenant among its columns
            if not principal.sees(shown.stamp.row.tenant):
                raise RunNotFoundError(run_id)
            return shown.public
    if not principal.sees(view.run.tenant):
        raise RunNotFoundError(run_id)
    public = run_public(view, spent=reader.bill(run_id, view.ledger, time.time()).total)
    if view.stamp is not None:
        reader.keep_shown(run_id, Shown(view.stamp, iterations_shown, public))
    return public


def _encode_cursor(*key: object) -> str:
    """A page cursor: the sort key of the previous page's last item, as opaque text."""
    return base64.urlsafe_b64encode(json.dumps(key).encode()).decode()


def _decode_cursor(cursor: str, *types: type) -> tuple:
    """The key ``_encode_cursor`` wrote, its items of ``types``; InvalidCursorError for any other
    text. bool is an int, and json reads NaN and Infinity: none of them is a key this API hands out."""
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        key = None
    if (
        isinstance(key, list)
        and len(key) == len(types)
        and all(isinstance(v, t) and not isinstance(v, bool) for v, t in zip(key, types, strict=True))
        and all(math.isfinite(v) for v in key if isinstance(v, float))
    ):
        return tuple(key)
    raise InvalidCursorError("`cursor` is not one this API returned: pass `next_cursor` of the previous page")


def _run_cursor_key(cursor: str) -> tuple[float, str]:
    """(created_at, id) of the previous page's last run."""
    created_at, run_id = _decode_cursor(cursor, float | int, str)
    return float(created_at), run_id


def list_runs(
    *,
    backends: Backends,
    catalog: PriceCatalog,
    principal: Principal,
    limit: int,
    cursor: str | None,
    kept: Kept | None = None,
) -> RunsPublic:
    """One page of the caller's runs (every tenant's for an admin), oldest first, each with what it
    spent (the cost report's total)."""
    after = _run_cursor_key(cursor) if cursor else None
    reader = _reader(kept, catalog)
    rows = backends.state.runs_page(
        tenant=None if principal.admin else principal.tenant, limit=limit + 1, after=after, known=reader.known
    )
    now = time.time()
    # Every run read is billed, the one past the page too: its bill is kept for the next page.
    spent = [reader.bill(r.id, ledger, now).total for r, ledger in rows]
    page = rows[:limit]
    return RunsPublic(
        runs=[RunSummaryPublic.of(r, dollars) for (r, _), dollars in zip(page, spent, strict=False)],
        next_cursor=_encode_cursor(page[-1][0].created_at, page[-1][0].id) if len(rows) > limit else None,
    )


def cancel_run(
    *, backends: Backends, catalog: PriceCatalog, principal: Principal, run_id: str, kept: Kept | None = None
) -> RunPublic:
    # The caller's tenant is checked in the cancel's own transaction: one read of the run fewer.
    backends.state.request_cancel(run_id, tenant=None if principal.admin else principal.tenant)
    return get_run(backends=backends, catalog=catalog, principal=principal, run_id=run_id, kept=kept)


def run_cost(
    *,
    backends: Backends,
    catalog: PriceCatalog,
    principal: Principal,
    run_id: str,
    limit: int = DEFAULT_ENTRIES_PAGE,
    cursor: str | None = None,
    kept: Kept | None = None,
) -> CostPublic:
    """The run's bill over its whole ledger, with one page of the ledger's entries (oldest first,
    ``limit`` at most, after the entry ``cursor`` names); an ended run's page as read before while
    its closed ledger and the prices are the same."""
    after = _decode_cursor(cursor, int)[0] if cursor else None  # the previous page's last entry id
    reader = _reader(kept, catalog)
    row, ledger = backends.state.run_ledger(run_id, known=reader.known)
    if not principal.sees(row.tenant):
        raise RunNotFoundError(run_id)
    now = time.time()
    bill = reader.bill(run_id, ledger, now)
    key = reader.cost_key(row, bill, after=after, limit=limit)
    if key is not None and (page := bill.kept_cost(key)) is not None:
        return page
    report = cost_report(
        bill.entries,
        catalog=catalog,
        training=TrainingTerms.of_stored(row.spec),
        rollout=RolloutTerms.of_stored(row.spec),
        run_started_at=row.started_at,
        run_ended_at=row.ended_at,
        now=now,
    )
    billed = zip(bill.entries, bill.billed, strict=True)
    entries = list(islice(((e, dollars) for e, dollars in billed if after is None or e.id > after), limit + 1))
    page = CostPublic(
        run_id=run_id,
        currency=report.currency,
        total_dollars=report.total_dollars,
        by_role=report.by_role,
        by_capacity_type=report.by_capacity_type,
        wall_seconds=report.wall_seconds,
        always_on_dollars=report.always_on_dollars,
        lower_bound_dollars=report.lower_bound_dollars,
        lower_bound_definition=LOWER_BOUND_DEFINITION,
        savings_ratio=report.savings_ratio,
        efficiency=report.efficiency,
        entries=[
            LedgerEntryPublic.model_validate({**vars(e), "seconds": e.seconds(now), "dollars": dollars})
            for e, dollars in entries[:limit]
        ],
        entries_total=len(bill.entries),
        next_cursor=_encode_cursor(entries[limit - 1][0].id) if len(entries) > limit else None,
    )
    if key is not None:
        bill.cost = (key, page)  # one assignment: a request reading it sees the old pair or this one
    return page


def run_report(*, backends: Backends, catalog: PriceCatalog, principal: Principal, run_id: str) -> str:
    """The run's report page (HTML), for a caller who may see the run."""
    return report_page_of(backends.state, catalog, _visible_run(backends.state, principal, run_id))


def report_page_of(state: StateStore, catalog: PriceCatalog, row: RunRow) -> str:
    """The report page of the run ``row`` as its stores hold it now (``spotrl report`` and the API)."""
    return report_page(
        run_id=row.id,
        status=row.status,
        currency=catalog.currency_of([row.spec["training"]["instance_type"], row.spec["rollout"]["instance_type"]]),
        iterations=[IterationPoint(it.iteration, it.mean_reward) for it in state.iterations(row.id)],
        evals=[EvalPoint(e.policy_version, e.metrics or {}) for e in state.evals(row.id)],
        entries=state.ledger(row.id),
        catalog=catalog,
        training=TrainingTerms.of_stored(row.spec),
        rollout=RolloutTerms.of_stored(row.spec),
        run_started_at=row.started_at,
        run_ended_at=row.ended_at,
        now=time.time(),
    )


def run_pods(*, backends: Backends, principal: Principal, run_id: str) -> PodsPublic:
    """The run's pods that have a log: those the launcher still has (running, or ended and not
    yet reaped) and those whose log the scheduler kept in the object store when it reaped them."""
    _visible_run(backends.state, principal, run_id)
    listed = {p.name: p for p in backends.launcher.list(run_id)}
    prefix = pod_logs_prefix(run_id)
    ended = {
        key.removeprefix(prefix).removesuffix(".log") for key in backends.objects.list(prefix) if key.endswith(".log")
    }
    names = sorted(listed.keys() | ended)
    return PodsPublic(
        run_id=run_id,
        pods=[
            PodPublic(
                name=n,
                role=role_of_pod(n),
                running=n in listed,
                waiting_for_node=n in listed and listed[n].waiting_for_node,
            )
            for n in names[:MAX_PODS_LISTED]
        ],
        truncated=len(names) > MAX_PODS_LISTED,
    )


def read_pod_log(backends: Backends, pod: str, *, tail: int) -> tuple[str, bool]:
    """The last ``tail`` lines of a pod's log and whether the launcher still has the pod: from
    the launcher while it does, else the copy the scheduler kept when it reaped it (written
    before the pod is deleted, so one of the two always has it). PodNotOfRunError: neither has."""
    try:
        return backends.launcher.logs(pod, tail=tail), True
    except PodNotFoundError:
        pass
    try:
        text = backends.objects.get_bytes(pod_log_key(run_id_of_pod(pod), pod)).decode(errors="replace")
    except ObjectNotFoundError:
        raise PodNotOfRunError(pod) from None
    return "".join(text.splitlines(keepends=True)[-tail:]), False


def pod_log(*, backends: Backends, principal: Principal, run_id: str, pod: str, tail: int) -> PodLogPublic:
    """A pod of the run's log (``read_pod_log``), cut to at most MAX_LOG_BYTES from its end."""
    _visible_run(backends.state, principal, run_id)
    if run_id_of_pod(pod) != run_id:
        raise PodNotOfRunError(pod)
    text, running = read_pod_log(backends, pod, tail=tail)
    lines = text.splitlines()[-tail:]
    kept, size = [], 0
    for line in reversed(lines):
        size += len(line.encode()) + 1
        if size > MAX_LOG_BYTES:
            break
        kept.append(line)
    kept.reverse()
    return PodLogPublic(run_id=run_id, pod=pod, running=running, lines=kept, truncated=len(kept) < len(lines))
