"""Each kernel kind builds itself from a proposed group's members.

:data:`BUILDERS` maps a kernel kind (the kind :mod:`~streamsched.passes.fusion.propose`
names for each group) to the function that builds its kernel from a :class:`Group`: it
checks what only the whole group can tell (the members' inputs, in-place safety, whether
batching pays on this device), finds the inputs through the rewriter, stacks the members'
parameters, and returns the kernel with the nodes it reads (:class:`Built`), or ``None``
where the group stays unfused, with :attr:`Group.reason` saying why when it is a choice.
Adding a kernel kind is one builder here (registered with :func:`_builder`) and, for a
module type, one entry in :data:`~streamsched.passes.fusion.propose.MODULE_KINDS`.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Optional

import torch
from torch import fx, nn

from ...frontend.meta import TensorMeta
from ...frontend.nodes import is_glue, node_label, submodule
from ...ir.cost import estimate_node_cost
from .kernels import (
    BatchNormKernel,
    ConvKernel,
    ElementwiseKernel,
    FusedKernel,
    LayerNormKernel,
    LinearKernel,
    VmapKernel,
    WideKernel,
    private_template,
)
from .layout import SHARED, STACK, TRANSPOSED, fold
from .params import StackedTensors
from .propose import RANDOM_FUNCTIONS, RANDOM_MODULES
from .rewrite import Rewriter, Source, inplace

__all__ = ["BUILDERS", "Built", "Group"]

log = logging.getLogger(__name__)

_CHEAP = "would need a stacked copy of its inputs: not worth it for a cheap op"


@dataclass
class Built:
    """A group's kernel, the nodes it reads, and (for a wide kernel) the members' widths."""

    kernel: FusedKernel
    inputs: list[fx.Node]
    sizes: Optional[tuple[int, ...]] = None


class Group:
    """One proposed group while its kernel is built: the members, and what a builder may
    ask of the rewriter about them."""

    def __init__(self, rw: Rewriter, members: list[fx.Node]):
        self.rw = rw
        self.members = members
        self.anchor = members[0]
        self.names = [node_label(m) for m in members]
        self.out_shape = rw.shape(self.anchor)
        self.reason = ""
        """Why the group stays unfused, where a builder gave up on purpose."""

    @cached_property
    def modules(self) -> list[nn.Module]:
        return [submodule(self.rw.root, m.target) for m in self.members]

    @property
    def out_dtype(self) -> torch.dtype:
        """What each member returned on the recording call (the kernel must match it)."""
        meta = self.rw.metas[self.anchor]
        assert isinstance(meta, TensorMeta), self.anchor
        return meta.dtype

    def input_dtypes(self) -> list[torch.dtype]:
        """The dtypes of the anchor's tensor arguments, as recorded."""
        metas = [self.rw.metas.get(a) for a in self.anchor.args if isinstance(a, fx.Node)]
        return [m.dtype for m in metas if isinstance(m, TensorMeta)]

    @property
    def single_input(self) -> bool:
        return len(self.anchor.args) == 1 and not self.anchor.kwargs

    def give_up(self, reason: str) -> None:
        self.reason = reason
        return None

    def source(self, k: int) -> Source:
        """Argument ``k`` of every member, as one input of the fused node."""
        return self.rw.source([m.args[k] for m in self.members], self.anchor)

    def sources(self) -> list[Source]:
        return [self.source(k) for k in range(len(self.anchor.args))]

    def copied(self, sources: list[Source]) -> bool:
        """Whether any input had to be copied together with ``torch.stack``."""
        return any(self.rw.is_copy(s.node) for s in sources)

    def stack(self, name: str, concat: bool = False) -> Optional[StackedTensors]:
        """The members' tensor ``name`` as one stack (``concat``: of different widths,
        concatenated), or ``None`` where the first member has none (``bias=False``)."""
        if getattr(self.modules[0], name, None) is None:
            return None
        return self.stack_path(name, concat)

    def stack_path(self, name: str, concat: bool = False) -> StackedTensors:
        """The members' tensor at ``name``, a path like ``a.weight`` (as
        ``named_parameters`` gives it), as one stack."""
        path, _, leaf = name.rpartition(".")
        owners = [(m.get_submodule(path) if path else m, leaf) for m in self.modules]
        return self.rw.stacks.stack_for(owners, concat=concat)

    def inplace(self) -> bool:
        return inplace(self.anchor, self.modules[0] if self.anchor.op == "call_module" else None)

    def inplace_safe(self) -> bool:
        # Applying the op once to the stacked tensor is only the same as N in-place ops
        # when nobody else can see the members' inputs: fresh values with one reader.
        for m in self.members:
            inp = m.args[0] if m.args else None
            if not isinstance(inp, fx.Node) or len(inp.users) != 1:
                return False
            if inp.op not in ("call_module", "call_function", "call_method") or is_glue(inp):
                return False
        return len({m.args[0] for m in self.members}) == len(self.members)

    def compute_bound_on_cpu(self) -> bool:
        # A CPU launch costs microseconds, a convolution over a feature map far more:
        # batching members saves nothing there, and grouped kernels plus the stacked input
        # copy were measured slower (NASNet, RandWire cells). On GPUs batching pays.
        device = self.rw.device
        if device.name != "cpu":
            return False
        work = estimate_node_cost(self.anchor, self.modules[0], self.rw.metas, device) - device.launch_us
        return work > 20 * device.launch_us


Builder = Callable[[Group], Optional[Built]]

BUILDERS: dict[str, Builder] = {}
"""Kernel kind -> the function that builds a group of that kind."""


def _builder(kind: str) -> Callable[[Builder], Builder]:
    def register(fn: Builder) -> Builder:
        BUILDERS[kind] = fn
        return fn

    return register


@_builder("linear")
def _linear(g: Group) -> Optional[Built]:
    if not g.single_input:
        return None
    (src,) = g.sources()
    kernel = LinearKernel(
        g.modules,
        g.names,
        g.stack("weight"),
        g.stack("bias"),
        src.layout,
        src.shape,
        g.out_shape,
        transposed_output(g, src),
    )
    return Built(kernel, [src.node])


TRANSPOSED_MIN_ROWS = 16
"""Rows (the members' first dim) from which a Linear chain runs transposed on the CPU.
Measured (1 thread, ``baddbmm``): under 16 rows ``xs @ W^T`` was the faster one, up to
3x at 1 row (64 members 32 -> 32: 13 us against 42), even 2x at 8; from 16 rows ``W @ x``
over transposed activations was (32 critics 64 -> 64 at 16 rows: 37 us against 55; 1,000
MLPs 10 -> 1 at 64 rows: 107 us against 680)."""

FOLD_TRANSPOSED_MAX_WEIGHT = 4096
"""A Linear reading a fold of its features (``x[:, 20*i : 20*(i+1)]``) reads it as a
transposed view when its weight has at most this many entries: for small members the
view's matmul was the faster one (1,000 MLPs 20 -> 10 at 64 rows: 631 us against 1180);
for large ones it was slower (8 members 256 -> 256 at 256 rows: 2150 us against 1910)."""


def transposed_output(g: Group, src: Source) -> bool:
    """Whether a Linear group writes its output ``TRANSPOSED`` (``[N, out, rows]``).

    On the CPU only, where ATen's batched matmul runs slower with an operand that is a
    transposed view: the stacked ``xs @ W^T`` reads the weight stack ``[N, out, in]``
    transposed, and ``W @ x`` over activations held ``[N, in, rows]`` reads nothing
    transposed (see :data:`TRANSPOSED_MIN_ROWS`; on a GPU cuBLAS takes
    either orientation as it is). For 2-d members of at least that many rows whose input
    is one shared tensor (one ``addmm`` with its transpose), already ``TRANSPOSED``, a
    stack, or a fold of small members' features (:data:`FOLD_TRANSPOSED_MAX_WEIGHT`),
    where what reads the output is a chain of fused groups ending in Linears
    (``Rewriter.feeds_linear``: the layout carries through them with no copy), or where
    there is one output feature (``[N, 1, rows]`` is the stack's memory; a shared input's
    wide linear is one already). Anything else reading the layout reads it through a
    view.

    Not in a plan that runs with autograd on (the grad mode is part of a plan's key):
    there the kernels compute stacked (``StackedLinear``, whose backward lays out every
    member's gradient as eager does) and would hand their result over as a transposed
    view, which only added work (the ReLU after it, written in place on a view, put
    CopySlices into the backward; not in place, it allocated): the training step of
    ParallelFCN(1000) took 1.23x the hand-written stack's time, 1.12x stacked."""
    if g.rw.grad or g.rw.device.name != "cpu" or len(src.shape) != 2 or len(g.out_shape) != 2:
        return False
    if g.out_shape[0] < TRANSPOSED_MIN_ROWS:
        return False
    layout = src.layout
    if layout == fold(1):
        m = g.modules[0]
        if m.in_features * m.out_features > FOLD_TRANSPOSED_MAX_WEIGHT:
            return False
    elif layout not in (SHARED, TRANSPOSED, STACK):
        return False
    if g.out_shape[1] == 1 and layout != SHARED:
        return True
    return g.rw.feeds_linear(g.members)


@_builder("conv")
def _conv(g: Group) -> Optional[Built]:
    if g.compute_bound_on_cpu():
        return g.give_up("convolutions with real work per member on CPU: a grouped conv is slower")
    if not g.single_input:
        return None
    (src,) = g.sources()
    kernel = ConvKernel(g.modules, g.names, g.stack("weight"), g.stack("bias"), src.layout, src.shape, g.out_shape)
    return Built(kernel, [src.node])


@_builder("batchnorm")
def _batchnorm(g: Group) -> Optional[Built]:
    if not g.single_input:
        return None
    sources = g.sources()
    if g.copied(sources):
        return g.give_up(_CHEAP)
    src = sources[0]
    statistics = [g.stack(n) for n in ("running_mean", "running_var", "num_batches_tracked")]
    if _updates_copies(g, statistics):
        return g.give_up(_COPIED_STATE)
    kernel = BatchNormKernel(g.modules, g.names, g.stack("weight"), g.stack("bias"), *statistics, src.layout, src.shape)
    return Built(kernel, [src.node])


_COPIED_STATE = (
    "its running statistics would be stacked per call (fuse_params='copy', or a buffer no stack can "
    "alias): the batched kernel's update in training would not reach the members"
)


def _updates_copies(g: Group, stacks: list) -> bool:
    """Whether a kernel in training would update buffers through stacks that are per-call
    copies of the members' (copy mode): the members would keep their old values."""
    training = any(m.training for m in g.modules)
    return training and any(s is not None and not s.alias for s in stacks)


@_builder("layernorm")
def _layernorm(g: Group) -> Optional[Built]:
    if not g.single_input:
        return None
    sources = g.sources()
    if g.copied(sources):
        return g.give_up(_CHEAP)
    src = sources[0]
    kernel = LayerNormKernel(g.modules, g.names, g.stack("weight"), g.stack("bias"), src.layout, src.shape)
    return Built(kernel, [src.node])


@_builder("elementwise")
def _elementwise_module(g: Group) -> Optional[Built]:
    if not g.single_input:
        return None
    if g.inplace() and not g.inplace_safe():
        return g.give_up("in-place members whose inputs other nodes read")
    sources = g.sources()
    if g.copied(sources):
        return g.give_up(_CHEAP)
    src = sources[0]
    m = g.modules[0]
    random = isinstance(m, RANDOM_MODULES)
    operands = [("t", src.layout, src.shape)]
    kernel = ElementwiseKernel(m, type(m).__name__, g.names, len(g.members), operands, {}, g.out_shape, random)
    return Built(kernel, [src.node])


@_builder("function")
def _elementwise_function(g: Group) -> Optional[Built]:
    """Elementwise functions and tensor methods (``torch.relu``, ``x.add(y)``, ``a * b``)."""
    if g.inplace() and not g.inplace_safe():
        return None
    anchor = g.anchor
    operands = []
    sources = []
    for k, a in enumerate(anchor.args):
        if isinstance(a, fx.Node):
            src = g.source(k)
            operands.append(("t", src.layout, src.shape))
            sources.append(src)
        else:
            operands.append(("c", a))
    if g.copied(sources):
        return None  # stacking the inputs would cost as much as the op itself
    if anchor.op == "call_method":
        fn = getattr(torch.Tensor, str(anchor.target))
        name = str(anchor.target)
    else:
        fn = anchor.target
        name = getattr(fn, "__name__", "op")
    random = fn in RANDOM_FUNCTIONS
    kernel = ElementwiseKernel(fn, name, g.names, len(g.members), operands, dict(anchor.kwargs), g.out_shape, random)
    return Built(kernel, [s.node for s in sources])


# When a vmap kernel pays. Each call of one costs a fixed few hundred microseconds of
# host time (``torch.func.vmap`` over ``functional_call``, which swaps the stacked tensors
# into the template module), against the module calls it replaces (a few microseconds
# each), and on the CPU it computes on the members' inputs broadcast to the whole group.
# Measured on the CPU (1 thread): a pair of small affine+ReLU modules ran 2.6x slower
# fused, 8 of them 1.9x; 64 on 32x2x2 inputs ran 1.2x faster, 256 2.4x; on 32x16x16
# inputs 64 ran 2.3x slower and 256 even. The members: at least VMAP_MIN_MEMBERS; on the
# CPU each output at most VMAP_MAX_CPU_ELEMENTS elements.
VMAP_MIN_MEMBERS = 32
VMAP_MAX_CPU_ELEMENTS = 4096


@_builder("vmap")
def _vmap(g: Group) -> Optional[Built]:
    """Any other module type with parameters or buffers, where ``vmap`` can batch it, and
    where that pays (:data:`VMAP_MIN_MEMBERS`)."""
    template = g.modules[0]
    if len(g.members) < VMAP_MIN_MEMBERS:
        return g.give_up(
            f"a vmap kernel costs more than {len(g.members)} module calls (it pays from {VMAP_MIN_MEMBERS} members)"
        )
    elements = math.prod(g.out_shape)
    if g.rw.device.name != "cuda" and elements > VMAP_MAX_CPU_ELEMENTS:
        return g.give_up(
            f"a vmap kernel on the CPU is slower than the module calls for outputs of {elements} elements "
            f"(it pays up to {VMAP_MAX_CPU_ELEMENTS})"
        )
    if g.rw.autocast:
        # vmap's batching rules do not cast as autocast casts the members' ops: a Linear
        # with a batched bias ran in float32 where the member runs in bfloat16, and a
        # BatchNorm met bfloat16 activations with float32 statistics, which the batched
        # batch_norm refuses.
        return g.give_up("vmap under autocast: batched ops are not cast as the members' ops are")
    inputs = g.input_dtypes()
    if not all(d.is_floating_point for d in inputs):
        # Indices and masks: an Embedding with max_norm renormalises its weight in place,
        # which the stacked parameters' views refuse; nothing here batches such inputs.
        return g.give_up("vmap with integer or boolean inputs: not batched")
    floats = {t.dtype for t in (*template.parameters(), *template.buffers()) if t.is_floating_point()}
    floats.update(inputs)
    if len(floats) > 1:
        # Unbatched ops accept some mixes (a bf16 input with float32 BatchNorm statistics);
        # their batching rules do not, and the meta trial cannot tell.
        names = ", ".join(sorted(str(d).replace("torch.", "") for d in floats))
        return g.give_up(f"vmap with mixed floating dtypes ({names}): batched ops do not mix them as the members do")
    sources = g.sources()
    params = {n: g.stack_path(n) for n, _ in template.named_parameters()}
    buffers = {n: g.stack_path(n) for n, b in template.named_buffers() if b is not None}
    if _updates_copies(g, list(buffers.values())):
        return g.give_up(_COPIED_STATE)
    trial = _vmap_trial(template, sources, inputs, dict(g.anchor.kwargs), g.out_shape, g.out_dtype)
    if not trial:
        return g.give_up("vmap cannot batch it")
    inputs = [(s.layout, s.shape) for s in sources]
    kernel = VmapKernel(g.modules, g.names, params, buffers, inputs, dict(g.anchor.kwargs), g.out_shape)
    return Built(kernel, [s.node for s in sources])


@_builder("wide")
def _wide(g: Group) -> Optional[Built]:
    """Linear/Conv members of different widths reading one tensor (see ``propose``)."""
    mods = g.modules
    sizes = [int(m.weight.shape[0]) for m in mods]
    if type(mods[0]) is nn.Linear:
        split_dim = len(g.out_shape) - 1
    else:
        split_dim = len(g.out_shape) - len(mods[0].kernel_size) - 1
    kernel = WideKernel(mods, g.names, g.stack("weight", True), g.stack("bias", True), sizes, split_dim, g.out_shape)
    return Built(kernel, [g.anchor.args[0]], tuple(sizes))


def _vmap_trial(
    template: nn.Module,
    sources: list[Source],
    dtypes: list[torch.dtype],
    kwargs: dict,
    out_shape: tuple[int, ...],
    out_dtype: torch.dtype,
) -> bool:
    """Whether vmap can batch this module: one trial call on the meta device, on inputs
    of the members' recorded dtypes, giving the members' output shape and dtype."""
    n = 2
    template, _ = private_template(template)  # the swap must not touch the member (kernels.private_template)
    try:
        params = {
            k: torch.empty((n,) + tuple(p.shape), dtype=p.dtype, device="meta") for k, p in template.named_parameters()
        }
        buffers = {
            k: torch.empty((n,) + tuple(b.shape), dtype=b.dtype, device="meta")
            for k, b in template.named_buffers()
            if b is not None
        }
        if len(dtypes) != len(sources):
            return False
        xs = [
            torch.empty(s.shape if s.layout == SHARED else (n,) + tuple(s.shape), dtype=dtype, device="meta")
            for s, dtype in zip(sources, dtypes)
        ]
        dims = tuple(None if s.layout == SHARED else 0 for s in sources)

        def f(p, b, *args):
            return torch.func.functional_call(template, (p, b), args, kwargs)

        with torch.no_grad():
            out = torch.func.vmap(f, in_dims=(0, 0) + dims, randomness="different")(params, buffers, *xs)
        return isinstance(out, torch.Tensor) and tuple(out.shape) == (n,) + tuple(out_shape) and out.dtype == out_dtype
    except Exception as exc:  # noqa: BLE001 - any failure means "do not fuse"
        log.debug("vmap trial failed: %s", exc)
        return False
