"""The demo's verifiable task: "What is a + b?" prompts with their answers (scored by the
`exact_match` reward). Kept apart from `services.tooling.demo`, whose server and console imports the
benchmark's worker processes should not pay for."""

from __future__ import annotations

import random


def arithmetic_prompts(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``What is a + b?`` with one- and two-digit operands, and the sum as the answer."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        items.append({"prompt": f"What is {a} + {b}? Reply with only the number.", "answer": str(a + b)})
    return items
