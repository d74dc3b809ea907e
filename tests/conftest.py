"""Without CUDA, Triton kernels run on the CPU interpreter: the variable must be
set before triton is first imported. Tests marked cuda run where a GPU is visible,
the others where none is."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # The interpreter is process-wide: where a GPU is visible the Triton kernels compile
    # for it, and the CPU suite's Triton calls on CPU tensors cannot run. So a GPU node
    # runs the tests marked cuda, and CUDA_VISIBLE_DEVICES= runs the CPU suite there.
    gpu = torch.cuda.is_available()
    skip = pytest.mark.skip(reason="CPU suite (Triton interpreter): run it with CUDA_VISIBLE_DEVICES=" if gpu
                            else "needs a CUDA GPU")
    for item in items:
        if ("cuda" in item.keywords) != gpu:
            item.add_marker(skip)
