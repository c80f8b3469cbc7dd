"""tp_fusion.autograd: a sharded MLP with ``nn.Parameter`` (and DTensor) weights trains like the unsharded one.

The layer is the TP MLP (linear, tanh-GELU, linear; column- then row-parallel), forward and backward
written as fusions. Three SGD steps on gloo ranks must give, after each step, the shards of the
weights that torch's autograd gives the unsharded ``nn.Module``, and the input's gradient too.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import tp_fusion
from tp_fusion import (
    DataType,
    DefinitionError,
    DeviceMesh,
    FusionDefinition,
    InputError,
    ParallelType,
    ShardingError,
)

T, H = 8, 4  # tokens, hidden; the inner size is 4 * H
F64 = DataType.Double
GELU_K, GELU_C = 0.7978845608028654, 0.044715  # sqrt(2/pi) and the cubic coefficient of tanh-GELU
STEPS, LR = 3, 0.1


class MLP(torch.nn.Module):
    """The unsharded reference: torch's autograd gives its gradients."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.w1, self.b1, self.w2, self.b2 = (torch.nn.Parameter(w.clone()) for w in weights)

    def forward(self, x):
        return F.linear(F.gelu(F.linear(x, self.w1, self.b1), approximate="tanh"), self.w2, self.b2)


def _shard(tv, mesh: DeviceMesh, dim: int | None, summed_rows: bool = False) -> None:
    """``tv`` on ``mesh``, sharded on ``dim`` (None: replicated). ``summed_rows``: ``tv`` is a sum over
    dim 0, whose loop domain keeps the reduced axis first, so dim ``i`` is loop axis ``i + 1``."""
    tv.set_device_mesh(mesh)
    if dim is not None:
        axis = dim + 1 if summed_rows else dim
        tv.outer_split(axis, mesh.size)
        tv.axis(axis).parallelize(ParallelType.mesh_x)


def _define_mlp_inputs(fd: FusionDefinition):
    """x [T, H], w1 [4H, H], b1 [4H], w2 [H, 4H], in float64: the inputs both fusions start with."""
    return (fd.define_tensor([T, H], dtype=F64), fd.define_tensor([4 * H, H], dtype=F64),
            fd.define_tensor([4 * H], dtype=F64), fd.define_tensor([H, 4 * H], dtype=F64))


def define_forward(d: int, sp: bool, scheduled: bool = True) -> FusionDefinition:
    """z = linear(gelu(linear(x, w1, b1)), w2, b2); w1, b1 column-parallel, w2 row-parallel; ``sp``: x
    and z sharded on tokens. Unscheduled (for DTensor inputs, which annotate it) if not ``scheduled``."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x, w1, b1, w2 = _define_mlp_inputs(fd)
        b2 = fd.define_tensor([H], dtype=F64)
        z = fd.ops.linear(fd.ops.gelu(fd.ops.linear(x, w1, b1), approximate="tanh"), w2, b2)
        fd.add_output(z)
        if scheduled:
            for tv, dim in ((x, 0 if sp else None), (w1, 0), (b1, 0), (w2, 1), (b2, None), (z, 0 if sp else None)):
                _shard(tv, mesh, dim)
    return fd


GRADS = ("x", "w1", "b1", "w2", "b2")


def define_backward(d: int, sp: bool, scheduled: bool = True, grads: tuple[str, ...] = GRADS) -> FusionDefinition:
    """Inputs x, w1, b1, w2 (saved forward inputs) and grad_z; outputs the gradients named in ``grads``."""
    mesh = DeviceMesh(range(d))
    with FusionDefinition() as fd:
        x, w1, b1, w2 = _define_mlp_inputs(fd)
        grad_z = fd.define_tensor([T, H], dtype=F64)
        h = fd.ops.linear(x, w1, b1)
        grad_w2 = fd.ops.matmul(fd.ops.permute(grad_z, [1, 0]), fd.ops.gelu(h, approximate="tanh"))
        grad_b2 = fd.ops.sum(grad_z, [0])
        grad_h = fd.ops.mul(fd.ops.matmul(grad_z, w2), _gelu_tanh_grad(fd, h))
        grad_b1 = fd.ops.sum(grad_h, [0])
        grad_w1 = fd.ops.matmul(fd.ops.permute(grad_h, [1, 0]), x)
        grad_x = fd.ops.matmul(grad_h, w1)
        outputs = dict(zip(GRADS, (grad_x, grad_w1, grad_b1, grad_w2, grad_b2)))
        for name in grads:
            fd.add_output(outputs[name])
        if scheduled:
            row = 0 if sp else None
            for tv, dim in ((x, row), (w1, 0), (b1, 0), (w2, 1), (grad_z, row),
                            (grad_x, row), (grad_w1, 0), (grad_w2, 1), (grad_b2, None)):
                _shard(tv, mesh, dim)
            _shard(grad_b1, mesh, 0, summed_rows=True)
    return fd


def _gelu_tanh_grad(fd: FusionDefinition, h):
    """d/dh of 0.5 h (1 + tanh(k (h + c h^3))) with pointwise ops."""
    h2 = fd.ops.mul(h, h)
    t = fd.ops.tanh(fd.ops.mul(fd.ops.mul(h, fd.ops.add(fd.ops.mul(h2, GELU_C), 1.0)), GELU_K))
    du = fd.ops.mul(fd.ops.add(fd.ops.mul(h2, 3 * GELU_C), 1.0), GELU_K)
    left = fd.ops.mul(fd.ops.add(t, 1.0), 0.5)
    right = fd.ops.mul(fd.ops.mul(fd.ops.mul(h, 0.5), fd.ops.sub(1.0, fd.ops.mul(t, t))), du)
    return fd.ops.add(left, right)


def _full(seed: int = 0) -> list[torch.Tensor]:
    """x, w1, b1, w2, b2 and the loss's target, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    shapes = ([T, H], [4 * H, H], [4 * H], [H, 4 * H], [H], [T, H])
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def _train_and_compare(rank: int, d: int, sp: bool, make_params, local_view, optimizer=torch.optim.SGD) -> None:
    """Three steps of ``optimizer`` on the sharded layer and on ``MLP``; the weights (``local_view``
    gives this rank's shard of a parameter) and the input's gradient must agree after each step."""
    x_full, *weights, target = _full()
    reference = MLP(weights)
    ref_opt = optimizer(reference.parameters(), lr=LR)
    params = make_params(weights)
    opt = optimizer(params, lr=LR)
    mlp = tp_fusion.autograd.function(define_forward(d, sp), define_backward(d, sp), saved_inputs=[0, 1, 2, 3],
                                      name="TPMLP")
    rows = slice(rank * T // d, (rank + 1) * T // d) if sp else slice(None)
    for step in range(STEPS):
        x_ref = x_full.clone().requires_grad_()
        ref_opt.zero_grad()
        (reference(x_ref) * target).sum().backward()
        ref_opt.step()

        x = x_full[rows].clone().requires_grad_()
        opt.zero_grad()
        z = mlp.apply(x, *params)
        assert z.requires_grad and z.shape == target[rows].shape
        (z * target[rows]).sum().backward()
        opt.step()

        torch.testing.assert_close(x.grad, x_ref.grad[rows], msg=f"step {step}: grad of x")
        for name, p, want in zip(("w1", "b1", "w2", "b2"), params, reference.parameters()):
            torch.testing.assert_close(local_view(p), local_view(want, name), msg=f"step {step}: {name}")


SHARD_DIM = {"w1": 0, "b1": 0, "w2": 1, "b2": None}


@pytest.mark.ranks(2)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "sp"])
def test_three_sgd_steps_with_local_shard_parameters(multidevice_test, sp):
    rank, d = multidevice_test.rank, multidevice_test.size

    def local(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
        dim = SHARD_DIM.get(name)
        return t.detach() if dim is None else t.detach().chunk(d, dim)[rank]

    def make_params(weights):
        return [torch.nn.Parameter(local(w, n).clone()) for n, w in zip(SHARD_DIM, weights)]

    _train_and_compare(rank, d, sp, make_params, local)


@pytest.mark.ranks(2)
def test_three_adam_steps_with_dtensor_parameters(multidevice_test):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    rank, d = multidevice_test.rank, multidevice_test.size
    mesh = init_device_mesh("cpu", (d,))
    placements = {"w1": Shard(0), "b1": Shard(0), "w2": Shard(1), "b2": Replicate()}
    dims = SHARD_DIM

    def local(t: torch.Tensor, name: str | None = None) -> torch.Tensor:
        if isinstance(t, DTensor):
            return t.to_local().detach()
        return t.detach() if dims[name] is None else t.detach().chunk(d, dims[name])[rank]

    def make_params(weights):
        return [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [placements[n]]))
                for n, w in zip(placements, weights)]

    x_full, *weights, target = _full()
    reference = MLP(weights)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=LR)
    params = make_params(weights)
    opt = torch.optim.Adam(params, lr=LR)
    mlp = tp_fusion.autograd.function(define_forward(d, False, scheduled=False),
                                      define_backward(d, False, scheduled=False), saved_inputs=[0, 1, 2, 3])
    for step in range(STEPS):
        x_ref = x_full.clone().requires_grad_()
        ref_opt.zero_grad()
        (reference(x_ref) * target).sum().backward()
        ref_opt.step()

        x = distribute_tensor(x_full.clone(), mesh, [Replicate()]).requires_grad_()
        opt.zero_grad()
        z = mlp.apply(x, *params)
        assert isinstance(z, DTensor) and z.requires_grad
        (z * distribute_tensor(target, mesh, [Replicate()])).sum().backward()
        opt.step()

        for name, p, want in zip(placements, params, reference.parameters()):
            assert isinstance(p.grad, DTensor) and tuple(p.grad.placements) == (placements[name],), name
            torch.testing.assert_close(local(p), local(want, name), msg=f"step {step}: {name}")
        torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad, msg=f"step {step}: grad of x")


@pytest.mark.ranks(2, 4)
def test_dtensor_gradients_are_computed_in_their_inputs_sharding(multidevice_test):
    """tanh(x w^T) with x and w row-sharded DTensors and an unscheduled backward fusion: each gradient is
    computed in its input's sharding (before: an allreduce of the whole gradient, then a local slice).
    grad_w = grad_h^T x sums its pieces with a reduce_scatter; grad_x = grad_h w gathers w ([2H, H]), which
    moves fewer elements than an all_to_all of grad_h ([T, 2H]) and a reduce_scatter of grad_x."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    d = multidevice_test.size
    mesh = init_device_mesh("cpu", (d,))
    with FusionDefinition() as fwd:
        x, w = fwd.define_tensor([T, H], dtype=F64), fwd.define_tensor([2 * H, H], dtype=F64)
        fwd.add_output(fwd.ops.tanh(fwd.ops.linear(x, w)))
    with FusionDefinition() as bwd:
        x, w = bwd.define_tensor([T, H], dtype=F64), bwd.define_tensor([2 * H, H], dtype=F64)
        y, grad_y = bwd.define_tensor([T, 2 * H], dtype=F64), bwd.define_tensor([T, 2 * H], dtype=F64)
        grad_h = bwd.ops.mul(grad_y, bwd.ops.sub(1.0, bwd.ops.mul(y, y)))
        bwd.add_output(bwd.ops.matmul(grad_h, w))
        bwd.add_output(bwd.ops.matmul(bwd.ops.permute(grad_h, [1, 0]), x))
    layer = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0, 1], saved_outputs=[0])
    x_full, w_full = _full(5)[0], _full(5)[1][:2 * H]
    c = torch.randn(T, 2 * H, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0)]))
    y = layer.apply(x, w)
    (y * distribute_tensor(c, mesh, y.placements)).sum().backward()
    x_ref, w_ref = x_full.clone().requires_grad_(), w_full.clone().requires_grad_()
    (torch.tanh(F.linear(x_ref, w_ref)) * c).sum().backward()
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad)
    torch.testing.assert_close(w.grad.full_tensor(), w_ref.grad)
    assert tuple(x.grad.placements) == tuple(w.grad.placements) == (Shard(0),)
    assert sorted(bwd.plan.collectives()) == ["allgather", "reduce_scatter"]


def test_dtensor_bias_gradient_is_a_local_sum_and_the_plans_are_reused(multidevice_test):
    """A column-parallel linear with bias, DTensor parameters sharded on out-features: the bias gradient
    sum(grad_y, [0]) (whose loop domain starts with the reduced r{T}) is annotated on its features, so the
    backward needs no communication, and three steps run one backward plan. (Before: the tokens' r{T}
    was split instead, an all_to_all of grad_y and an allreduce, and the plan was rebuilt every step.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    d = multidevice_test.size
    mesh = init_device_mesh("cpu", (d,))
    with FusionDefinition() as fwd:
        x, w, b = (fwd.define_tensor(s, dtype=F64) for s in ([T, H], [4 * d, H], [4 * d]))
        fwd.add_output(fwd.ops.linear(x, w, b))
    with FusionDefinition() as bwd:
        x, grad_y = bwd.define_tensor([T, H], dtype=F64), bwd.define_tensor([T, 4 * d], dtype=F64)
        bwd.add_output(bwd.ops.matmul(bwd.ops.permute(grad_y, [1, 0]), x))
        bwd.add_output(bwd.ops.sum(grad_y, [0]))
    layer = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0], grad_inputs=[1, 2])
    gen = torch.Generator().manual_seed(7)
    x_full, w_full, b_full, c = (torch.randn(*s, dtype=torch.float64, generator=gen)
                                 for s in ([T, H], [4 * d, H], [4 * d], [T, 4 * d]))
    x = distribute_tensor(x_full, mesh, [Replicate()])
    w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0)]))
    b = torch.nn.Parameter(distribute_tensor(b_full, mesh, [Shard(0)]))
    plans = set()
    for _ in range(3):
        w.grad = b.grad = None
        y = layer.apply(x, w, b)
        y.backward(distribute_tensor(c, mesh, y.placements))
        plans.add(id(bwd.plan))
    torch.testing.assert_close(b.grad.full_tensor(), c.sum(0))
    torch.testing.assert_close(w.grad.full_tensor(), c.T @ x_full)
    assert tuple(b.grad.placements) == (Shard(0),)
    assert bwd.plan.collectives() == [] and len(plans) == 1


def _dropout() -> tuple[FusionDefinition, FusionDefinition]:
    """Dropout (p = 0.5, scaled by 2) as forward and backward fusions that redraw one mask from a seed given as a
    scalar input: ``forward(x, seed)``, ``backward(seed, grad_y)``."""
    fds = []
    for tensor in ("x", "grad_y"):
        with FusionDefinition() as fd:
            first = fd.define_tensor([T, H], dtype=F64) if tensor == "x" else None
            seed = fd.define_scalar(None, dtype=DataType.Int)
            second = fd.define_tensor([T, H], dtype=F64) if tensor == "grad_y" else None
            keep = fd.ops.lt(fd.ops.uniform(0.0, 1.0, [T, H], dtype=F64, rng_seed=seed, rng_offset=0), 0.5)
            fd.add_output(fd.ops.mul(fd.ops.mul(first if tensor == "x" else second, keep), 2.0))
        fds.append(fd)
    return fds[0], fds[1]


@pytest.mark.ranks(2)
def test_a_dropout_seed_is_a_scalar_input_of_both_fusions(multidevice_test):
    """A training step's seed (a number) goes to the forward and is saved for the backward, which redraws the
    same mask; new seeds build no new plans, on local tensors and on a sharded DTensor alike."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (multidevice_test.size,))
    x_full = torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for as_dtensor in (False, True):  # (a DTensor annotates the fusions it runs: a pair of fusions each)
        fwd, bwd = _dropout()
        dropout = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[1])  # grad_inputs: the tensor inputs
        masks = []
        for seed in (11, 12, 13):
            x = distribute_tensor(x_full, mesh, [Shard(0)]) if as_dtensor else x_full.clone()
            x.requires_grad_()
            y = dropout.apply(x, seed)
            (y * 3).sum().backward()
            y_full, grad = (t.full_tensor() if as_dtensor else t for t in (y, x.grad))
            kept = y_full != 0
            torch.testing.assert_close(y_full, x_full * kept * 2)
            torch.testing.assert_close(grad, kept.double() * 6)
            masks.append(kept)
        assert not torch.equal(masks[0], masks[1]) and 0 < int(masks[0].sum()) < T * H
        assert len(fwd._executor._cache) == len(bwd._executor._cache) == 1
    with pytest.raises(DefinitionError, match=r"grad_inputs \[0, 1\] names forward input\(s\) \[1\], scalar inputs"):
        tp_fusion.autograd.function(fwd, bwd, saved_inputs=[1], grad_inputs=[0, 1])


def test_without_mesh_matches_torch_autograd():
    """No mesh: one process, no process group; x gets no gradient when grad_inputs leaves it out."""
    x, *weights, target = _full(1)
    reference = MLP(weights)
    (reference(x) * target).sum().backward()
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    mlp = tp_fusion.autograd.function(define_forward(1, False, scheduled=False),
                                      define_backward(1, False, scheduled=False, grads=GRADS[1:]),
                                      saved_inputs=[0, 1, 2, 3], grad_inputs=[1, 2, 3, 4])
    x_in = x.clone().requires_grad_()
    (mlp.apply(x_in, *params) * target).sum().backward()
    assert x_in.grad is None
    for p, want in zip(params, reference.parameters()):
        torch.testing.assert_close(p.grad, want.grad)


def test_backward_with_the_wrong_number_of_gradients_is_a_clear_error():
    backward = define_backward(1, False, scheduled=False, grads=GRADS[1:])  # 4 gradients for 5 inputs
    with pytest.raises(DefinitionError, match=r"returns 4 outputs, but grad_inputs \[0, 1, 2, 3, 4\] asks for 5"):
        tp_fusion.autograd.function(define_forward(1, False, scheduled=False), backward, saved_inputs=[0, 1, 2, 3])
    with pytest.raises(DefinitionError, match="backward fusion takes 5 inputs, but it is given 2 saved forward"):
        tp_fusion.autograd.function(define_forward(1, False, scheduled=False),
                                    define_backward(1, False, scheduled=False), saved_inputs=[0, 1])
    with pytest.raises(DefinitionError, match="saved_inputs holds 7, but the forward fusion has 5 inputs"):
        tp_fusion.autograd.function(define_forward(1, False), define_backward(1, False), saved_inputs=[7])
    mlp = tp_fusion.autograd.function(define_forward(1, False, scheduled=False),
                                      define_backward(1, False, scheduled=False), saved_inputs=[0, 1, 2, 3])
    with pytest.raises(InputError, match=r"the fusion takes 5 inputs \(T0, T1, T2, T3, T4\), got 2"):
        mlp.apply(*_full()[:2])


def _linear_function(grad_shape, grad_dtype=DataType.Float):
    """z = x @ w.T ([8, 16]) and a backward fusion (x, w, grad_z) -> w + sum(grad_z) for w (not its gradient:
    any math that takes grad_z as declared) whose grad_z is declared so."""
    with FusionDefinition() as fwd:
        x, w = fwd.define_tensor([8, 4]), fwd.define_tensor([16, 4])
        fwd.add_output(fwd.ops.linear(x, w))
    with FusionDefinition() as bwd:
        _, bw, gz = bwd.define_tensor([8, 4]), bwd.define_tensor([16, 4]), bwd.define_tensor(grad_shape,
                                                                                                dtype=grad_dtype)
        bwd.add_output(bwd.ops.add(bw, bwd.ops.cast(bwd.ops.sum(gz), DataType.Float)))
    return tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0, 1], grad_inputs=[1])


@pytest.mark.parametrize("shape,dtype", [([8, 4], DataType.Float), ([16, 8], DataType.Float),
                                         ([8, 16, 1], DataType.Float), ([8, 16], DataType.Double)])
def test_an_incoming_gradient_declared_unlike_its_output_is_an_error_when_joined(shape, dtype):
    """The backward fusion's gradient of a forward output comes in that output's shape and dtype: a
    declaration that differs is refused by autograd.function, naming the output (was an InputError of the
    backward's execute at loss.backward(), naming neither)."""
    got = f"{dtype.short}[{', '.join(map(str, shape))}]"
    with pytest.raises(DefinitionError, match=rf"the backward fusion's input 2 \(T2 {re.escape(got)}\) is the "
                                              r"gradient of forward output 0 \(T2 f32\[8, 16\]\).*define that "
                                              r"backward input as f32\[8, 16\]"):
        _linear_function(shape, dtype)


def test_an_incoming_gradient_with_symbolic_extents_is_accepted():
    x, w = torch.randn(8, 4), torch.nn.Parameter(torch.randn(16, 4))
    _linear_function([-1, 16]).apply(x, w).sum().backward()
    torch.testing.assert_close(w.grad, w.detach() + 8 * 16)


def test_gradient_of_the_wrong_shape_is_a_clear_error():
    """A backward output whose shape is not its input's (here the gradients are swapped)."""
    backward = define_backward(1, False, scheduled=False, grads=("w1", "x", "b1", "w2", "b2"))
    mlp = tp_fusion.autograd.function(define_forward(1, False, scheduled=False), backward, saved_inputs=[0, 1, 2, 3])
    x, *weights, _ = _full()
    z = mlp.apply(x.requires_grad_(), *[w.requires_grad_() for w in weights])
    with pytest.raises(ShardingError, match=r"gradient of forward input 0, whose global shape is \[8, 4\], but that "
                                             r"output's is \[16, 4\]; a gradient has its input's shape"):
        z.sum().backward()


def _symbolic_linear_function():
    """z = x @ w.T with x [T, 3] of any T, and its backward fusion (x, w, grad_z) -> grad_x, grad_w."""
    with FusionDefinition() as fwd:
        x, w = fwd.define_tensor([-1, 3], dtype=F64), fwd.define_tensor([5, 3], dtype=F64)
        fwd.add_output(fwd.ops.linear(x, w))
    with FusionDefinition() as bwd:
        x, w, g = (bwd.define_tensor(shape, dtype=F64) for shape in ([-1, 3], [5, 3], [-1, 5]))
        bwd.add_output(bwd.ops.matmul(g, w))
        bwd.add_output(bwd.ops.matmul(bwd.ops.permute(g, [1, 0]), x))
    return tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0, 1])


def test_forwards_of_several_sizes_before_one_backward():
    """Microbatches of different lengths through one function, then one backward: each gradient is checked
    against the shape of its own forward's input (was: the last forward's, a ShardingError)."""
    linear = _symbolic_linear_function()
    w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)))
    xs = [torch.randn(t, 3, dtype=torch.float64, requires_grad=True) for t in (4, 6)]
    sum(linear.apply(x, w).square().sum() for x in xs).backward()
    w_ref = w.detach().clone().requires_grad_()
    xs_ref = [x.detach().clone().requires_grad_() for x in xs]
    sum((x @ w_ref.T).square().sum() for x in xs_ref).backward()
    torch.testing.assert_close(w.grad, w_ref.grad)
    for x, x_ref in zip(xs, xs_ref):
        torch.testing.assert_close(x.grad, x_ref.grad)


def test_a_gradient_of_the_gradients_is_a_clear_error():
    """The backward fusion runs outside autograd: with create_graph=True the first-order gradients are
    right, and differentiating through them raises (was: silently zero second-order terms)."""
    linear = _symbolic_linear_function()
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    grad_x, grad_w = torch.autograd.grad(linear.apply(x, w).square().sum(), [x, w], create_graph=True)
    torch.testing.assert_close(grad_x, 2 * (x @ w.T) @ w)
    torch.testing.assert_close(grad_w, 2 * (x @ w.T).T @ x)
    with pytest.raises(RuntimeError, match="differentiable once"):
        (grad_x.square().sum() + grad_w.sum()).backward()


@pytest.mark.ranks(2, 4)
@pytest.mark.parametrize("strided", ["grad_x", "saved_x", "grad_y", "replicated_grad_x"])
def test_a_backward_tensor_of_another_sharding_with_the_right_shape_is_a_clear_error(multidevice_test, strided):
    """x and y are sharded by blocks of rows; the backward fusion schedules one of its tensors by strided
    rows: the local shapes agree, but each rank would read or get other rows (found by black-box hunts:
    x.grad came back wrong, silently). replicated_grad_x: x's gradient left whole, another local shape."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))

    def rows(tv, strided=False):
        tv.set_device_mesh(mesh)
        if strided:
            tv.inner_split(0, d)
            tv.axis(1).parallelize(ParallelType.mesh_x)
        else:
            tv.outer_split(0, d)
            tv.axis(0).parallelize(ParallelType.mesh_x)
    with FusionDefinition() as fwd:
        x = fwd.define_tensor([T, H], dtype=F64)
        y = fwd.ops.mul(x, x)
        fwd.add_output(y)
        rows(x), rows(y)
    with FusionDefinition() as bwd:
        xs, gy = bwd.define_tensor([T, H], dtype=F64), bwd.define_tensor([T, H], dtype=F64)
        gx = bwd.ops.mul(bwd.ops.mul(xs, 2.0), gy)
        bwd.add_output(gx)
        rows(xs, strided == "saved_x"), rows(gy, strided == "grad_y")
        if strided == "replicated_grad_x":
            gx.set_device_mesh(mesh)
        else:
            rows(gx, strided == "grad_x")
    square = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0])
    x_local = torch.arange(float(T * H), dtype=torch.float64).reshape(T, H).chunk(d)[multidevice_test.rank]
    out = square.apply(x_local.clone().requires_grad_())
    message = (r"gradient of forward input 0, which is sharded mesh\(.*\)\(S\(0\)\), but it came out sharded "
               r"mesh\(.*\)\(S\(0, outer=.*\)\)" if strided == "grad_x" else
               rf"gradient of forward input 0, which has local shape \[{T // d}, {H}\], but it came out \[{T}, {H}\]; "
               r"give that backward output the sharding of forward input 0" if strided == "replicated_grad_x" else
               rf"backward fusion's input {int(strided == 'grad_y')} \(T\d\) is scheduled as mesh\(.*\)\(S\(0, "
               r"outer=.*\)\), but the tensor handed to it is sharded mesh\(.*\)\(S\(0\)\)")
    with pytest.raises(ShardingError, match=message):
        out.sum().backward()


@pytest.mark.ranks(2)
def test_bias_gradient_scheduled_on_its_reduction_axis_says_so(multidevice_test):
    """``grad_b = sum(gy, [0])`` split and parallelized on axis 0 "like its bias" parallelizes the reduced dim
    (a sum's loop domain keeps it first, as nvFuser's): the gradient comes out summed and whole, and the error
    says which axis was meant."""
    d = multidevice_test.size
    mesh = DeviceMesh(range(d))

    def sched(tv, axis):
        tv.set_device_mesh(mesh)
        if axis is not None:
            tv.outer_split(axis, d)
            tv.axis(axis).parallelize(ParallelType.mesh_x)
    with FusionDefinition() as fwd:
        x, w, b = fwd.define_tensor([4, 4]), fwd.define_tensor([8, 4]), fwd.define_tensor([8])
        y = fwd.ops.linear(x, w, b)
        fwd.add_output(y)
        for tv, axis in ((x, None), (w, 0), (b, 0), (y, 1)):
            sched(tv, axis)
    with FusionDefinition() as bwd:
        xs, gy = bwd.define_tensor([4, 4]), bwd.define_tensor([4, 8])
        gw, gb = bwd.ops.matmul(bwd.ops.permute(gy, [1, 0]), xs), bwd.ops.sum(gy, [0])
        bwd.add_output(gw)
        bwd.add_output(gb)
        for tv, axis in ((xs, None), (gy, 1), (gw, 0), (gb, 0)):
            sched(tv, axis)
    linear = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0], grad_inputs=[1, 2])
    w_local, b_local = (torch.nn.Parameter(torch.randn(*s)) for s in ([8 // d, 4], [8 // d]))
    out = linear.apply(torch.randn(4, 4), w_local, b_local)
    with pytest.raises(ShardingError, match=re.escape("[rmesh_x{2}, r{2}, 8] parallelizes axis 0, a reduction axis")):
        out.sum().backward()


@pytest.mark.ranks(2)
def test_dtensor_gradient_scheduled_on_another_mesh_is_a_clear_error(multidevice_test):
    """A DTensor input whose gradient the backward fusion puts on one device: a ShardingError naming the
    input and both meshes (was torch's NotImplementedError from DTensor.redistribute)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    with FusionDefinition() as fwd:
        x, w = fwd.define_tensor([T, H], dtype=F64), fwd.define_tensor([T, H], dtype=F64)
        fwd.add_output(fwd.ops.linear(x, w))
    with FusionDefinition() as bwd:
        x, w, gy = (bwd.define_tensor(s, dtype=F64) for s in ([T, H], [T, H], [T, T]))
        bwd.add_output(bwd.ops.matmul(gy, w))
        gw = bwd.ops.matmul(bwd.ops.permute(gy, [1, 0]), x)
        bwd.add_output(gw)
        gw.set_device_mesh(DeviceMesh([0]))
    linear = tp_fusion.autograd.function(fwd, bwd, saved_inputs=[0, 1])
    mesh = init_device_mesh("cpu", (multidevice_test.size,))
    x_full, w_full = (torch.randn(T, H, dtype=torch.float64, generator=torch.Generator().manual_seed(s))
                      for s in (7, 8))
    x = distribute_tensor(x_full, mesh, [Shard(0)]).requires_grad_()
    w = torch.nn.Parameter(distribute_tensor(w_full, mesh, [Shard(0)]))
    with pytest.raises(ShardingError, match=r"output 1 is the gradient of forward input 1, a DTensor on "
                                            r"DeviceMesh\(\(2,\).*but it came out on DeviceMesh\(\(1,\)"):
        linear.apply(x, w).sum().backward()


@pytest.mark.ranks(2)
def test_dtensor_activation_with_local_shard_parameters(multidevice_test):
    """x a DTensor, the weights plain nn.Parameters holding this rank's shards: the backward runs on
    DTensors, and the plain parameters get plain local gradients that an optimizer steps with."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    rank, d = multidevice_test.rank, multidevice_test.size
    x_full, *weights, target = _full()
    reference = MLP(weights)
    x_ref = x_full.clone().requires_grad_()
    (reference(x_ref) * target).sum().backward()
    params = [torch.nn.Parameter(w.clone() if dim is None else w.chunk(d, dim)[rank].clone())
              for w, dim in zip(weights, SHARD_DIM.values())]
    mlp = tp_fusion.autograd.function(define_forward(d, False), define_backward(d, False), saved_inputs=[0, 1, 2, 3])
    mesh = init_device_mesh("cpu", (d,))
    x = distribute_tensor(x_full.clone(), mesh, [Replicate()]).requires_grad_()
    z = mlp.apply(x, *params)
    (z * distribute_tensor(target, mesh, [Replicate()])).sum().backward()
    for (name, dim), p, want in zip(SHARD_DIM.items(), params, reference.parameters()):
        assert type(p.grad) is torch.Tensor, name
        torch.testing.assert_close(p.grad, want.grad if dim is None else want.grad.chunk(d, dim)[rank], msg=name)
    assert isinstance(x.grad, DTensor)
    torch.testing.assert_close(x.grad.full_tensor(), x_ref.grad)
    torch.optim.SGD(params, lr=LR).step()


@pytest.mark.parametrize("stride_order", [None, [0, 1]], ids=["row_major", "column_major"])
def test_incoming_gradient_is_laid_out_as_the_backward_declares(stride_order):
    """torch hands backward the gradient it makes (y.sum() gives strides [0, 0]); a backward fusion that
    declares its gradient input's layout gets it so."""
    with FusionDefinition() as fwd:
        x = fwd.define_tensor([4, 3])
        fwd.add_output(fwd.ops.mul(x, 2.0))
    with FusionDefinition() as bwd:
        gy = bwd.define_tensor([4, 3], contiguity=[True, True], stride_order=stride_order)
        bwd.add_output(bwd.ops.mul(gy, 2.0))
    double = tp_fusion.autograd.function(fwd, bwd)
    x = torch.randn(4, 3, requires_grad=True)
    double.apply(x).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((4, 3), 2.0))
