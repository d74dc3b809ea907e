"""Helpers of the stage scripts. Importing the package puts the repository root on
sys.path, so `kernels` imports under Snakemake and inside the container alike."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
