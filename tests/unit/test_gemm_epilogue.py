"""A linear with a bias followed by a tanh-GELU of its result alone runs as one GEMM with both in its
epilogue (``program.gelu_epilogues``; cuBLASLt GELU_BIAS on CUDA), or with the GELU as a pass apart
where tuning measured that faster (``Program.gelu_apart``), and the plan says which."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tp_fusion import DataType, FusionDefinition
from tp_fusion.runtime import overlap
from tp_fusion.runtime.runner import Runner


def _mlp(keep_hidden: bool = False, approximate: str = "tanh"):
    with FusionDefinition() as fd:
        x, w1, b1, w2 = (fd.define_tensor(s, dtype=DataType.Double) for s in ([2, 3, 8], [16, 8], [16], [8, 16]))
        h = fd.ops.linear(x, w1, b1)
        fd.add_output(fd.ops.linear(fd.ops.gelu(h, approximate=approximate), w2))
        if keep_hidden:
            fd.add_output(h)
    return fd


def _inputs():
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ([2, 3, 8], [16, 8], [16], [8, 16])]


def _count_fused_gemms(monkeypatch) -> list:
    calls = []
    real = overlap.linear

    def spy(x, w, b, epilogue, gelu_in_gemm=True):
        calls.append((epilogue, gelu_in_gemm))
        return real(x, w, b, epilogue, gelu_in_gemm)
    monkeypatch.setattr(overlap, "linear", spy)
    return calls


def test_linear_gelu_runs_as_one_gemm(monkeypatch):
    calls = _count_fused_gemms(monkeypatch)
    fd, (x, w1, b1, w2) = _mlp(), _inputs()
    (got,) = fd.execute([x, w1, b1, w2])
    torch.testing.assert_close(got, F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2))
    assert calls == [(overlap.gelu_tanh, True)]
    assert "compute (linear+gelu: bias and GELU in the GEMM's epilogue)" in str(fd.plan)


def test_no_epilogue_when_the_gemm_result_is_read_elsewhere_or_the_gelu_is_exact(monkeypatch):
    calls = _count_fused_gemms(monkeypatch)
    x, w1, b1, w2 = _inputs()
    fd = _mlp(keep_hidden=True)  # the GEMM's result is an output too: it must be kept before the GELU
    got, hidden = fd.execute([x, w1, b1, w2])
    torch.testing.assert_close(hidden, F.linear(x, w1, b1))
    torch.testing.assert_close(got, F.linear(F.gelu(hidden, approximate="tanh"), w2))
    fd = _mlp(approximate="none")  # cuBLASLt's GELU epilogue is the tanh form only
    (got,) = fd.execute([x, w1, b1, w2])
    torch.testing.assert_close(got, F.linear(F.gelu(F.linear(x, w1, b1)), w2))
    assert calls == [] and "epilogue" not in str(fd.plan)


def test_gelu_apart_where_tuning_measured_it_faster(monkeypatch):
    calls = _count_fused_gemms(monkeypatch)
    x, w1, b1, w2 = _inputs()
    program = _mlp().compile([t.shape for t in (x, w1, b1, w2)])
    (gelu,) = [op.outputs[0] for op in program.fusion.ops if op.kind == "gelu"]
    apart = program.with_choices({}, cuda_graph=False, notes=(), gelu_apart=frozenset({gelu}))
    (got,) = Runner(apart).run([x, w1, b1, w2])
    torch.testing.assert_close(got, F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2))
    assert calls == [(overlap.gelu_tanh, False)]
    assert "(linear+gelu: the GELU apart from the GEMM, measured faster)" in str(apart)


def test_no_epilogue_for_a_weight_with_leading_dims(monkeypatch):
    """nvFuser's logical-split linear (w[d, out, in], b[d, out]) then a tanh-GELU: the GEMM+GELU call takes
    a 2-D weight, so the pair runs as two steps (and gives [d, ..., out])."""
    calls = _count_fused_gemms(monkeypatch)
    with FusionDefinition() as fd:
        x, w, b = (fd.define_tensor(s, dtype=DataType.Double) for s in ([2, 3, 8], [4, 16, 8], [4, 16]))
        fd.add_output(fd.ops.gelu(fd.ops.linear(x, w, b), approximate="tanh"))
    gen = torch.Generator().manual_seed(1)
    x, w, b = (torch.randn(*s, generator=gen, dtype=torch.float64) for s in ([2, 3, 8], [4, 16, 8], [4, 16]))
    (got,) = fd.execute([x, w, b])
    want = F.linear(x, w.reshape(64, 8), b.reshape(64)).reshape(2, 3, 4, 16).permute(2, 0, 1, 3)
    torch.testing.assert_close(got, F.gelu(want, approximate="tanh"))
    assert calls == [] and "epilogue" not in str(fd.plan)
