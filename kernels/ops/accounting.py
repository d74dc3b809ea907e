"""Logical byte and launch accounting: every launcher calls `account(...)` per launch with
the tensors its kernel reads and writes (outside a `counting()` block it computes nothing).

    with accounting.counting() as c:
        y, h = kernels.rglru(...)
    c.bytes_read, c.bytes_written, c.launches, c.by_kernel
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

_active: list["Counter"] = []


@dataclass
class Counter:
    bytes_read: int = 0
    bytes_written: int = 0
    launches: int = 0
    by_kernel: dict = field(default_factory=dict)


def record(kernel: str, bytes_read: int, bytes_written: int, launches: int = 1) -> None:
    add = {"bytes_read": int(bytes_read), "bytes_written": int(bytes_written), "launches": launches}
    for c in _active:
        # the totals (the counter's fields) and the kernel's own
        for d in (vars(c), c.by_kernel.setdefault(kernel, dict.fromkeys(add, 0))):
            for k, v in add.items():
                d[k] += v


def account(kernel: str, reads, writes) -> None:
    """`record` of the bytes of the tensors in `reads` and `writes`, sized only inside a
    `counting()` block."""
    if _active:
        record(kernel, nbytes(*reads), nbytes(*writes))


def nbytes(*tensors) -> int:
    """Bytes of the given tensors (None ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@contextlib.contextmanager
def counting():
    c = Counter()
    _active.append(c)
    try:
        yield c
    finally:
        _active.remove(c)
