"""Helpers shared by the pipeline's stage scripts: atomic writes, profile
resolution, the record schema, run facts (versions, commit), recovery after a
killed run and the stage entry point that runs a script natively or inside the
configured container.

Importing the package puts the repository root on sys.path, so that a stage
script (and any helper it imports at module level) can import `kernels` whether
Snakemake started it or the container runtime did (`python <script> --job ...`).
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[3])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
