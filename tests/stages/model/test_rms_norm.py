"""``rms_norm`` on torch's one-call kernel is the composite Hugging Face Llama computes,
bit for bit, in float32 and bfloat16 (the weight applied in the input's dtype)."""

from __future__ import annotations

import pytest
import torch

from stages.model import layers
from stages.model.layers import rms_norm


def _composite(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (3, 512), (17, 896), (128, 4096)])
def test_equals_the_composite(dtype: torch.dtype, rows: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(rows * hidden)
    for scale in (1e-3, 1.0, 1e3):
        x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
        weight = torch.randn(hidden, generator=gen).to(dtype)
        with torch.inference_mode():
            assert torch.equal(rms_norm(x, weight, 1e-6), _composite(x, weight, 1e-6))


def test_fused_kernel_is_used_when_torch_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast path is taken (not silently the composite): a kernel that raises is seen."""
    if layers._FUSED_RMS_NORM is None:
        pytest.skip("this torch has no torch._fused_rms_norm")

    def broken(*args: object) -> None:
        raise RuntimeError("fused kernel called")

    monkeypatch.setattr(layers, "_FUSED_RMS_NORM", broken)
    with pytest.raises(RuntimeError, match="fused kernel called"):
        rms_norm(torch.randn(1, 8), torch.ones(8), 1e-6)
