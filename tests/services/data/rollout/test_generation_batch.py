"""A rollout worker's generation batch (services.data.rollout.generation_batch): the chunk size set
from the memory free, grown while there is room, halved on an out-of-memory error, the chunk
generated again: with an engine that fails above a size, and the HF engine under an
address-space limit (a subprocess: the limit is for its whole life)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from services.data.rollout.generation_batch import GenerationBatch, MemoryProbe, generate_in_chunks, is_out_of_memory
from trainer_core.engines.hf import Completion, SamplingParams

REPO = Path(__file__).resolve().parents[4]
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4)


class Probe(MemoryProbe):
    """Memory as the test says: ``free`` bytes free; each chunk grows it by ``each`` a sequence."""

    def __init__(self, free: float, each: float) -> None:
        super().__init__(torch.device("cpu"))
        object.__setattr__(self, "_free", free)
        object.__setattr__(self, "_each", each)
        object.__setattr__(self, "_last", 0)

    def free(self) -> float:
        return self._free

    def start(self) -> float:
        return 0.0

    def peak(self) -> float:
        return self._each * self._last


class Engine:
    """Echoes each prompt's first token; more than ``most`` sequences at once run out of memory."""

    def __init__(self, most: int, probe: Probe, error: BaseException) -> None:
        self.most, self.probe, self.error, self.calls = most, probe, error, []

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, **_) -> list[Completion]:
        self.calls.append(len(prompts))
        if len(prompts) > self.most:
            raise self.error
        object.__setattr__(self.probe, "_last", len(prompts))
        return [Completion(token_ids=[p[0]], logprobs=[0.0], finish_reason="length") for p in prompts]


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("CUDA out of memory"),
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 bytes"),
    ],
    ids=["python", "cuda", "torch-cpu"],
)
def test_an_out_of_memory_chunk_is_halved_and_generated_again(error: BaseException) -> None:
    probe = Probe(free=10_000.0, each=100.0)
    engine = Engine(most=20, probe=probe, error=error)
    batch = GenerationBatch()
    prompts = [[k] for k in range(64)]
    got = generate_in_chunks(engine, prompts, PARAMS, batch, probe)
    assert [c.token_ids[0] for c in got] == list(range(64)), "every sequence, in order"
    # The whole batch first, halved to 16 where it fits. Running out at 32 of 10 kB free says a
    # sequence takes over 312.5 bytes: 25 fit in 0.8 x 10 kB, at most doubling. Running out at 25
    # says over 400: 12 (halved), then 20, then the 16 left.
    assert engine.calls == [64, 32, 16, 25, 12, 20, 16]
    assert [size for _, size in batch.sizes] == [64, 32, 16, 25, 12, 20, 16]
    assert batch.per_sequence_bytes == 400.0


def test_the_size_grows_with_the_memory_free_at_most_doubling() -> None:
    batch = GenerationBatch(per_sequence_bytes=100.0, size=4)
    assert batch.next_size(pending=100, free_bytes=1_000_000.0) == 8
    assert batch.next_size(pending=100, free_bytes=1_000_000.0) == 16
    assert batch.next_size(pending=10, free_bytes=1_000_000.0) == 10  # never above what is left
    assert batch.next_size(pending=100, free_bytes=500.0) == 4  # 0.8 x 500 / 100
    assert batch.next_size(pending=100, free_bytes=0.0) == 1


def test_generation_that_grows_no_memory_is_the_whole_batch() -> None:
    """An engine with its KV cache reserved up front (vLLM) schedules the batch itself."""
    probe = Probe(free=0.0, each=0.0)
    engine = Engine(most=1000, probe=probe, error=MemoryError())
    batch = GenerationBatch()
    for n in (8, 32):
        assert len(generate_in_chunks(engine, [[k] for k in range(n)], PARAMS, batch, probe)) == n
    assert engine.calls == [8, 32]
    assert batch.at_once == 32


def test_an_out_of_memory_error_at_one_sequence_fails_the_batch_and_others_pass() -> None:
    probe = Probe(free=0.0, each=1.0)
    with pytest.raises(MemoryError):
        generate_in_chunks(
            Engine(most=0, probe=probe, error=MemoryError()), [[1], [2]], PARAMS, GenerationBatch(), probe
        )
    with pytest.raises(ValueError):
        generate_in_chunks(
            Engine(most=0, probe=probe, error=ValueError("bad")), [[1]], PARAMS, GenerationBatch(), probe
        )
    assert not is_out_of_memory(RuntimeError("expected a tensor"))


CAPPED = textwrap.dedent(
    """
    import json, resource, sys
    from pathlib import Path
    import torch
    from services.data.rollout.generation_batch import GenerationBatch, MemoryProbe, generate_in_chunks, is_out_of_memory
    from trainer_core.engines.hf import HFEngine, SamplingParams
    from trainer_core.models.loading import load_policy

    torch.set_num_threads(1)
    policy = load_policy("tiny", cache_dir=Path(sys.argv[1]))
    engine = HFEngine(policy.model, policy.tokenizer)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=16)
    prompts = [[5, 6, 7]] * int(sys.argv[2])
    engine.generate(prompts[:8], params)  # the allocator's first arenas, before the cap
    vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize:")) * 1024
    cap = vm + int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        engine.generate(prompts, params)
        whole = "fits"
    except RuntimeError as e:
        whole = "out of memory" if is_out_of_memory(e) else str(e)
    batch = GenerationBatch()
    got = generate_in_chunks(engine, prompts, params, batch, MemoryProbe(torch.device("cpu")))
    print(json.dumps({"whole": whole, "sizes": [s for _, s in batch.sizes], "done": len(got)}))
    """
)


def test_the_hf_engine_under_a_memory_cap_generates_the_batch_in_chunks(tmp_path: Path) -> None:
    sequences, headroom = 4096, 24 << 20  # the whole batch needs some 80 MB of KV cache more at once
    run = subprocess.run(
        [sys.executable, "-c", CAPPED, str(tmp_path / "models"), str(sequences), str(headroom)],
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert figures["whole"] == "out of memory", figures  # all at once does not fit
    assert figures["done"] == sequences
    assert figures["sizes"][0] == sequences and min(figures["sizes"]) < sequences
