"""bench.py's gates on this machine at small shapes (its timing needs a GPU):
`PYTHONPATH=.:experiments/decode_linear TRITON_INTERPRET=1 python -m pytest -q experiments/decode_linear`."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import bench  # noqa: E402
from kernels.models import decode as dk  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("epi", [dk.EPI_BIAS, dk.EPI_GATED])
def test_role_gate_and_rotation(epi):
    role = bench.Role(4, 32, 64, epi, 3, dk.Workspace(DEV), device=DEV)
    gate = role.gate()
    assert max(gate.values()) < bench.GATE_TOL, gate
    assert gate["ours"] > 0 and gate["cublas"] > 0           # BF16 results, not the float64 ones
    seen = []
    call = bench.rotating(lambda i: seen.append(i), 3)
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert not torch.equal(role.ours(0), role.ours(1))      # distinct weight sets
