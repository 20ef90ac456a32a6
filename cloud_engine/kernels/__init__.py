"""Triton kernels of the CUDA path (each module: one kernel and its launcher).

Importing this package needs Triton; every kernel also runs under ``TRITON_INTERPRET=1`` on
CPU tensors, which is how the CPU test suite checks them against the torch reference.
"""

from __future__ import annotations


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
