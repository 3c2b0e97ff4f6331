"""Policy hand-over: from a training job's publish of a new version to every rollout worker serving
it, through the S3 adapter, against raw boto3 fetching the same objects from the same server in
the same run (a benchmark, not a test).

    .venv/bin/python bench/weight_handover.py [--gb 2] [--workers 4] [--shard-mb 512] [--json OUT]

It starts the S3 emulator of the tests (moto's server, tests/servers/s3.py) on a free loopback
port, keeping every object in its memory (``MOTO_S3_DEFAULT_KEY_BUFFER_SIZE`` above the shard
size: by default it spools an object over 5 MB to a temp file, and that disk, its page cache
squeezed by the workers' models, then paces both sides, about 3x slower here), a SQLite state
store in a temporary home, and these processes, each fresh:

1. ``--workers`` rollout workers. Each holds the base (v0) of a synthetic Llama-shaped causal LM
   of ``--gb`` GB in bf16, built without initialisation and filled with constants, and an hf
   engine over it, then polls the run's policy version in the state store, as a worker does
   between batches. When v1 appears it takes it as a worker does (``serve_version``: streamed
   from the store into its model, shard by shard), checks that every parameter holds v1's values,
   and reports its peak RSS (``VmHWM``: over its whole life, so the model's build counts too).
2. The training job: the same model holding v1's values, published (``publish_policy``: shards
   of at most ``--shard-mb`` MiB and their index, written to its scratch dir and uploaded), then,
   once raw boto3 has read v1 (3.), the version pointer set in the state store; it exits, as a
   job does.
3. ``--workers`` processes of raw boto3 (default settings but path addressing) fetch the same
   objects, the index and the shards: ``get_object`` for each, its body read to the end in 8 MiB
   parts and dropped, the least a reader of the same bytes does. Each starts once its client is
   made, as the workers were polling before the pointer was set. They run twice, before the
   pointer is set and after every worker serves v1, so that the server's state (objects just
   written, or read before) favours neither side; the ratio takes the mean of both.

Reported: the publish's seconds; the hand-over's, from the pointer set to the last worker
serving; raw boto3's, from its start to the last process done; the ratio of raw's seconds to
the hand-over's (target >= 0.8x); and each worker's peak RSS against the model's size (target
<= 1.2x), whole, and less the RSS its imports took before the model was built (torch,
transformers, spotrl's worker: about 0.42 GB), which leaves the model and what its swap added.
The machine runs the emulator, the workers and the job at once: with 4 workers of 2 GB, about
16 GB of memory; the default run takes about 2.5 minutes on 2 shared cores. ``--gb 0.25`` is a
quick check.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RUN = "handover"
VERSION = 1
READ_PART = 8 << 20  # raw boto3's read size, as the adapter's (CHUNK_BYTES)
POLL_S = 0.05  # how often a waiting worker asks the state store for the version
BUCKET = "spotrl-bench-handover"
GB = 1e9


def model_config(gb: float) -> dict[str, Any]:
    """A Llama-shaped config of about `gb` GB in bf16: 2048 wide from 1 GB (a 1B-class model),
    1024 below; as many layers as the size leaves after the embeddings (at least one)."""
    hidden, ffn = (2048, 5632) if gb >= 1 else (1024, 2816)
    vocab = 32000
    per_layer = 4 * hidden * hidden + 3 * hidden * ffn
    layers = max(1, round((gb * GB / 2 - 2 * vocab * hidden) / per_layer))
    return {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "tie_word_embeddings": False,
    }


def synthetic_policy(config: dict[str, Any], version: int, home: Path) -> Any:
    """A `Policy` of `config` in bf16 whose parameter i holds `value(i, version)` everywhere:
    built on the meta device and filled, so no initialisation runs and no memory is spent twice."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainer_core.models.loading import Policy, load_policy

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    model = model.to(torch.bfloat16).to_empty(device="cpu").eval()
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(value(i, version))
    return Policy(model=model, tokenizer=load_policy("tiny", cache_dir=home / "models").tokenizer)


def value(i: int, version: int) -> float:
    """Parameter i's value in `version`: exact in bf16."""
    return version + (i % 16) / 16


def rollout_worker(worker_id: str, config: dict[str, Any], home: Path, url: str, results: Any) -> None:
    from services.data.rollout.worker import serve_version
    from services.ports.objects.s3_object_store import S3ObjectStore
    from services.ports.state.state_store import StateStore
    from trainer_core.engines import make_engine
    from trainer_core.memory import MemoryMonitor

    imports = MemoryMonitor().sample()["perf/memory_bytes"]
    policy = synthetic_policy(config, 0, home)
    engine = make_engine("hf", model=policy.model, tokenizer=policy.tokenizer)
    state, objects = StateStore(f"sqlite:///{home / 'state.db'}"), S3ObjectStore.from_url(url)
    before = MemoryMonitor().sample()["perf/memory_bytes"]
    results.put(("ready", worker_id))
    while (version := state.policy_version(RUN)) == 0:
        time.sleep(POLL_S)
    seen = time.time()
    serve_version(engine, policy, objects, RUN, version, home / "models")
    served = time.time()
    wrong = [
        i
        for i, p in enumerate(policy.model.parameters())
        if {p.view(-1)[0].item(), p.view(-1)[-1].item()} != {value(i, version)}
    ]
    if wrong:
        raise SystemExit(f"worker {worker_id}: parameters {wrong[:5]} do not hold v{version}'s values")
    peak = MemoryMonitor().sample()["perf/peak_memory_bytes"]
    results.put(
        (
            "served",
            {
                "worker": worker_id,
                "seen": seen,
                "served": served,
                "rss_imports": imports,
                "rss_before": before,
                "peak": peak,
            },
        )
    )


def training_job(
    config: dict[str, Any], home: Path, url: str, shard_bytes: int, go: Any, point: Any, results: Any
) -> None:
    """Publish v1 on `go`, set the version pointer on `point` (raw boto3 reads v1 in between)."""
    from services.data.policy_store import publish_policy
    from services.ports.objects.s3_object_store import S3ObjectStore
    from services.ports.state.state_store import StateStore

    policy = synthetic_policy(config, VERSION, home)
    state, objects = StateStore(f"sqlite:///{home / 'state.db'}"), S3ObjectStore.from_url(url)
    results.put(("ready", "job"))
    go.wait()
    started = time.time()
    publish_policy(objects, RUN, VERSION, policy, home, shard_bytes=shard_bytes)
    results.put(("published", time.time() - started))
    point.wait()
    state.update_run(RUN, policy_version=VERSION)
    results.put(("pointer", time.time()))


def raw_fetcher(keys: list[str], endpoint: str, go: Any, results: Any) -> None:
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
    results.put(("ready", "raw"))
    go.wait()
    fetched = 0
    for key in keys:
        body = client.get_object(Bucket=BUCKET, Key=key)["Body"]
        while part := body.read(READ_PART):
            fetched += len(part)
    results.put(("fetched", {"done": time.time(), "bytes": fetched}))


def gather(results: Any, kind: str, count: int, procs: list[Any]) -> list[Any]:
    """The next `count` messages of `kind`; SystemExit if a process died first."""
    found = []
    while len(found) < count:
        try:
            got, payload = results.get(timeout=1.0)
        except queue.Empty:  # see whether a process died
            if dead := [p for p in procs if p.exitcode not in (None, 0)]:
                raise SystemExit(
                    f"{dead[0].name} exited with {dead[0].exitcode} (its error is printed above)"
                ) from None
            continue
        if got != kind:
            raise SystemExit(f"expected {kind!r} messages, got {got!r}")
        found.append(payload)
    return found


def bench(gb: float, workers: int, shard_bytes: int, home: Path, endpoint: str) -> dict[str, Any]:
    """Publish and hand over v1 (raw boto3 reading v1 just before the pointer is set, and again
    after every worker serves it: the server's state is alike for both sides)."""
    from services.domain.names import policy_prefix
    from services.ports.objects.s3_object_store import S3ObjectStore
    from services.ports.state.state_store import StateStore
    from trainer_core.models.safetensors_stream import INDEX_FILE

    config = model_config(gb)
    url = f"s3://{BUCKET}/spotrl"
    StateStore(f"sqlite:///{home / 'state.db'}").create_run(RUN, name=None, spec={})
    ctx = mp.get_context("spawn")
    results, go, point = ctx.Queue(), ctx.Event(), ctx.Event()
    procs = [
        ctx.Process(target=rollout_worker, args=(f"w{n}", config, home, url, results), name=f"worker w{n}")
        for n in range(workers)
    ]
    job = ctx.Process(target=training_job, args=(config, home, url, shard_bytes, go, point, results), name="the job")
    procs.append(job)
    for p in procs:
        p.start()
    gather(results, "ready", workers + 1, procs)
    go.set()
    (publish_s,) = gather(results, "published", 1, procs)

    prefix = policy_prefix(RUN, VERSION)
    index = json.loads(S3ObjectStore.from_url(url).get_bytes(prefix + INDEX_FILE))
    shards = sorted(set(index["weight_map"].values()))
    keys = [f"spotrl/{prefix}{name}" for name in [INDEX_FILE, *shards]]
    raw = [raw_round(ctx, keys, endpoint, workers, procs)]
    point.set()
    (pointer,) = gather(results, "pointer", 1, procs)
    served = gather(results, "served", workers, procs)
    for p in procs:
        p.join()
    raw.append(raw_round(ctx, keys, endpoint, workers, procs))

    model_bytes = index["metadata"]["total_size"]
    handover_s = max(s["served"] for s in served) - pointer
    raw_s = sum(seconds for seconds, _ in raw) / len(raw)
    return {
        "config": config,
        "model_bytes": model_bytes,
        "shards": len(shards),
        "shard_bytes": shard_bytes,
        "workers": workers,
        "publish_s": publish_s,
        "handover_s": handover_s,
        "raw_boto3_s": [seconds for seconds, _ in raw],
        "raw_bytes_per_process": raw[0][1],
        "ratio": raw_s / handover_s,
        "per_worker": [
            s
            | {
                "seen_s": s["seen"] - pointer,
                "load_s": s["served"] - s["seen"],
                "peak_over_model": s["peak"] / model_bytes,
                "model_and_swap_over_model": (s["peak"] - s["rss_imports"]) / model_bytes,
            }
            for s in sorted(served, key=lambda s: s["worker"])
        ],
    }


def raw_round(ctx: Any, keys: list[str], endpoint: str, workers: int, others: list[Any]) -> tuple[float, int]:
    """`workers` processes of raw boto3 reading `keys` at once, from the start of the first to the
    end of the last: (seconds, bytes each read)."""
    results, go = ctx.Queue(), ctx.Event()
    procs = [
        ctx.Process(target=raw_fetcher, args=(keys, endpoint, go, results), name=f"raw boto3 {n}")
        for n in range(workers)
    ]
    for p in procs:
        p.start()
    gather(results, "ready", workers, procs + others)
    started = time.time()
    go.set()
    fetched = gather(results, "fetched", workers, procs + others)
    for p in procs:
        p.join()
    return max(f["done"] for f in fetched) - started, fetched[0]["bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="the synthetic model's size in GB (1e9 bytes), bf16")
    parser.add_argument("--workers", type=int, default=4, help="rollout worker processes")
    parser.add_argument("--shard-mb", type=int, default=512, help="largest shard, MiB (the publish default: 512)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    from tests.servers.s3 import ACCESS_KEY_ID, REGION, S3Server

    with tempfile.TemporaryDirectory(prefix="spotrl-bench-handover-") as tmp:
        home = Path(tmp)
        os.environ.update(
            AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
            AWS_SECRET_ACCESS_KEY="bench-secret",
            AWS_DEFAULT_REGION=REGION,
            AWS_CONFIG_FILE=str(home / "no-aws-config"),
            AWS_SHARED_CREDENTIALS_FILE=str(home / "no-aws-credentials"),
            AWS_EC2_METADATA_DISABLED="true",
            # moto keeps each object in its memory rather than spooling it to a temp file.
            MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(2 * (args.shard_mb << 20)),
        )
        server = S3Server()
        try:
            os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint_url
            server.client().create_bucket(Bucket=BUCKET)
            r = bench(args.gb, args.workers, args.shard_mb << 20, home, server.endpoint_url)
        finally:
            server.stop()
    report(r)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))


def report(r: dict[str, Any]) -> None:
    size, n = r["model_bytes"], r["workers"]
    raw_s = sum(r["raw_boto3_s"]) / len(r["raw_boto3_s"])
    print(
        f"weight hand-over: a {size / GB:.2f} GB bf16 model ({size / 2e6:,.0f}M parameters) in {r['shards']} shards of"
        f" <= {r['shard_bytes'] >> 20} MiB and an index; {n} rollout worker processes; S3 adapter against moto's"
        f" server on loopback; {os.cpu_count()} CPUs"
    )
    print(f"  publish (the job: shards written and uploaded)           {r['publish_s']:6.1f} s")
    print(
        f"  hand-over (pointer set -> all {n} workers serving v1)       {r['handover_s']:6.1f} s"
        f"  {n * size / r['handover_s'] / 2**20:5,.0f} MiB/s"
    )
    print(
        f"  raw boto3: {n} processes get_object the same objects (before, after) "
        + ", ".join(f"{s:.1f}" for s in r["raw_boto3_s"])
        + f" s  {n * r['raw_bytes_per_process'] / raw_s / 2**20:5,.0f} MiB/s"
    )
    print(f"{'worker':>8} {'seen s':>7} {'load s':>7} {'RSS imports':>12} {'RSS before':>11} {'peak RSS':>9} (GB)")
    for w in r["per_worker"]:
        print(
            f"{w['worker']:>8} {w['seen_s']:7.2f} {w['load_s']:7.1f} {w['rss_imports'] / GB:12.2f}"
            f" {w['rss_before'] / GB:11.2f} {w['peak'] / GB:9.2f}"
        )
    peak = max(w["peak_over_model"] for w in r["per_worker"])
    own = max(w["model_and_swap_over_model"] for w in r["per_worker"])
    print(f"hand-over / raw boto3 throughput: {r['ratio']:.2f}x (target >= 0.8x): {_met(r['ratio'] >= 0.8)}")
    print(f"a worker's peak RSS / model size: {peak:.2f}x at most (target <= 1.2x): {_met(peak <= 1.2)}")
    print(
        f"  of which the model and its swap (peak RSS less the RSS after imports) / model size: {own:.2f}x"
        f" ({_met(own <= 1.2)})"
    )


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


if __name__ == "__main__":
    main()
