"""bloomery's kernel sources (*.cu, *.cuh for the cuda backend, cpu_lanes.c for the numpy one),
and where both backends keep their compiled forms. Device-free: no CuPy, no compiler here."""
from __future__ import annotations

import os
from pathlib import Path


def kernel_dir() -> Path:
    """This folder: bloomery/kernels links to the tree's top-level kernels/, a copy in an installed wheel."""
    return Path(__file__).resolve().parent


def cache_dir() -> Path:
    """Where both backends' compiled kernels are kept (CuPy's cache too, cuda/kernels.Kernels)."""
    return Path(os.environ.get("BLOOMERY_CACHE", Path.home() / ".cache" / "bloomery")) / "kernels"
