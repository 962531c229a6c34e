"""Test models for the CUDA double (tests/support/pbtest/cuda_double/fake.py): what a model does on a GPU, told to the double."""

from __future__ import annotations

import torch

from pbtest import cuda_double


class DeviceMLP(torch.nn.Module):
    """What a small MLP does on a GPU, told to the double: a gemm (cuBLAS workspace), an
    autotuned kernel per shape, an output allocation; ``fail`` raises or syncs mid-step."""

    def __init__(self, out_bytes: int = 1 << 20):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out_bytes, self.calls, self.out = out_bytes, 0, None
        self.fail: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fake = cuda_double.current()
        self.calls += 1
        fake.gemm()
        fake.autotune(("mlp", x.shape[0]))
        if self.out is not None:
            fake.free(self.out)
        self.out = fake.malloc(self.out_bytes)
        if self.fail == "raise":
            raise KeyError("boom during capture")
        if self.fail == "sync":
            fake.host_sync(".item()")
        if self.fail == "fork":  # a side stream joins the capture and is never joined back
            torch.cuda.Stream().wait_stream(torch.cuda.current_stream())
        return self.lin(x)

    def __del__(self) -> None:  # its output tensor dies with it, as on a GPU
        if self.out is not None:
            self.out.allocated = False
