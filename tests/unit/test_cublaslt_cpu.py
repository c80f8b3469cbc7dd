"""``cublaslt.linear_into`` off the GPU: torch's calls give the same values (the cuBLASLt path is
checked on the GPU, tests/gpu/test_overlap_gpu.py)."""

import pytest
import torch
import torch.nn.functional as F

from tp_fusion.runtime import cublaslt


def _operands():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(6, 4, generator=gen), torch.randn(5, 4, generator=gen)
    return x, w, torch.randn(5, generator=gen), torch.randn(6, 5, generator=gen)


def test_each_form_matches_torch_on_the_cpu():
    x, w, b, c = _operands()
    out = torch.empty(6, 5)
    torch.testing.assert_close(cublaslt.linear_into(x, w, out), x @ w.t())
    torch.testing.assert_close(cublaslt.linear_into(x, w, out, bias=b), F.linear(x, w, b))
    torch.testing.assert_close(cublaslt.linear_into(x, w, out, bias=b, gelu=True),
                               F.gelu(F.linear(x, w, b), approximate="tanh"))
    c_before = c.clone()
    assert cublaslt.linear_into(x, w, out, c=c) is out
    torch.testing.assert_close(out, c_before + x @ w.t())
    assert torch.equal(c, c_before) and not cublaslt._gemms


@pytest.mark.parametrize("kwargs", [{"gelu": True}, {"c": "c", "gelu": True}, {"c": "c", "bias": "b"}])
def test_forms_it_does_not_have_are_refused(kwargs):
    x, w, b, c = _operands()
    kwargs = {k: {"c": c, "b": b}.get(v, v) if isinstance(v, str) else v for k, v in kwargs.items()}
    if kwargs.get("gelu") and "c" in kwargs:
        kwargs["bias"] = b
    with pytest.raises(ValueError, match="gelu needs a bias, and c takes neither"):
        cublaslt.linear_into(x, w, torch.empty(6, 5), **kwargs)


def test_recordings_nest():
    """Tuning records the GEMMs of each timing within the recording of the whole compile; two empty
    recordings are equal sets, yet each is closed as itself."""
    with cublaslt.recording() as outer:
        with cublaslt.recording() as inner:
            assert cublaslt._recorders == [outer, inner] and cublaslt._recorders[1] is inner
        assert cublaslt._recorders[0] is outer and len(cublaslt._recorders) == 1
    assert not cublaslt._recorders
