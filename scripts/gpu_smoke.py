"""The first minute on a GPU: the CUDA platform's riskiest paths, each compared with eager.

    python scripts/gpu_smoke.py        # run by scripts/gpu_check.sh as its "smoke" step

One line ``PASS|FAIL <case> (<ms> ms)`` per case, the traceback of each failure, exit status 1
if any case failed. The cases follow issue 19: what torch's allocators do to a process-wide
CUDA platform (host-allocator pool uses, the capture stream's cuBLAS workspace, failed and
empty captures). Cases run in order in one process, sharing the platform, as a server would.
"""

from __future__ import annotations

import gc
import sys
import time
import traceback
from pathlib import Path

import torch

if __name__ == "__main__" and not torch.cuda.is_available():  # at once, before the package's import
    print("FAIL smoke: no CUDA device")
    sys.exit(2)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import piecewise_backend as pb  # noqa: E402
from piecewise_backend.platforms import get_platform  # noqa: E402

M = pb.CUDAGraphMode
CFG = pb.CompilationConfig(platform="cuda", compile_pieces="eager")
D = pb.BatchDescriptor(8)


def run(w, mode, x):
    with pb.set_forward_context(mode, D if mode != M.NONE else None):
        return w(x)


@pb.eager_break
def scale(h: torch.Tensor) -> torch.Tensor:
    return h * 0.5


class MLP(torch.nn.Module):
    def __init__(self, dim: int = 64, breaks: bool = False, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1, self.l2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
        self.breaks = breaks

    def forward(self, x):
        h = torch.relu(self.l1(x))
        if self.breaks:
            h = scale(h)
        return self.l2(h)


class BreakFirst(torch.nn.Module):
    """Its first segment records nothing: CUDA warns "graph is empty" and the platform parks it."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP()

    def forward(self, x):
        return self.mlp(scale(x))


class BigGemm(torch.nn.Module):
    """A split-K shaped bf16 GEMM: cuBLAS uses its workspace for it."""

    def __init__(self, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(torch.randn(8192, 256, generator=g).to(torch.bfloat16) / 90, requires_grad=False)

    def forward(self, x):
        return (x.to(torch.bfloat16) @ self.w).float()


def captured(model, mode=M.FULL, x=None):
    w = pb.CUDAGraphWrapper(model, M.FULL, config=CFG) if mode == M.FULL else pb.BreakableCUDAGraphWrapper(model, config=CFG)
    x = torch.randn(8, 64, device="cuda") if x is None else x
    out = run(w, mode, x)  # lazy capture (with its warm-up), then a replay
    check(out, model(x))
    return w, x


def check(got, want):
    torch.cuda.synchronize()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def full_capture_and_replay():
    m = MLP().cuda()
    w, x = captured(m)
    for seed in (1, 2):
        x.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(seed)).cuda())
        check(run(w, M.FULL, x), m(x))


def breakable_capture_and_replay():
    m = MLP(breaks=True).cuda()
    w, x = captured(m, M.PIECEWISE)
    x.normal_()
    check(run(w, M.PIECEWISE, x), m(x))


def capture_clear_capture_in_the_same_pool():
    keep, _ = captured(MLP(seed=1).cuda())  # keeps the generation (and its pool) alive
    m = MLP(seed=2).cuda()
    w, x = captured(m)
    pool = get_platform("cuda").pool_id
    w.clear_graphs()
    check(run(w, M.FULL, x), m(x))
    assert get_platform("cuda").pool_id == pool, "the pool changed although a graph of it lives"
    del keep


def wrapper_dropped_then_capture():
    w, _ = captured(MLP(seed=3).cuda())
    del w
    gc.collect()
    captured(MLP(seed=4).cuda())


def aborted_capture_then_retry():
    class Flaky(MLP):
        fail = True

        def forward(self, x):
            out = super().forward(x)
            if self.fail and torch.cuda.is_current_stream_capturing():
                raise KeyError("boom during capture")
            return out

    m = Flaky().cuda()
    w = pb.CUDAGraphWrapper(m, M.FULL, config=CFG)
    x = torch.randn(8, 64, device="cuda")
    try:
        run(w, M.FULL, x)
        raise AssertionError("the capture did not fail")
    except KeyError:
        pass
    m.fail = False
    check(run(w, M.FULL, x), m(x))


def empty_first_segment():
    get_platform("cuda").release_cached()  # a fresh generation: the empty graph is its first
    captured(BreakFirst().cuda(), M.PIECEWISE)
    captured(MLP(seed=5).cuda())  # the next capture into the same pool


def reset_of_one_graph_keeps_the_others_workspace():
    a_model, b_model = BigGemm(1).cuda(), BigGemm(2).cuda()
    x = torch.randn(8, 8192, device="cuda")
    a = pb.CUDAGraphWrapper(a_model, M.FULL, config=CFG)
    b = pb.CUDAGraphWrapper(b_model, M.FULL, config=CFG)
    check(run(a, M.FULL, x), a_model(x))
    check(run(b, M.FULL, x), b_model(x))
    a.clear_graphs()  # on torch >= 2.12 a reset() here would free the stream's workspace under b
    del a
    gc.collect()
    torch.cuda.empty_cache()
    junk = [torch.full((8 << 20,), 7.0, device="cuda") for _ in range(4)]  # reuse whatever was freed
    for _ in range(3):
        check(run(b, M.FULL, x), b_model(x))
    del junk


CASES = [
    full_capture_and_replay,
    breakable_capture_and_replay,
    capture_clear_capture_in_the_same_pool,
    wrapper_dropped_then_capture,
    aborted_capture_then_retry,
    empty_first_segment,
    reset_of_one_graph_keeps_the_others_workspace,
]


def main() -> int:
    if not torch.cuda.is_available():
        print("FAIL smoke: no CUDA device")
        return 2
    failed = 0
    with torch.no_grad():
        for case in CASES:
            start = time.perf_counter()
            try:
                case()
                verdict = "PASS"
            except Exception:
                verdict, failed = "FAIL", failed + 1
                traceback.print_exc()
            print(f"{verdict} {case.__name__} ({(time.perf_counter() - start) * 1e3:.0f} ms)", flush=True)
    p = get_platform("cuda")
    print(f"platform: {p.memory() / 2**20:.1f} MiB in pools, leaks {p.leaks()}, retired {p.retired_pools()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
