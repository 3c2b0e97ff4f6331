"""What the planner knows of a GPU: its memory and its dense BF16 tensor throughput.

Figures from NVIDIA's data sheets (dense, i.e. without the 2:4 sparsity figure the sheets quote
first; T4: FP16, it has no BF16). A name is matched on its family, the part before the first
``-``; a ``-<N>GB`` suffix (``A100-80GB``) gives the memory of that variant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuFigures:
    memory_gb: float
    tflops: float | None  # None: the vendor publishes no figure (A10G)


_FAMILIES = {
    "T4": GpuFigures(16, 65),
    "A10": GpuFigures(24, 125),
    "A10G": GpuFigures(24, None),  # AWS's variant of the A10; no published tensor figure
    "L4": GpuFigures(24, 121),
    "L20": GpuFigures(48, 119.5),
    "L40S": GpuFigures(48, 362),
    "A100": GpuFigures(40, 312),  # the 40 GB variant unless the name says -80GB
    "H100": GpuFigures(80, 989),
    "H20": GpuFigures(96, 148),
}
_MEMORY_SUFFIX = re.compile(r"-(\d+)GB$", re.IGNORECASE)


def gpu_figures(name: str) -> GpuFigures | None:
    """The figures of GPU ``name`` (``L20``, ``A100-80GB``), or None when spotrl does not know it."""
    family = _FAMILIES.get(name.split("-", 1)[0].upper())
    if family is None:
        return None
    suffix = _MEMORY_SUFFIX.search(name)
    return GpuFigures(float(suffix.group(1)), family.tflops) if suffix else family
