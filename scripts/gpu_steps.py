"""The steps of scripts/gpu_check.sh, in the order they run, each with its budget and why.

The lent GPU machine gives one call of 600 s at most and 15 minutes in all, machine start included:
the budgets add up to at most ``GPU_CHECK_SECONDS`` (480 by default, checked by
``bash scripts/gpu_check.sh --plan``), so a run and one short rerun fit. A budget is a cap: a
step that ends early leaves its time as slack; one that runs past it is killed (``TIMEOUT``)
and the next step starts.

**Adding a step** (a benchmark, a test file): append one ``Step`` where it belongs in the order
(what matters most first), with a budget you can argue (``why``: measured seconds, or counts times
unit costs; cold Inductor/Triton compiles cost seconds each on the GPU host), take the seconds
from another step or raise ``GPU_CHECK_SECONDS`` with the docs (docs/benchmarks.md "GPU results"),
then run ``bash scripts/gpu_check.sh --plan`` (any machine): it must exit 0.

* a pytest step names its files or node ids in ``tests`` and runs them with ``-m <marker>``
  (``cuda``); it passes only if some test ran and none failed (junit counts), and ``workers``
  asks pytest-xdist for that many processes where it is installed (the GPU machine has it).
* a command step gives ``command`` (``{py}`` is the Python running the check, ``{out}`` the
  results folder); its exit status is its verdict, so a benchmark must exit non-zero when a
  variant of the library failed or its tokens/outputs differ on CUDA. A benchmark writes its table
  to a file of its own under ``{out}`` as soon as it has one (a killed step keeps it); the device
  returns 8 files, 3 of them the check's own, and ``--plan`` refuses more.
* ``gpus``: the step runs only on a machine with that many GPUs (reported as not run otherwise,
  and left out of the plan's total there).

The budget figures below were argued before any GPU run (none was lent yet): replace them with
the measured seconds (``summary.txt``) after the first one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    name: str
    budget_s: int
    why: str
    tests: tuple[str, ...] = ()
    command: tuple[str, ...] = ()
    marker: str = "cuda"
    workers: int = 0
    gpus: int = 1

    def __post_init__(self) -> None:
        if bool(self.tests) == bool(self.command):
            raise ValueError(f"step {self.name!r}: give exactly one of tests= (a pytest step) or command=")
        if not self.name.isidentifier() or self.budget_s <= 0:
            raise ValueError(f"step {self.name!r}: the name must be a word and the budget positive, got {self.budget_s}")
        if self.marker and not self.marker.isidentifier():
            raise ValueError(f"step {self.name!r}: marker must be one marker name, got {self.marker!r}")

    @property
    def kind(self) -> str:
        return "pytest" if self.tests else "command"


#: What the gate itself may take: installing the tree into a temporary folder (1 s here), the
#: version probe and the backend-by-name probe (an interpreter with torch each: 2-4 s here).
GATE_S = 20

STEPS: list[Step] = [
    Step("smoke", 25, "gpu_smoke.py: CUDA init ~3 s, ~10 cases on eager pieces < 1 s each; was capped at 60 s unmeasured",
         command=("{py}", "scripts/gpu_smoke.py")),
    Step("headline", 85, "toy llama 8x512: 3 distinct Inductor pieces (~10 s each cold, Triton included) shared by "
         "FULL and breakable PIECEWISE, per-piece ~10 s (FX graph cache warm), reduce-overhead one whole-graph "
         "compile ~30 s, 3 sizes captured per variant, timing ~5 s",
         command=("{py}", "-m", "benchmarks.bench_cuda", "--headline", "--quick", "--out", "{out}/headline.md")),
    Step("rules", 25, "the double's rule steps on the GPU: ~16 steps of < 0.5 s, interpreter and CUDA init ~10 s",
         tests=("tests/platforms/test_cuda_double.py",)),
    Step("cuda", 50, "44 tests: 6 with Inductor pieces (~10 s each cold) = 60 s serial, the rest < 0.5 s; 4 workers: "
         "~15 s of compiles each plus interpreter and CUDA init (~10 s); was 75 s, 25 s went to 'partition'",
         tests=("tests/gpu/test_cuda.py",), workers=4),
    Step("partition", 25, "use_inductor_graph_partition vs per-piece (eager pieces) on a 2-layer toy llama, FULL and "
         "PIECEWISE steps: one cold Inductor compile of the whole graph (~15 s, Triton included), 2 x 2 captures",
         tests=("tests/gpu/test_partition_cuda.py",)),
    Step("memory", 20, "2 tests on eager pieces: one ladder capture of ~10 sizes",
         tests=("tests/capture/test_memory.py",)),
    Step("twins", 40, "simulator rules, micro-batching and the state ops on real graphs, ~32 tests on eager pieces; "
         "2 workers",
         tests=("tests/platforms/test_sim_rules.py", "tests/core/test_inputs.py", "tests/kv/test_kv.py",
                "tests/attention/test_attention.py", "tests/ubatch/test_ubatch.py", "tests/ubatch/test_ubatch_cuda.py",
                "tests/state/test_state.py"),
         workers=2),
    Step("hf", 45, "5 architectures, then 5 with state layers (qwen3_next, nemotron_h, mamba, lfm2, llama4_text), "
         "in one process on eager pieces (capture of 5 sizes, generate, reference generate: ~4 s each)",
         tests=("tests/hf/test_hf.py", "tests/hf/test_hf_state.py")),
    Step("example", 40, "hf_generate.py llama --check --lazy --sample: one cold Inductor compile of a 2-layer llama "
         "(3 pieces, ~25 s), 10 eager steps, capture_idle of the ~4 graphs they asked for, two more generate calls "
         "(< 1 s each); the one HF subprocess of the check",
         command=("{py}", "examples/hf_generate.py", "--arch", "llama", "--check", "--lazy", "--sample")),
    Step("spec", 40, "3 speculative engines with Inductor pieces (target and drafter, ~25 s each cold); 3 workers",
         tests=("tests/spec/test_spec.py",), workers=3),
    Step("attnbench", 15, "attention op table only: no compile, 4 variants x 2 lengths x 5 reps of ~0.1 ms",
         command=("{py}", "-m", "benchmarks.bench_attention", "--device", "cuda", "--quick", "--tables", "op",
                  "--out", "{out}/attention.md")),
    Step("hfbench", 35, "HFEngine (4-layer llama, one Inductor compile ~15 s, 2 sizes) vs generate_batch vs "
         "generate, 32 new tokens, 3 repetitions",
         command=("{py}", "-m", "benchmarks.bench_hf_throughput", "--device", "cuda", "--quick",
                  "--out", "{out}/hf_throughput.md")),
    Step("breaks", 15, "bench_breaks: no compile; 64-break capture through pb.breakable_graph vs one torch.cuda.graph "
         "per segment, 5 repetitions of < 0.5 s each, CUDA init ~5 s; prints its table (no file)",
         command=("{py}", "benchmarks/run.py", "--quick", "--only", "breaks")),
    Step("nccl", 150, "2+ GPUs only: tensor_parallel.py and moe_dbo.py --check, bench_dbo.py on NCCL", gpus=2,
         command=("bash", "-c", "{py} -m torch.distributed.run --standalone --nproc-per-node 2 examples/tensor_parallel.py "
                  "--check --steps 8 && {py} -m torch.distributed.run --standalone --nproc-per-node 2 "
                  "examples/moe_dbo.py --check --steps 8 && {py} benchmarks/bench_dbo.py --quick --backend nccl")),
    Step("hf_tp", 60, "2+ GPUs only, never run yet (unverified): hf_generate.py --tp --check, a tiny llama loaded with "
         "tp_plan='auto' on 2 NCCL ranks, NCCL inside the CUDA graphs; 2 rank start-ups ~10 s each, one Inductor "
         "compile of the tiny model ~20 s, capture of 10 graphs and 5 requests a few seconds", gpus=2,
         command=("{py}", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "examples/hf_generate.py", "--arch", "llama", "--tp", "--check")),
]
