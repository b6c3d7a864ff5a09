"""bf16 linear layers with their weights prepacked for oneDNN, for inference on a CPU.

`F.linear` on a bf16 CPU tensor reorders the weight into oneDNN's blocked layout at every call. At the
sizes a decoding step has (a few to a few hundred rows, 256-wide layers on the shapes model) that
reorder costs as much as the matmul: a 256 -> 768 layer over 2 rows took 44 us, and 22 us with the
weight packed once (docs/design.md, "CPU kernels"). The packed call computes the same bf16 result, bit
for bit (tests/test_models.py), so images do not change; only time does.

`pack_linears(module)` turns a module's bf16 `nn.Linear` layers into `PackedLinear`: same parameters,
same state dict. The packed copy is made on the first call without autograd and made again if the
weight changes in place (its version counter); with autograd, in another dtype or off the CPU the layer
is a plain `nn.Linear`. Copies and pickles of the module leave the packed copy behind (oneDNN's tensors
cannot be copied) and pack again on first use.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def available() -> bool:
    """oneDNN's packed linear op in this torch build, and a CPU its bf16 path runs on (AVX512 BW/VL/DQ or
    AVX-NE-CONVERT: on an AVX2-only CPU the reorder raises, and plain bf16 `F.linear` still works)."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _Packed:
    """The packed weight and the weight version it was packed from; copies start empty."""
    __slots__ = ("weight", "version")

    def __init__(self):
        self.weight, self.version = None, -1

    def __deepcopy__(self, memo) -> "_Packed":
        return _Packed()

    def __reduce__(self):
        return _Packed, ()


class PackedLinear(nn.Linear):
    _packed: _Packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (w.dtype != torch.bfloat16 or x.dtype != torch.bfloat16 or w.device.type != "cpu"
                or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad))):
            return F.linear(x, w, self.bias)
        p = self._packed
        if p.weight is None or p.version != w._version:
            p.weight, p.version = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None), w._version
        return torch.ops.mkldnn._linear_pointwise(x, p.weight, self.bias, "none", [], "")


def pack_linears(module: nn.Module) -> nn.Module:
    """Make every bf16 CPU `nn.Linear` in `module` a `PackedLinear` (in place; returns `module`). A no-op
    where oneDNN's bf16 path is not `available()`."""
    if not available():
        return module
    for m in module.modules():
        if type(m) is nn.Linear and m.weight.dtype == torch.bfloat16 and m.weight.device.type == "cpu":
            m.__class__ = PackedLinear
            m._packed = _Packed()
    return module
