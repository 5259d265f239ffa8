"""The verdict cache of the launchers' metadata-only argument checks (:func:`memoize_metadata_check`).

The argument checks (:mod:`triton_kernels.step_args`, :mod:`triton_kernels.tail_merge_args`) run per layer
and step in eager mode. All but the overlap checks read metadata only (shapes, strides, dtypes, devices and
the Python scalars passed), so :func:`memoize_metadata_check` keeps their verdicts on metadata seen before
(a failing check is never kept); the overlap checks, which read addresses, run on every call.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, TypeVar

import torch

__all__ = ["METADATA_CHECKS_KEPT", "memoize_metadata_check"]

# The metadata keys of the checks' past verdicts a memoized check keeps (one per layer and argument set
# in a steady eager run); past it the store starts over.
METADATA_CHECKS_KEPT = 1024

_SCALAR_TYPES = (bool, int, float, str)
# Every memoized check's store (tests empty them all to compare against the checks themselves).
_KEPT_STORES = []
_Check = TypeVar("_Check", bound=Callable)


def _metadata_key(values) -> Optional[tuple]:
    """A hashable key of everything an address-free argument check reads from ``values``: each tensor's type,
    shape, strides, dtype and device, each scalar's type and value, recursing into tuples; ``None`` when a
    value is none of these (the check then runs)."""
    key = []
    for v in values:
        if isinstance(v, torch.Tensor):
            key += (type(v), v.shape, v.stride(), v.dtype, v.device)
        elif v is None or type(v) in _SCALAR_TYPES:
            key += (type(v), v)
        elif type(v) is tuple:
            inner = _metadata_key(v)
            if inner is None:
                return None
            key.append(inner)
        else:
            return None
    return tuple(key)


def memoize_metadata_check(check: _Check, every_call: Optional[Callable] = None) -> _Check:
    """``check`` (a function of its arguments' metadata alone, addresses excluded: it must not compare where
    tensors lie; returning an immutable result or raising) with its results kept by :func:`_metadata_key`:
    equal metadata gets the kept result without the check (a key is about a sixth of a full check's Python).
    Exceptions propagate and are not kept, and arguments a key cannot describe are checked every time.
    Leaving addresses out, one verdict serves every layer and step of a shape, wherever its tensors lie.
    ``every_call`` (same arguments) runs after it on every call, kept result or not: the checks that do
    read addresses."""
    kept = {}
    _KEPT_STORES.append(kept)

    @functools.wraps(check)
    def checked(*args, **kwargs):
        try:
            key = _metadata_key(args + tuple(sorted(kwargs.items())))
        except RuntimeError:  # e.g. a sparse tensor's strides: the check names what is wrong
            key = None
        result = None if key is None else kept.get(key)
        if result is None:
            result = check(*args, **kwargs)
            if key is not None:
                if len(kept) >= METADATA_CHECKS_KEPT:
                    kept.clear()
                kept[key] = result
        if every_call is not None:
            every_call(*args, **kwargs)
        return result

    checked.kept = kept  # for tests
    return checked
