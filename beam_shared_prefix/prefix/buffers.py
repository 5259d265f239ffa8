"""Persistent device buffers that plans reuse, so ``run()`` never allocates and a captured graph stays valid.

Every tensor ``run()`` reads or writes besides its arguments (prefix output, prefix LSE, per-row
prompt lengths, FA4's page table...) is a view of the first elements of a :class:`DeviceBuffer`.
Eagerly, the allocation grows when a bigger plan comes (at plan time, never under capture). In
CUDA-graph mode it is allocated once at its capacity and never moved: a re-plan only rewrites its
contents, which is what a captured ``run()`` replays with.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["DeviceBuffer", "padded_page_table"]


class DeviceBuffer:
    """A flat allocation on ``device`` handing out views of its first ``prod(shape)`` elements.

    Args:
        name: used in error messages.
        dtype, device: of the allocation.
        frozen: CUDA-graph mode: allocate once (at ``max(capacity, first request)`` elements) and
            raise instead of reallocating, because a captured graph keeps the old address.
    """

    def __init__(self, name: str, dtype: torch.dtype, device, frozen: bool = False):
        self.name = name
        self.dtype = dtype
        self.device = torch.device(device)
        self.frozen = bool(frozen)
        self._storage: Optional[torch.Tensor] = None

    @property
    def capacity(self) -> int:
        """Elements allocated (0 before the first :meth:`view`)."""
        return 0 if self._storage is None else self._storage.numel()

    def view(self, shape: Sequence[int], capacity: int = 0) -> torch.Tensor:
        """A contiguous ``shape`` view of the buffer's first elements, allocating or growing if needed.

        Args:
            shape: the view's shape.
            capacity: elements to reserve on the first allocation (CUDA-graph mode sizes it from the
                wrapper's ``max_*`` arguments so no later plan needs more).
        """
        numel = int(np.prod(shape)) if len(shape) else 1
        if self._storage is None or numel > self._storage.numel():
            if self._storage is not None and self.frozen:
                raise RuntimeError(
                    f"{self.name}: a plan of shape {tuple(shape)} needs {numel} elements but the CUDA-graph "
                    f"buffer holds {self._storage.numel()} and cannot move (captured graphs read it in "
                    f"place). Its size was fixed by the first plan from max_requests / max_beam_width / "
                    f"max_prompt_pages and that plan's heads and head size: construct the wrapper with "
                    f"larger max_* arguments, or a new wrapper for another attention shape."
                )
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{self.name}: cannot allocate during CUDA-graph capture; plan before capturing.")
            # Grow with slack so a slowly growing batch does not reallocate on every plan.
            size = max(numel, int(capacity), 0 if self._storage is None else self._storage.numel() * 5 // 4)
            self._storage = torch.empty(max(size, 1), dtype=self.dtype, device=self.device)
        return self._storage[:numel].view(*shape)

    def write(self, array: np.ndarray, shape: Optional[Sequence[int]] = None, capacity: int = 0) -> torch.Tensor:
        """Copy a host array into the buffer (plan time) and return the device view of it: ``shape`` (default the
        array's), in the buffer's dtype (the values are cast), at the buffer's fixed address in CUDA-graph mode
        (``capacity`` elements reserved there on first use)."""
        array = np.ascontiguousarray(array)
        view = self.view(tuple(array.shape) if shape is None else tuple(shape), capacity)
        view.copy_(torch.from_numpy(array.copy()).view(view.shape).to(self.dtype))
        return view


def padded_page_table(page_table: np.ndarray, width: int) -> np.ndarray:
    """``page_table`` ``[R, n]`` widened to ``[R, width]`` (``width >= n``).

    New columns repeat each request's first page, like the plan's own padding, so every entry is a
    valid page index even for a kernel that prefetches past the prompt.
    """
    n = page_table.shape[1]
    if width < n:
        raise ValueError(f"cannot narrow a page table of {n} columns to {width}")
    if width == n:
        return page_table
    return np.concatenate([page_table, np.repeat(page_table[:, :1], width - n, axis=1)], axis=1)
