"""Training through fusions: a ``torch.autograd.Function`` from a forward fusion and its backward fusion.

``fd.execute`` is forward only, as in nvFuser. To train, write the backward math as a second fusion
and join the two, as nvFuser's tests do with their ``LinearFunction``::

    Linear = tp_fusion.autograd.function(forward_fd, backward_fd, saved_inputs=[0, 1])
    y = Linear.apply(x, w)          # forward_fd.execute([x, w]); y requires grad
    y.sum().backward()              # backward_fd.execute([x, w, grad_y]) -> x.grad, w.grad

What each fusion sees:

- the forward fusion gets the inputs of ``apply``, in order;
- the backward fusion gets the saved tensors, then one gradient per differentiable returned output:
  ``[*inputs[saved_inputs], *outputs[saved_outputs], *grad_outputs]``. A returned output is
  differentiable when its dtype is floating point (masks and philox seeds are not); a gradient that
  nothing produced comes as zeros;
- the backward fusion's outputs are the gradients of the forward inputs in ``grad_inputs`` (default:
  every tensor input), in that order; the other inputs get no gradient;
- a scalar input (``define_scalar(None, dtype)``: a dropout's seed, say) is a number in ``apply``; it
  may be saved for the backward fusion (a scalar input there too) and has no gradient. A seed or offset
  read this way builds no new plan when it changes.

``outputs`` (default: all) picks the forward outputs that ``apply`` returns; the others (layer-norm
statistics, attention's logsumexp) are only kept for ``saved_outputs``.

Inputs may be local shards (plain tensors or ``nn.Parameter``s holding this rank's shard: both
fusions carry their own schedules, and each gradient must have its input's local shape) or DTensors
(``nn.Parameter(distribute_tensor(...))`` included): then both fusions run through
``execute_with_dtensors``, which annotates their inputs, incoming gradients are redistributed to their
output's placements, and each backward output that the backward fusion leaves unscheduled is computed
in its DTensor input's sharding (a reduce_scatter where the gradient sums over ranks, not an allreduce
and a slice). Every rank calls ``apply`` and ``backward`` in the same order, as with ``execute``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tp_fusion.compile import as_declared, scalar_inputs
from tp_fusion.errors import DefinitionError, ShardingError
from tp_fusion.fusion_definition import FusionDefinition
from tp_fusion.runtime.dist import is_dtensor
from tp_fusion.sharding.reshard import held_already


def function(forward: FusionDefinition, backward: FusionDefinition, *, saved_inputs: Sequence[int] = (),
             saved_outputs: Sequence[int] = (), outputs: Sequence[int] | None = None,
             grad_inputs: Sequence[int] | None = None, name: str = "FusionFunction") -> type[torch.autograd.Function]:
    """A ``torch.autograd.Function`` subclass running ``forward`` then, on ``backward()``, ``backward``.

    ``saved_inputs`` / ``saved_outputs``: indices of the forward inputs / outputs handed to the
    backward fusion first; ``outputs``: the forward outputs ``apply`` returns (default all);
    ``grad_inputs``: the forward inputs the backward fusion's outputs are the gradients of (default
    every tensor input; a scalar input has none). Call it as ``F.apply(*inputs)``. The counts of both
    fusions' inputs and outputs are checked here (a ``DefinitionError`` says which), and so are the dtypes
    and global shapes of the backward fusion's gradient inputs against their forward outputs'; dtypes of
    the returned outputs decide
    which of them are differentiable. A gradient whose local shape or sharding is not its input's
    raises a ``ShardingError`` in backward. See the module docstring for the conventions.
    """
    for fd, which in ((forward, "forward"), (backward, "backward")):
        if fd.fusion.aliases:
            raise DefinitionError(f"autograd.function {name}: the {which} fusion writes an output into its input in "
                                  "place (add_output(tv, alias_input=)), which autograd cannot track; add that "
                                  "output plainly and update the tensor outside the Function")
    n_in, n_out = len(forward.fusion.inputs), len(forward.fusion.outputs)
    saved_inputs = _indices(saved_inputs, n_in, "saved_inputs", "input")
    saved_outputs = _indices(saved_outputs, n_out, "saved_outputs", "output")
    outputs = _indices(range(n_out) if outputs is None else outputs, n_out, "outputs", "output")
    numbers = [i for i, name in enumerate(forward.fusion.inputs) if name in scalar_inputs(forward.fusion)]
    grad_inputs = _indices([i for i in range(n_in) if i not in numbers] if grad_inputs is None else grad_inputs, n_in,
                           "grad_inputs", "input")
    if set(grad_inputs) & set(numbers):
        raise DefinitionError(f"autograd.function {name}: grad_inputs {list(grad_inputs)} names forward input(s) "
                              f"{sorted(set(grad_inputs) & set(numbers))}, scalar inputs (numbers), which have no "
                              "gradient; leave them out of grad_inputs")
    if not outputs:
        raise DefinitionError(f"autograd.function {name}: outputs is empty; return at least one forward output")
    fwd = forward.fusion
    differentiable = tuple(i for i in outputs if fwd.tensor(fwd.outputs[i]).dtype.is_floating)
    n_grads = len(saved_inputs) + len(saved_outputs) + len(differentiable)
    bwd = backward.fusion
    if len(bwd.inputs) != n_grads:
        raise DefinitionError(
            f"autograd.function {name}: the backward fusion takes {len(bwd.inputs)} inputs, but it is given "
            f"{len(saved_inputs)} saved forward inputs {list(saved_inputs)}, {len(saved_outputs)} saved forward "
            f"outputs {list(saved_outputs)} and {len(differentiable)} output gradients (of the floating-point "
            f"returned outputs {list(differentiable)}) = {n_grads}; define that many tensors in the backward fusion")
    _check_gradient_inputs(name, fwd, bwd, differentiable, len(saved_inputs) + len(saved_outputs))
    if len(bwd.outputs) != len(grad_inputs):
        raise DefinitionError(
            f"autograd.function {name}: the backward fusion returns {len(bwd.outputs)} outputs, but grad_inputs "
            f"{list(grad_inputs)} asks for {len(grad_inputs)} gradients (one per forward input in grad_inputs, in "
            "that order); add outputs to the backward fusion or change grad_inputs")
    spec = _Spec(name, forward, backward, saved_inputs, saved_outputs, outputs, differentiable, grad_inputs)
    return type(name, (_FusionFunction,), {"spec": spec, "__doc__": f"forward and backward fusions of {name}"})


def _check_gradient_inputs(name: str, fwd, bwd, differentiable: tuple[int, ...], first: int) -> None:
    """DefinitionError unless each backward input from position ``first`` on, the gradient of a forward
    output in ``differentiable``, has that output's dtype and global shape (extents symbolic on either
    side are not compared): torch hands each output's gradient in the output's shape and dtype."""
    for j, i in enumerate(differentiable):
        out, grad = fwd.tensor(fwd.outputs[i]), bwd.tensor(bwd.inputs[first + j])
        same_shape = out.ndim == grad.ndim and all(a == b or a < 0 or b < 0 for a, b in zip(out.shape, grad.shape))
        if not same_shape or out.dtype != grad.dtype:
            raise DefinitionError(
                f"autograd.function {name}: the backward fusion's input {first + j} (T{grad.name} {grad.type_str()}) "
                f"is the gradient of forward output {i} (T{out.name} {out.type_str()}), which comes in that "
                f"output's dtype and global shape; define that backward input as {out.type_str()}")


def _indices(indices: Sequence[int], n: int, what: str, noun: str) -> tuple[int, ...]:
    out = tuple(indices)
    for i in out:
        if not isinstance(i, int) or not 0 <= i < n:
            raise DefinitionError(f"autograd.function: {what} holds {i!r}, but the forward fusion has {n} {noun}s "
                                  f"(indices 0..{n - 1})")
    if len(set(out)) != len(out):
        raise DefinitionError(f"autograd.function: {what} {list(out)} names an {noun} twice")
    return out


@dataclass(frozen=True)
class _Spec:
    """What a generated Function runs: its two fusions and which tensors go where."""

    name: str
    forward: FusionDefinition
    backward: FusionDefinition
    saved_inputs: tuple[int, ...]
    saved_outputs: tuple[int, ...]
    outputs: tuple[int, ...]
    differentiable: tuple[int, ...]
    grad_inputs: tuple[int, ...]


def _run(fd: FusionDefinition, tensors: list) -> list:
    """``fd`` on local shards, or through ``execute_with_dtensors`` when any tensor is a DTensor."""
    if any(is_dtensor(t) for t in tensors):
        from tp_fusion.dtensor import execute_with_dtensors

        return execute_with_dtensors(fd, tensors)
    return fd.execute(tensors)


class _Meta:
    """What backward needs to know of a forward input or output, without keeping the tensor alive:
    its shape and dtype, and its torch mesh and placements if it is a DTensor."""

    def __init__(self, t):
        self.shape, self.dtype = t.shape, t.dtype
        self.mesh, self.placements = (t.device_mesh, tuple(t.placements)) if is_dtensor(t) else (None, None)

    def redistribute(self, grad):
        """``grad`` as this tensor is: with its placements if it is a DTensor, else this rank's local
        shard (a backward that ran on DTensors gives DTensors for the plain inputs too)."""
        if not is_dtensor(grad):
            return grad
        if self.mesh is None:
            return grad.to_local()
        return grad.redistribute(self.mesh, self.placements) if tuple(grad.placements) != self.placements else grad


class _FusionFunction(torch.autograd.Function):
    """Base of the Functions ``function`` makes; ``spec`` is set on each subclass."""

    spec: _Spec

    @staticmethod
    def forward(ctx, *inputs):
        spec = _spec_of(ctx)
        outs = _run(spec.forward, list(inputs))  # checks the inputs (their number too) on every rank alike
        returned = [outs[i] for i in spec.outputs]
        ctx.mark_non_differentiable(*[outs[i] for i in spec.outputs if i not in spec.differentiable])
        saved = [*[inputs[i] for i in spec.saved_inputs], *[outs[i] for i in spec.saved_outputs]]
        ctx.save_for_backward(*[x if isinstance(x, torch.Tensor) else None for x in saved])
        ctx.saved_numbers = {k: x for k, x in enumerate(saved) if not isinstance(x, torch.Tensor)}  # scalar inputs
        ctx.output_meta = [_Meta(outs[i]) for i in spec.differentiable]
        ctx.input_meta = [_Meta(x) if isinstance(x, torch.Tensor) else None for x in inputs]
        plan = spec.forward.plan  # the sharding and global shape each input had: its gradient must have them too
        ctx.input_shardings = [plan.fusion.tensor(name).sharding for name in plan.fusion.inputs]
        ctx.input_global_shapes = [plan.fusion.tensor(name).shape for name in plan.fusion.inputs]
        # what the backward fusion's inputs are laid out as: saved inputs and outputs, then output gradients
        # (torch gives each the layout of its output); a DTensor's, the backward annotates from it
        out_shardings = plan.output_shardings()
        ctx.backward_input_shardings = (
            [None if ctx.input_meta[i] is None or ctx.input_meta[i].mesh is not None else ctx.input_shardings[i]
             for i in spec.saved_inputs]
            + [None if is_dtensor(outs[i]) else out_shardings[i] for i in (*spec.saved_outputs, *spec.differentiable)])
        return returned[0] if len(returned) == 1 else tuple(returned)

    @staticmethod
    def backward(ctx, *grads):
        spec = _spec_of(ctx)
        by_output = dict(zip(spec.outputs, grads))
        saved = [ctx.saved_numbers.get(k, t) for k, t in enumerate(ctx.saved_tensors)]
        # torch makes the incoming gradients (y.sum() gives a stride-0 one): lay them out as declared
        out_grads = [as_declared(spec.backward.fusion, len(saved) + j, meta.redistribute(by_output[i]))
                     for j, (i, meta) in enumerate(zip(spec.differentiable, ctx.output_meta))]
        if any(is_dtensor(t) for t in [*saved, *out_grads]):
            from tp_fusion.dtensor import schedule_output

            for k, i in enumerate(spec.grad_inputs):
                if ctx.input_meta[i].mesh is not None:  # a DTensor input: its gradient in its sharding
                    schedule_output(spec.backward, k, ctx.input_shardings[i], tuple(ctx.input_meta[i].shape),
                                    f"{spec.name}.backward: output {k}")
        results = _run(spec.backward, [*saved, *out_grads])
        _check_backward_inputs(spec, ctx.backward_input_shardings)
        bwd = spec.backward.plan.fusion
        input_grads: list = [None] * len(ctx.input_meta)
        for k, (i, grad) in enumerate(zip(spec.grad_inputs, results)):
            if not ctx.needs_input_grad[i]:
                continue
            inp = ctx.input_meta[i]
            if inp.mesh is not None and is_dtensor(grad) and grad.device_mesh != inp.mesh:
                raise ShardingError(
                    f"{spec.name}.backward: the backward fusion's output {k} is the gradient of forward input "
                    f"{i}, a DTensor on {inp.mesh}, but it came out on {grad.device_mesh}; give that backward "
                    f"output the input's mesh, or leave it unscheduled (it is then computed in the input's "
                    f"sharding)")
            grad = inp.redistribute(grad)
            want_global, got_global = ctx.input_global_shapes[i], bwd.tensor(bwd.outputs[k]).shape
            if want_global != got_global:
                raise ShardingError(
                    f"{spec.name}.backward: the backward fusion's output {k} is the gradient of forward input "
                    f"{i}, whose global shape is {list(want_global)}, but that output's is {list(got_global)}; a "
                    "gradient has its input's shape")
            if grad.shape != inp.shape:
                raise ShardingError(
                    f"{spec.name}.backward: the backward fusion's output {k} is the gradient of forward input "
                    f"{i}, which has local shape {list(inp.shape)}, but it came out {list(grad.shape)}; give "
                    f"that backward output the sharding of forward input {i}{_reduction_axes(spec.backward.fusion, k)}")
            want, got = ctx.input_shardings[i], bwd.tensor(bwd.outputs[k]).sharding
            if inp.mesh is None and not _holds(got, want, bwd.tensor(bwd.outputs[k]).shape):
                raise ShardingError(
                    f"{spec.name}.backward: the backward fusion's output {k} is the gradient of forward input "
                    f"{i}, which is sharded {want}, but it came out sharded {got}: each rank would get "
                    f"other elements than its shard of the input; give that backward output the sharding of "
                    f"forward input {i}{_reduction_axes(spec.backward.fusion, k)}")
            input_grads[i] = grad.to(inp.dtype) if grad.dtype != inp.dtype else grad
        if torch.is_grad_enabled() and any(t.requires_grad for t in (*ctx.saved_tensors, *grads) if t is not None):
            return _raising_if_differentiated(spec.name, input_grads)  # create_graph=True
        return tuple(input_grads)


def _reduction_axes(fusion, k: int) -> str:
    """A note for an error about the sharding of the gradient that is output ``k`` of the backward ``fusion`` (as
    defined), where its schedule parallelizes a reduction axis (``r``: a dim its op reduced, which a ``sum``'s
    loop domain keeps first, as nvFuser's): the dim meant is elsewhere."""
    name = fusion.outputs[k]
    t = fusion.tensor(name)
    axes = [a for a, ax in enumerate(t.loop or ()) if ax.reduction and ax.ptype.is_device]
    if not axes:
        return ""
    return (f" (T{name}'s loop domain {t.loop_str()} parallelizes axis {axes[0]}, a reduction axis: the dim its op "
            "reduced, which leaves a sum over the devices; split and parallelize the axis of the dim the input is "
            "sharded on, counted among its loop axes)")


def _raising_if_differentiated(name: str, grads: list) -> tuple:
    """``grads`` made to raise if autograd differentiates through them (a double backward: a gradient
    penalty, a Hessian-vector product). The backward fusion runs outside autograd, so their own gradients
    would silently be zero; torch's ``once_differentiable`` does the same, looking at the incoming
    gradients alone (here the saved inputs and outputs count too)."""
    given = [g for g in grads if g is not None]
    if not given:
        return tuple(grads)
    error = torch._C._functions.DelayedError(
        f"{name}: a tp_fusion.autograd.function is differentiable once; its backward fusion runs outside "
        "autograd, so a gradient of its gradients (create_graph=True, then backward through them) is not "
        "computed".encode(), len(given))
    raising = error(*[g.detach().requires_grad_() for g in given])
    raising = iter((raising,) if isinstance(raising, torch.Tensor) else raising)  # one tensor for one input
    return tuple(None if g is None else next(raising) for g in grads)


def _check_backward_inputs(spec: _Spec, given: list) -> None:
    """ShardingError unless each backward fusion input's sharding holds the pieces it was given in (the
    forward's sharding of that tensor; None: a DTensor, whose sharding the backward takes): a saved
    tensor or a gradient scheduled otherwise, with the same local shape, would be read as other rows."""
    fusion = spec.backward.plan.fusion
    for j, (name, want) in enumerate(zip(fusion.inputs, given)):
        got = fusion.tensor(name).sharding
        if not _holds(want, got, fusion.tensor(name).shape):
            raise ShardingError(
                f"{spec.name}.backward: the backward fusion's input {j} (T{name}) is scheduled as {got}, but "
                f"the tensor handed to it is sharded {want} by the forward fusion; schedule that backward input "
                "as the forward schedules the tensor")


def _holds(given, expected, shape) -> bool:
    """Whether a tensor laid out as ``given`` holds on every rank the pieces that ``expected`` reads (either
    None or without a mesh: nothing to compare; a local shape that differs is reported apart)."""
    return (given is None or expected is None or given.mesh is None or expected.mesh is None
            or held_already(given, expected, shape))


def _spec_of(ctx) -> _Spec:
    """The spec of the Function subclass ``ctx`` belongs to (``ctx`` is an instance of its backward node,
    whose ``_forward_cls`` is that subclass)."""
    return type(ctx)._forward_cls.spec
