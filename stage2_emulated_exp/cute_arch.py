"""The one place that chooses the GPU architecture CuTe-DSL compiles for.

CuTe-DSL reads ``CUTE_DSL_ARCH`` once, when ``cutlass`` is first imported, and keeps it for the
life of the process. Every package of this project that uses CuTe calls `select()` in its
``__init__.py``, so the variable is set before any of its submodules runs ``import cutlass`` and
those submodules can import in the ordinary order.

Without a GPU (CI, laptops) the default is ``sm_90a``: Hopper, with the ``a`` suffix that enables
``wgmma`` and ``setmaxnreg``. A value the user exported always wins. Code that knows the device
(``fa4`` dispatch, ``python -m fa4 precompile --arch``) calls `retarget()` before it imports a
kernel module, which replaces the package default as long as cutlass has not been imported.
"""
from __future__ import annotations

import os
import sys
import warnings
from typing import Optional

ENV = "CUTE_DSL_ARCH"
DEFAULT = "sm_90a"

_package_default: Optional[str] = None  # the value select() wrote itself (not the user's)


def select(default: str = DEFAULT) -> str:
    """Set CUTE_DSL_ARCH to `default` if it is unset, and return the value in effect."""
    global _package_default
    if os.environ.get(ENV) is None:
        if "cutlass" in sys.modules:
            warnings.warn(f"cutlass was imported before {ENV} was set; the DSL may target the wrong "
                          "architecture", stacklevel=3)
        os.environ[ENV] = default
        _package_default = default
    return os.environ[ENV]


def retarget(arch: str, *, override_user: bool = False) -> Optional[str]:
    """Make `arch` the target if that is still possible, and return the value in effect.

    Possible while cutlass is not imported, and only over `select`'s own default unless
    override_user (an explicit command-line choice) allows replacing the user's value too. The
    caller compares the result with `arch` and decides what a mismatch means."""
    global _package_default
    current = os.environ.get(ENV)
    if "cutlass" in sys.modules:
        return current
    if current is None or current == _package_default or override_user:
        os.environ[ENV] = arch
        _package_default = None
    return os.environ[ENV]
