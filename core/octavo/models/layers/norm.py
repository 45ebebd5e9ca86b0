"""RMSNorm holding its weight and the platform's fused add+RMSNorm kernel."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from octavo.models.layers.linear import default_weight_loader
from octavo.platform.facade import Platform


class RMSNorm(nn.Module):
    """``norm(x)`` or, given ``residual``, ``(norm(x + residual), x + residual)``.

    The kernel comes from ``platform.rms_norm`` once, at construction.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        platform: Platform,
        *,
        dtype: torch.dtype,
        device: Union[str, torch.device],
    ):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        weight = torch.ones(hidden_size, dtype=dtype, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.kernel = platform.rms_norm(hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return self.kernel(x, self.weight)
        return self.kernel(x, self.weight, residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"
