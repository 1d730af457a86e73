"""Torch CPU tensors pickled as their bytes: one out-of-band buffer each, shared when large.

``buffers.pickler`` pickles with :class:`TensorPickler` once the program has
imported torch, at either end of a channel (a rank, and the supervisor's
``aiospawn._core._pickles``): a plain dense CPU tensor travels as its bytes,
which ``buffers`` puts in a memfd when large, and is rebuilt over them with
``torch.frombuffer``. Any other tensor, and anything else, keeps torch's own
pickling. Pickling never imports torch (it is found in ``sys.modules``); only
the rebuild does, in a process that receives a tensor.

Part of the rank-side package: standard library only.
"""

from __future__ import annotations

import pickle
import sys

# For the checker only: a rank never imports typing (the package's import rule).
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class TensorPickler(pickle.Pickler):
    """A pickler that sends a dense CPU tensor's bytes as a buffer (torch is imported)."""

    def reducer_override(self, obj: Any) -> Any:
        torch = sys.modules.get("torch")
        if torch is None or type(obj) is not getattr(torch, "Tensor", None):
            return NotImplemented
        return _reduce_tensor(obj)


def _reduce_tensor(tensor: Any) -> Any:
    """``(rebuild, args)`` for a plain dense CPU tensor, else NotImplemented (torch's own).

    Torch pickles a tensor through ``torch.save``'s machinery, copying its
    storage in band. Here its bytes (the span its strides cover, from its
    first element) become one out-of-band buffer, shared when large.
    Subclasses (``Parameter``), other devices and layouts, quantized, nested,
    conjugated or negated views, non-leaf tensors that need grad and tensors
    with attributes of their own keep torch's pickling, which knows them.
    """
    import ctypes

    try:
        if (
            tensor.device.type != "cpu"
            or tensor.layout is not sys.modules["torch"].strided
            or tensor.is_quantized
            or tensor.is_nested
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor.grad_fn is not None
            or tensor.__dict__
        ):
            return NotImplemented
        shape = tuple(tensor.shape)
        stride = tuple(tensor.stride())
    except Exception:  # a tensor that is not what it seems (a mock, a future kind)
        return NotImplemented
    if any(step < 0 for step in stride):
        return NotImplemented
    if tensor.numel() == 0:
        return _rebuild_tensor, (b"", tensor.dtype, shape, stride, tensor.requires_grad)
    span = 1 + sum((size - 1) * step for size, step in zip(shape, stride, strict=True))
    memory = (ctypes.c_char * (span * tensor.element_size())).from_address(tensor.data_ptr())
    memory._tensor = tensor  # the memory lives while the view does
    return _rebuild_tensor, (
        pickle.PickleBuffer(memory),
        tensor.dtype,
        shape,
        stride,
        tensor.requires_grad,
    )


def _rebuild_tensor(
    data: Any, dtype: Any, shape: tuple[int, ...], stride: tuple[int, ...], requires_grad: bool
) -> Any:
    """The tensor :func:`_reduce_tensor` took apart, over ``data`` (no copy)."""
    import torch

    if memoryview(data).nbytes == 0:
        tensor = torch.empty_strided(shape, stride, dtype=dtype)
    else:
        tensor = torch.frombuffer(data, dtype=dtype).as_strided(shape, stride)
    if requires_grad:
        tensor.requires_grad_()
    return tensor
