"""Run the benchmarks: the one documented entry point.

    .venv/bin/python benchmarks/run.py [--quick] [--out docs/benchmarks.md]
    .venv/bin/python benchmarks/run.py --only wrappers,replay      # a subset
    python benchmarks/run.py --cuda --out docs/benchmarks.md        # GPU only (scripts/gpu_check.sh)
    .venv/bin/python benchmarks/run.py --quick --only hf_throughput  # by name only: a CPU smoke of a GPU comparison

Without ``--cuda``, runs the CPU benchmarks (wrappers, host, replay, forward, compile, memory, attention, spec,
dbo, tp, breaks, serving, state, cold_start, soak) and, when a GPU is present, the CUDA ones too (``breaks`` adds its GPU comparison itself:
``--only breaks`` on a GPU machine measures it). Every table is printed; with ``--out`` the results
replace the lines between the ``cpu-results`` (or ``gpu-results``) BEGIN/END marker
comments of that markdown file, rewritten after each benchmark so an interrupted run
keeps what it measured. The exit status is 1 if a benchmark raised, or a section reports a variant of
this library that failed or disagreed with its reference (``Section.data["failed"]``). See docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))

from benchmarks.common import Section, env_table, environment, log

CPU_BENCHMARKS = ("wrappers", "host", "replay", "forward", "compile", "memory", "attention", "spec", "dbo", "tp", "breaks",
                  "serving", "state", "cold_start", "soak")
# By name only (--only): their CPU numbers mean little (simulated graphs); scripts/gpu_check.sh runs them on a GPU
BY_NAME = ("hf_throughput",)
QUICK_SKIPS = {"compile": "skipped in --quick (every row is a fresh process with a cold or warm Inductor cache)"}

TEMPLATE = """# Benchmarks

<!-- BEGIN cpu-results -->
<!-- END cpu-results -->

<!-- BEGIN gpu-results -->
<!-- END gpu-results -->
"""


def _module(name: str):
    import importlib

    return importlib.import_module(f"benchmarks.bench_{name}")


def write_section(path: Path, which: str, text: str) -> None:
    """Replace what lies between the ``{which}-results`` BEGIN and END marker lines of ``path``.

    Markers count only as whole lines, so prose may mention them.
    """
    begin, end = f"<!-- BEGIN {which}-results -->", f"<!-- END {which}-results -->"
    doc = path.read_text() if path.exists() else TEMPLATE
    pattern = re.compile(rf"^{re.escape(begin)}[ \t]*\n.*?^{re.escape(end)}[ \t]*$", re.S | re.M)
    if not pattern.search(doc):
        doc = doc.rstrip("\n") + f"\n\n{begin}\n{end}\n"
    new = f"{begin}\n{text.strip()}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(pattern.sub(lambda _: new, doc, count=1))


def render(title: str, env: dict[str, str], command: str, sections: list[Section], status: str, extra: str = "") -> str:
    parts = [f"### {title}", "", f"Command: `{command}`", "", env_table(env), ""]
    if extra:
        parts += [extra.strip(), ""]
    parts += [s.markdown(level=4) for s in sections]
    if status:
        parts += [f"_{status}_", ""]
    return "\n".join(parts)


def pytest_summary(path: str | None) -> str:
    if not path:
        return ""
    p = Path(path)
    if not p.exists():
        return f"CUDA tests: no log at {path}."
    lines = [ln.rstrip() for ln in p.read_text(errors="replace").splitlines() if ln.strip()]
    keep = [ln for ln in lines if any(k in ln for k in ("passed", "failed", "error", "skipped", "FAILED", "ERROR",
                                                         "no tests ran", "not found", "exit"))]
    body = "\n".join((keep or lines)[-25:])
    return f"CUDA tests (`{p.name}`, last lines):\n\n```\n{body}\n```"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (about a minute)")
    ap.add_argument("--out", type=Path, help="markdown file whose results section to rewrite")
    ap.add_argument("--only", help=f"comma-separated subset of {','.join(CPU_BENCHMARKS + BY_NAME)},cuda")
    ap.add_argument("--cuda", action="store_true", help="run only the CUDA benchmarks (GPU section)")
    ap.add_argument("--simulate-cuda", action="store_true", help="smoke-test the CUDA script on the CPU simulator")
    ap.add_argument("--budget", type=float, default=None, help="seconds after which remaining timings are cut short")
    ap.add_argument("--pytest-log", help="CUDA test log to summarize in the GPU section")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the CPU forward benchmark (default 1)")
    args = ap.parse_args(argv)

    import torch

    deadline = time.monotonic() + args.budget if args.budget else None
    has_cuda = torch.cuda.is_available()
    if args.cuda or args.simulate_cuda:
        names = ["cuda"]
    elif args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
    else:
        names = list(CPU_BENCHMARKS) + (["cuda"] if has_cuda else [])
    unknown = [n for n in names if n not in CPU_BENCHMARKS + BY_NAME + ("cuda",)]
    if unknown:
        ap.error(f"unknown benchmark(s) {unknown}; valid: {', '.join(CPU_BENCHMARKS + BY_NAME)}, cuda")
    command = "python benchmarks/run.py " + " ".join(a for a in (argv if argv is not None else sys.argv[1:]))

    groups = {"cpu": [n for n in names if n != "cuda"], "gpu": [n for n in names if n == "cuda"]}
    failures = 0
    for which, group in groups.items():
        if not group:
            continue
        device = "cuda" if which == "gpu" and has_cuda else "cpu"
        env = environment(device)
        if which == "cpu":
            env["torch threads"] = f"{env['torch threads']} (forward benchmark: {args.threads})"
        title = "GPU results" if which == "gpu" else "CPU results"
        extra = pytest_summary(args.pytest_log) if which == "gpu" else ""
        sections: list[Section] = []
        if which == "gpu":  # two parts, so that the doc is rewritten after each
            group = ["cuda:latency", "cuda:capture"]
        for i, name in enumerate(group):
            status = f"running: {name} ({i + 1}/{len(group)}); an interrupted run leaves this line"
            if args.out:
                write_section(args.out, which, render(title, env, command, sections, status, extra))
            if args.quick and name in QUICK_SKIPS:
                sections.append(Section(f"{name}", QUICK_SKIPS[name]))
                continue
            log(f"== {name}")
            t0 = time.perf_counter()
            try:
                kw = {"quick": args.quick, "deadline": deadline}
                if name == "forward":
                    kw["threads"] = args.threads
                if name.startswith("cuda:"):
                    kw.update(simulate=args.simulate_cuda, parts=(name.split(":")[1],))
                new = _module(name.split(":")[0]).run(**kw)
            except Exception as e:  # one broken benchmark must not hide the others
                traceback.print_exc()
                failures += 1
                new = [Section(f"{name}: error", f"`{type(e).__name__}: {e}`")]
            failed = [f for s in new for f in s.data.get("failed", ())]
            if failed:  # a variant of this library failed or disagreed (a section says which): the run fails
                log(f"== {name}: FAILED {', '.join(map(str, failed))}")
                failures += 1
            log(f"== {name} done in {time.perf_counter() - t0:.0f} s")
            for s in new:
                print(s.markdown(), flush=True)
            sections += new
        if args.out:
            write_section(args.out, which, render(title, env, command, sections, "", extra))
            log(f"wrote the {which.upper()} section of {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
