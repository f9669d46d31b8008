"""The PyTorch/cuBLAS baselines the benchmark measures in the same run (when torch imports)."""
from __future__ import annotations

import math


def torch_or_none():
    """torch, when it imports and sees a GPU; else None (the baselines are skipped)."""
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def torch_view(dev_array, torch):
    """A torch tensor over a numba device array's memory (no copy)."""
    return torch.as_tensor(dev_array, device="cuda")


def torch_q2k_decode(torch, table_u8, ids):
    """index_select + Q2_K decode in eager torch ops -> bf16 [n, 256] (the baseline)."""
    b = table_u8.index_select(0, ids)                                         # [n, 84]
    n = b.shape[0]
    scales = b[:, :16].to(torch.int32)
    qs = b[:, 16:80].to(torch.int32).view(n, 2, 1, 32)
    d = b[:, 80:82].contiguous().view(torch.float16).to(torch.float32)       # [n, 1]
    dmin = b[:, 82:84].contiguous().view(torch.float16).to(torch.float32)
    shifts = torch.tensor([0, 2, 4, 6], device=b.device, dtype=torch.int32).view(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).view(n, 16, 16).to(torch.float32)
    y = (d * (scales & 15).to(torch.float32)).view(n, 16, 1) * q - (dmin * (scales >> 4).to(torch.float32)).view(n, 16, 1)
    return y.view(n, 256).to(torch.bfloat16)


def torch_gate(torch, h, kv, w, hc, dim, eps=1e-20):
    """The gate and in-place highway update in torch ops (eager; wrap in torch.compile for the
    compiled baseline)."""
    T = h.shape[0]
    key = kv[:, : hc * dim].view(T, hc, dim).float()
    v = kv[:, hc * dim:].float()
    dot = ((h * w) * key).sum(-1) * torch.rsqrt((h * h).mean(-1) + eps) * torch.rsqrt((key * key).mean(-1) + eps) \
        / math.sqrt(dim)
    g = torch.sign(dot) * torch.sqrt(torch.clamp(dot.abs(), min=1e-6))
    gate = torch.sigmoid(g)
    h.add_(gate.unsqueeze(-1) * v.unsqueeze(1))
    return gate
