"""Linear layers whose weights are packed once for oneDNN.

``F.linear`` on a CPU hands a plain row-major weight to the BLAS on every call. With the few
rows of a decode tick (1-64 tokens) that product is far from the memory bandwidth: on our
2-core machine the 30 layers of the default model took 50 ms for 4 rows. oneDNN's own blocked
weight layout, made once at load (``mkldnn._reorder_linear_weight``), took 18 ms for the same
product and was faster at every row count we measured (1.1-1.3x for whole prompts), in float32
and bfloat16. Results differ from ``F.linear`` only by summation order (~1e-6 relative).

These are the ops torch's own CPU compiler uses for frozen linear layers. Where they are
missing (a torch built without oneDNN) or fail on the first call, the layer keeps the plain
weight and ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _packing_ops():
    if not torch.backends.mkldnn.is_available():
        return None
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        return ops._reorder_linear_weight, ops._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


class Linear:
    """y = x @ weight.T + bias for x [T, in]; weight [out, in] (dense, or packed at init)."""

    __slots__ = ("weight", "bias", "out_features", "_packed", "_op")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 keep_dense: bool = False):
        self.out_features = weight.shape[0]
        self.bias = bias
        self.weight = weight  # [out, in]; dropped once packed unless keep_dense
        self._packed = None
        self._op = None
        ops = _packing_ops() if pack else None
        if ops is None:
            return
        reorder, pointwise = ops
        try:
            packed = reorder(weight, 64)  # the row count the layout is tuned for; any count works
            probe = torch.zeros(1, weight.shape[1], dtype=weight.dtype)
            pointwise(probe, packed, bias, "none", [None], "")
        except RuntimeError:
            return
        self._packed, self._op = packed, pointwise
        if not keep_dense:
            self.weight = None

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        if self._packed is None:
            return F.linear(x, self.weight, self.bias)
        return self._op(x, self._packed, self.bias, "none", [None], "")
