"""Prepacked linear layers on CPUs: the same products, through oneDNN's packed weights.

On some CPUs the default BLAS path for ``x @ W.T`` with a few rows (a tree of 2-16
tokens) is far slower than its memory traffic allows: measured on a 2-core AMD EPYC
(Zen 3, AVX2), the 210 float32 products of one SmolLM2-135M forward took ~58 ms for 2
rows against ~30 ms for 1, while oneDNN with weights packed once ran 2-8 rows in
~25-40 ms. :class:`PackedLinears` is a ``TorchFunctionMode``: inside it, every
``F.linear`` whose weight has a packed copy runs through oneDNN; the model object
itself is untouched. Whether it is used is the calibration's decision
(:mod:`tokenswift.costs`), since it costs a copy of the weights and a little Python
overhead per operation, and is only worth it where it measures faster.
"""

from __future__ import annotations

import logging
import weakref

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tokenswift import kernels
from tokenswift.machine import native_bfloat16

logger = logging.getLogger(__name__)

PACK_ROWS_HINT = 4  # oneDNN picks its blocking for this many rows; 1-8 rows measured fastest with 4


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    """oneDNN packed linears exist for float32 on CPU builds with mkldnn."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def linear_arguments(args, kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(x, weight, bias)`` of an ``F.linear`` call, however they were passed."""
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    return args[0], weight, bias


_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> PackedLinears


class PackedLinears(TorchFunctionMode):
    """Runs ``F.linear`` through oneDNN for every weight packed in :meth:`pack`."""

    def __init__(self) -> None:
        super().__init__()
        self._packed: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, packed)

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> PackedLinears:
        """The packed linears of ``model``, made once and shared (the copy is large)."""
        mode = _PACKED.get(model)
        if mode is None:
            mode = _PACKED[model] = cls.pack(model)
            logger.info("linear layers packed for oneDNN (%.1f MiB copy)", mode.nbytes / 2**20)
        return mode

    @classmethod
    def pack(cls, model: torch.nn.Module) -> PackedLinears:
        """Pack the weight of every ``nn.Linear`` in ``model`` (tied weights once)."""
        mode = cls()
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, torch.nn.Linear) and id(module.weight) not in mode._packed:
                    packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
                    mode._packed[id(module.weight)] = (module.weight, packed)
        return mode

    @property
    def nbytes(self) -> int:
        return sum(weight.numel() * weight.element_size() for weight, _ in self._packed.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = linear_arguments(args, kwargs)
            entry = self._packed.get(id(weight))
            if entry is not None and entry[0] is weight:
                return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")
        return func(*args, **kwargs)


class KernelLinears(TorchFunctionMode):
    """Runs ``F.linear`` of a few rows (:data:`tokenswift.kernels.MAX_LINEAR_ROWS`), float32
    or bfloat16, through :func:`tokenswift.kernels.few_rows_linear`: the weight read once
    for all rows, each row's result independent of the others. Other products are left
    alone. Active while a compiled forward is traced, it puts the kernel's operator in
    the graph. Whoever turns it on checks that the kernels are available."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = linear_arguments(args, kwargs)
            if kernels.linear_serves(x, weight):
                return kernels.few_rows_linear(x, weight, bias)
        return func(*args, **kwargs)


class KernelServedLinear(torch.nn.Module):
    """An ``nn.Linear``'s products of a few rows through
    :func:`tokenswift.kernels.few_rows_linear` (others through ``F.linear``): what
    :class:`KernelLinears` does for a whole model, for one module and without a mode
    that every other operation passes through (in the ``eagle`` drafter's proposal,
    ~1,200 operations a step). With ``dtype``, the weight is kept in it and the rows
    are rounded to it for the product (accumulated in float32), the result returned in
    the input's dtype: half the bytes read for a bfloat16 copy of float32 weights."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        weight, bias = linear.weight.detach(), linear.bias
        self.weight = weight if dtype is None else weight.to(dtype).contiguous()
        self.bias = bias if bias is None or dtype is None else bias.detach().to(dtype)
        # Rows the kernel does not take (the eagle drafter's catch-up on the pairs a run
        # of plain steps committed: 100+ rows) go through PyTorch; on a CPU without
        # native bfloat16 its bfloat16 products of many rows crawl, so there they are
        # computed in float32 on the same rounded values (an AMD EPYC Zen 3: a catch-up
        # took ~210 ms in bfloat16). Drafts only choose what is verified.
        self.widen_many_rows = self.weight.dtype == torch.bfloat16 and not native_bfloat16(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.to(self.weight.dtype)
        if kernels.linear_serves(rows, self.weight):
            return kernels.few_rows_linear(rows, self.weight, self.bias).to(x.dtype)
        if self.widen_many_rows:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(rows.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(rows, self.weight, self.bias).to(x.dtype)


def serve_linears_by_kernel(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Replace every ``nn.Linear`` inside ``module`` by a :class:`KernelServedLinear` of
    the same parameters (in ``dtype``, default theirs; in place; returns ``module``).
    Whoever calls it checks that the kernels are available."""
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            setattr(module, name, KernelServedLinear(child, dtype))
        else:
            serve_linears_by_kernel(child, dtype)
    return module
