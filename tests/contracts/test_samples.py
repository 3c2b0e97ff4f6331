from __future__ import annotations

import dataclasses
import struct

import pytest

from contracts.samples import Sample, decode_group, decode_sample, encode_group, encode_sample


def _sample(**overrides: object) -> Sample:
    fields = dict(
        sample_id="9f1c2b3a4d5e6f708192a3b4c5d6e7f8",
        run_id="run-ü",  # non-ASCII survives the header
        prompt_id="p-7",
        group_id="g-7",
        prompt_ids=[1, 2, 3, 49151],
        response_ids=[5, 2_000_000_000, 2],
        logprobs=[-0.1, -12.345678901, 0.0],
        reward=0.1 + 0.2,  # not representable in float32; must survive exactly
        reward_source="math-verify",
        policy_version=42,
        worker_id="spot-3",
        generation_seconds=1.25,
        created_at=1_712_345_678.123456,
    )
    fields.update(overrides)
    return Sample(**fields)


def test_round_trip_keeps_everything_but_float32_logprobs() -> None:
    sample = _sample()
    decoded = decode_sample(encode_sample(sample))
    assert dataclasses.replace(decoded, logprobs=sample.logprobs) == sample
    assert decoded.logprobs == [struct.unpack("f", struct.pack("f", x))[0] for x in sample.logprobs]


def test_round_trip_of_empty_response() -> None:
    sample = _sample(response_ids=[], logprobs=[])
    assert decode_sample(encode_sample(sample)) == sample


def test_arrays_are_packed_binary() -> None:
    sample = _sample(response_ids=list(range(1000)), logprobs=[-1.0] * 1000)
    # 8 bytes per response token, plus a few hundred for the header and prompt.
    assert len(encode_sample(sample)) < 8 * 1000 + 400


def test_rejects_mismatched_logprobs() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        encode_sample(_sample(logprobs=[-0.1]))


@pytest.mark.parametrize(
    "mangle",
    [lambda b: b[:-1], lambda b: b"XXXX" + b[4:], lambda b: b[:3]],
    ids=["truncated", "magic", "short"],
)
def test_rejects_corrupt_payload(mangle) -> None:
    with pytest.raises(ValueError):
        decode_sample(mangle(encode_sample(_sample())))


def test_a_group_round_trips_as_one_record() -> None:
    group = [_sample(sample_id=f"s{k}", response_ids=[k] * k, logprobs=[-0.5] * k) for k in range(4)]
    decoded = decode_group(encode_group(group))
    assert [s.sample_id for s in decoded] == ["s0", "s1", "s2", "s3"]
    assert [s.response_ids for s in decoded] == [s.response_ids for s in group]


def test_a_group_record_holds_one_group_of_one_run() -> None:
    with pytest.raises(ValueError, match="2 groups"):
        encode_group([_sample(), _sample(group_id="g-8")])
    with pytest.raises(ValueError, match="at least one"):
        encode_group([])


@pytest.mark.parametrize(
    "mangle",
    [lambda b: b[:-1], lambda b: b + b"\0", lambda b: b"XXXX" + b[4:], lambda b: b[:6]],
    ids=["truncated", "trailing", "magic", "short"],
)
def test_rejects_a_corrupt_group(mangle) -> None:
    with pytest.raises(ValueError):
        decode_group(mangle(encode_group([_sample(), _sample(sample_id="other")])))


def test_round_trip_keeps_remaxs_baseline_reward_and_its_absence() -> None:
    assert decode_sample(encode_sample(_sample(baseline_reward=0.25))).baseline_reward == 0.25
    assert decode_sample(encode_sample(_sample())).baseline_reward is None


def test_round_trip_keeps_the_rewards_figures_and_their_absence() -> None:
    figures = {"acc": 1.0, "format": 0.5}
    assert decode_sample(encode_sample(_sample(reward_metrics=figures))).reward_metrics == figures
    assert decode_sample(encode_sample(_sample())).reward_metrics is None
