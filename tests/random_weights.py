"""Random weights for the tiny models the tests build."""

from __future__ import annotations

import torch


def randomize(model: torch.nn.Module) -> None:
    """Every parameter away from its init (norms near 1, the rest small), so that one that
    fails to load shows up as a wrong output."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(0.05 * torch.randn_like(param))
