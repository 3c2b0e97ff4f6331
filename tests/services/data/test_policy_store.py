"""Policy versions in the object store: full weights published as safetensors shards beside their
index, streamed back into a live model shard by shard on every adapter; LoRA versions adapter-only;
versions of one file (as published before shards) still read."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.data.policy_store import load_version, publish_policy, stream_weights
from services.domain.names import policy_prefix
from services.ports.objects.object_store import ObjectReader, ObjectStore
from tests.services.ports.objects.adapters import ADAPTERS
from trainer_core.models.loading import Policy, load_policy
from trainer_core.models.lora import LoraSettings, apply_lora
from trainer_core.models.safetensors_stream import INDEX_FILE, SINGLE_FILE

RUN = "r"
REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.fixture(params=sorted(ADAPTERS))
def objects(request: pytest.FixtureRequest, tmp_path: Path) -> ObjectStore:
    return ADAPTERS[request.param](request, tmp_path)


@pytest.fixture
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.getbasetemp() / "models"


class OpenedOneAtATime:
    """The store, recording which objects were opened, and refusing to open one while another is."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects, self.opened, self._open = objects, [], False

    def __getattr__(self, name: str):
        return getattr(self._objects, name)

    @contextmanager
    def open(self, key: str) -> Iterator[ObjectReader]:
        assert not self._open, f"{key} opened while another object was open"
        self._open = True
        self.opened.append(key)
        try:
            with self._objects.open(key) as stream:
                yield stream
        finally:
            self._open = False


def _trained_tiny(models: Path) -> Policy:
    policy = load_policy("tiny", cache_dir=models)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        for p in policy.model.parameters():
            p.add_(torch.randn_like(p))
    return policy


def test_a_version_is_published_as_shards_and_streamed_back_one_at_a_time(
    objects: ObjectStore, models: Path, tmp_path: Path
) -> None:
    trained = _trained_tiny(models)
    publish_policy(objects, RUN, 1, trained, tmp_path, shard_bytes=64 * 1024)
    prefix = policy_prefix(RUN, 1)
    index = json.loads(objects.get_bytes(prefix + INDEX_FILE))
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 4 and set(index["weight_map"]) == set(trained.model.state_dict())
    for shard in shards:
        with objects.open(prefix + shard) as stream:
            assert len(stream.read()) <= 64 * 1024 + 4096  # the data, and a header
    assert not objects.exists(prefix + SINGLE_FILE)

    served = load_policy("tiny", cache_dir=models).model
    storage = [p.data_ptr() for p in served.parameters()]
    recording = OpenedOneAtATime(objects)
    assert load_version(served, recording, RUN, 1, models) is served
    assert recording.opened == [prefix + INDEX_FILE] + [prefix + s for s in shards]
    assert [p.data_ptr() for p in served.parameters()] == storage
    for name, value in trained.model.state_dict().items():
        assert torch.equal(served.state_dict()[name], value), name
    assert not (models / "runs" / RUN).exists(), "full weights are streamed, not downloaded first"


def test_a_version_of_one_file_is_still_read(objects: ObjectStore, models: Path, tmp_path: Path) -> None:
    trained = _trained_tiny(models)
    trained.model.save_pretrained(tmp_path / "v1")  # one model.safetensors, as versions were published before shards
    objects.upload_dir(tmp_path / "v1", policy_prefix(RUN, 1))
    served = load_policy("tiny", cache_dir=models).model
    assert stream_weights(served, objects, policy_prefix(RUN, 1)) == 1
    for name, value in trained.model.state_dict().items():
        assert torch.equal(served.state_dict()[name], value), name


def test_a_shard_of_another_shape_is_refused_before_its_data_is_read(
    objects: ObjectStore, models: Path, tmp_path: Path
) -> None:
    trained = _trained_tiny(models)
    publish_policy(objects, RUN, 1, trained, tmp_path, shard_bytes=64 * 1024)
    wider = LlamaForCausalLM(LlamaConfig.from_dict({**trained.model.config.to_dict(), "intermediate_size": 256}))
    before = {n: t.clone() for n, t in wider.state_dict().items()}
    with pytest.raises(ValueError, match="has shape"):
        stream_weights(wider, objects, policy_prefix(RUN, 1))
    weight_map = json.loads(objects.get_bytes(policy_prefix(RUN, 1) + INDEX_FILE))["weight_map"]
    refused = weight_map["model.layers.0.mlp.gate_proj.weight"]
    for name in (n for n, shard in weight_map.items() if shard == refused):
        assert torch.equal(wider.state_dict()[name], before[name]), name


def test_lora_versions_stay_adapter_sized(objects: ObjectStore, models: Path, tmp_path: Path) -> None:
    base = load_policy("tiny", cache_dir=models)
    full_bytes = sum(t.numel() * t.element_size() for t in base.model.state_dict().values())
    lora = Policy(model=apply_lora(base.model, LoraSettings(rank=4)), tokenizer=base.tokenizer)
    publish_policy(objects, RUN, 1, lora, tmp_path, shard_bytes=64 * 1024)
    keys = objects.list(policy_prefix(RUN, 1))
    weights = [k for k in keys if k.endswith((".safetensors", INDEX_FILE))]
    assert [k.rpartition("/")[2] for k in weights] == ["adapter_model.safetensors"]
    assert len(objects.get_bytes(weights[0])) < full_bytes / 5


# A fresh process: the model, then a version streamed into it; its peak RSS over that load.
_LOAD_AND_MEASURE = """
import json, re, sys
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from services.data.policy_store import stream_weights
from services.ports.wiring import open_object_store

def status(field):
    return int(re.search(rf"{field}:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

url, home, prefix, config = sys.argv[1:]
model = LlamaForCausalLM(LlamaConfig(**json.loads(config)))
objects = open_object_store(url or None, Path(home))
open("/proc/self/clear_refs", "w").write("5")  # the peak from here on
before = status("VmRSS")
shards = stream_weights(model, objects, prefix)
extra = status("VmHWM") - before
sums = {n: float(t.double().sum()) for n, t in model.state_dict().items()}
print(json.dumps({"shards": shards, "extra": extra, "sums": sums}))
"""


@pytest.mark.parametrize("adapter", sorted(ADAPTERS))
def test_a_worker_loading_a_version_holds_one_model_and_less_than_a_shard_more(
    adapter: str, request: pytest.FixtureRequest, models: Path, tmp_path: Path
) -> None:
    config = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 4}
    config |= {"num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**config))  # about 240 MB of fp32 weights
    shard_bytes = 64 * MiB
    objects = ADAPTERS[adapter](request, tmp_path)
    publish_policy(
        objects,
        RUN,
        1,
        Policy(model, load_policy("tiny", cache_dir=models).tokenizer),
        tmp_path,
        shard_bytes=shard_bytes,
    )
    url = request.getfixturevalue("s3_bucket").url if adapter == "s3" else ""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent(_LOAD_AND_MEASURE),
            url,
            str(tmp_path),
            policy_prefix(RUN, 1),
            json.dumps(config),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    measured = json.loads(out.stdout.splitlines()[-1])
    assert measured["shards"] >= 3
    # A second copy of the model would be 240 MB more, a shard held whole 64 MiB.
    assert measured["extra"] < 0.75 * shard_bytes, measured["extra"] / MiB
    for name, value in model.state_dict().items():
        assert measured["sums"][name] == pytest.approx(float(value.double().sum())), name
