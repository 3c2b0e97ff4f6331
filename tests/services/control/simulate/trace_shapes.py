"""Spot traces of the kinds the shipped ones are (../shared/traces: SpotHedge's GCP A100 zones,
150 s ticks over 32 h; SpotServe's AWS g4dn, 60 s ticks over 10.8 h), built here so that the
simulator's tests run wherever the repository is cloned. Their figures are in the README, from
``bench/cost_policies.py`` on the real traces."""

from __future__ import annotations

from services.control.simulate.traces import SpotTrace, parse_trace

GCP_TICK_S = 150
GCP_TICKS = 770  # 32 h


def _gcp(name: str, data: list[int]) -> SpotTrace:
    assert len(data) == GCP_TICKS
    return parse_trace(name, {"metadata": {"gap_seconds": GCP_TICK_S}, "data": data})


# One node at most, lost for 3 h early on (asia-northeast1-a's kind).
ONE_NODE_OUTAGE = _gcp("one-node-outage", [1] * 40 + [0] * 72 + [1] * 658)
# Up to four nodes, dipping to two (us-central1-a's kind).
FOUR_NODES = _gcp("four-nodes", ([4] * 60 + [2] * 20 + [3] * 30) * 7)
# No spot capacity at all (us-east1-b's kind).
NO_SPOT = _gcp("no-spot", [0] * GCP_TICKS)
# None for the first 15 h, then three nodes (us-west1-b's kind).
LATE_SPOT = _gcp("late-spot", [0] * 360 + [3] * 410)
# Many nodes that come and go minute by minute (SpotServe's AWS g4dn kind): 60 s ticks over 10.8 h.
MANY_NODES = parse_trace(
    "many-nodes",
    {"metadata": {"gap_seconds": 60}, "data": [12 + (i * 7) % 9 - (4 if i % 97 < 20 else 0) for i in range(648)]},
)
