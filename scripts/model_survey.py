"""Run ``examples/hf_generate.py --arch TYPE --check`` for every transformers causal-LM type; write docs/models.md.

Each type runs in its own process with a timeout. Outcomes: ``pass`` (exit 0: served, tokens checked),
``refused`` (exit 2: refused up front by ``hf.adapt`` with the reason), ``not built`` (exit 2 from
``tiny_random_model``: the type's config cannot make a tiny model), ``wrong`` (exit 1 with a token
mismatch), ``crash`` (exit 1 otherwise), ``timeout``. A pass also records how many Dynamo graphs the
engine compiled (the example's ``dynamo graphs: N`` line) and, for more than one, the first graph break:
the tokens are right, but each break costs dispatch and leaves graphs without a splitting op.

``--vlm`` runs ``examples/vlm_generate.py --arch TYPE --check`` for every image-text-to-text type instead
(transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``) and writes its section of the same file
(after :data:`VLM_MARK`; the causal-LM table before it is kept, and a causal-LM run keeps the VLM section).

Run: python scripts/model_survey.py [--types llama mixtral ...] [--timeout 60] [--out docs/models.md]
     python scripts/model_survey.py --vlm [--types llava qwen2_vl ...] [--timeout 120]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTCOMES = ("pass", "refused", "not built", "wrong", "crash", "timeout")
_NOT_BUILT = ("has no causal LM class", "is not a transformers model type", "tiny_random_model", "tiny_random_vlm",
              "is not an image-text-to-text model type")
#: The line that starts the image-text-to-text section of docs/models.md.
VLM_MARK = "<!-- image-text-to-text survey: scripts/model_survey.py --vlm -->"
EXAMPLES = {False: "hf_generate.py", True: "vlm_generate.py"}


@dataclasses.dataclass
class Result:
    arch: str
    outcome: str
    reason: str
    seconds: float
    graphs: int | None = None  #: Dynamo graphs the engine compiled (a pass), else None
    graph_break: str = ""  #: the first graph break when graphs > 1 (or why there are several graphs)


def causal_lm_types() -> list[str]:
    import transformers

    return sorted({config.model_type for config in transformers.MODEL_FOR_CAUSAL_LM_MAPPING.keys()})


def image_text_to_text_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def classify(arch: str, rc: int | None, out: str, seconds: float) -> Result:
    """The outcome of one run from its exit status and output."""
    lines = [line for line in out.splitlines() if line.strip()]
    if rc is None:
        return Result(arch, "timeout", "", seconds)
    if rc == 0:
        check = next((line for line in lines if line.startswith("check:")), "served (no check line)").removeprefix("check: ")
        forward = [line.split(":")[0].removeprefix("FORWARD ") for line in lines if line.startswith("FORWARD ")]
        if forward:  # the engine equals the model's forward; HF's cached generate does not
            check += f"; generate's cached path disagrees with the model's own forward for {', '.join(forward)}"
        graphs = next((line.removeprefix("dynamo graphs: ") for line in lines if line.startswith("dynamo graphs: ")), None)
        count, _, cut = graphs.partition("; first graph break: ") if graphs is not None else ("", "", "")
        if count.isdigit() and int(count) > 1 and not cut:
            cut = "no graph break recorded (Dynamo recompiled: a guard failed)"
        return Result(arch, "pass", check, seconds, int(count) if count.isdigit() else None, cut if count.isdigit() and int(count) > 1 else "")
    error = next((line.split("error: ", 1)[1] for line in lines if re.match(r"^\w+\.py: error: ", line)), None)
    if rc == 2 and error is not None:
        return Result(arch, "not built" if "cannot build" in error or any(s in error for s in _NOT_BUILT) else "refused", error, seconds)
    mismatch = [line for line in lines if line.startswith("MISMATCH")]
    if mismatch:
        check = next((line for line in lines if line.startswith("check:")), "")
        return Result(arch, "wrong", f"{check.removeprefix('check: ')}; first: {mismatch[0]}", seconds)
    last = next((line for line in reversed(lines) if re.match(r"^[\w.]+(Error|Exception|Exit)\b|^\w+:", line)), lines[-1] if lines else "")
    return Result(arch, "crash", last.strip(), seconds)


def run_one(arch: str, timeout: float, example: str = "hf_generate.py") -> Result:
    """The example in a fresh process: ``python examples/EXAMPLE --arch ARCH --check``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT / "src"))
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(ROOT / "examples" / example), "--arch", arch, "--check"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return classify(arch, None, "", time.perf_counter() - start)
    return classify(arch, proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start)


def run_forked(arch: str, timeout: float, example: str = "hf_generate.py") -> Result:
    """The example's ``main`` in a child forked from this process, which imported torch and transformers
    once (the import is most of a short run's time): the same isolation, exit status and output."""
    import multiprocessing
    import tempfile

    with tempfile.TemporaryFile(mode="w+") as log:
        child = multiprocessing.get_context("fork").Process(target=_child, args=(arch, log.fileno(), example))
        start = time.perf_counter()
        child.start()
        child.join(timeout)
        seconds = time.perf_counter() - start
        if child.is_alive():
            child.kill()
            child.join()
            return classify(arch, None, "", seconds)
        log.seek(0)
        return classify(arch, child.exitcode, log.read(), seconds)


def _child(arch: str, fd: int, example_file: str = "hf_generate.py") -> None:
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1)
    sys.stderr = sys.stdout
    import importlib.util
    import traceback

    sys.argv = [str(ROOT / "examples" / example_file), "--arch", arch, "--check"]  # argparse's prog name
    spec = importlib.util.spec_from_file_location(example_file.removesuffix(".py"), ROOT / "examples" / example_file)
    example = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(example)
        code = example.main(sys.argv[1:])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    os._exit(code)


def _cell(text: str, limit: int = 300) -> str:
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def table(results: list[Result], conditions: str) -> str:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    lines = [
        "# Model survey",
        "",
        "Every model type in transformers' causal-LM mapping, run through",
        "`python examples/hf_generate.py --arch TYPE --check` (a tiny random-weight model, 5 requests of",
        "different lengths, tokens compared with `model.generate`; a differing token passes only within the",
        "example's `LOGIT_TOL` of the best logit of the model's own forward over the same tokens: a tie, or",
        "generate's cached path leaving that forward, which the reason then names; where the model's own",
        "`generate` raises, tokens are compared with greedy decoding by a full recompute of its forward, and",
        "the reason says `match a full recompute (generate raised)`). Written by",
        "`scripts/model_survey.py`; refused types exit 2 from `hf.adapt` with the reason shown. A pass's",
        "`graphs` is how many Dynamo graphs the engine compiled (the example's `dynamo graphs: N`): 1 unless a",
        "graph break cut the model (those are listed after the passes, with the first break).",
        "",
        f"Conditions: {conditions}",
        "",
        "Counts: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES) + f" ({len(results)} types).",
        "",
    ]
    several = [r for r in results if r.outcome == "pass" and (r.graphs or 0) > 1]
    for outcome in OUTCOMES:
        group = [r for r in results if r.outcome == outcome]
        if not group:
            continue
        if outcome == "pass":  # with the number of Dynamo graphs: 1 unless a graph break cut the model
            lines += [f"## {outcome} ({len(group)})", "", "| type | outcome | graphs | reason | seconds |", "| --- | --- | --- | --- | --- |"]
            lines += [f"| {r.arch} | {r.outcome} | {'?' if r.graphs is None else r.graphs} | {_cell(r.reason)} | {r.seconds:.1f} |" for r in group]
        else:
            lines += [f"## {outcome} ({len(group)})", "", "| type | outcome | reason | seconds |", "| --- | --- | --- | --- |"]
            lines += [f"| {r.arch} | {r.outcome} | {_cell(r.reason)} | {r.seconds:.1f} |" for r in group]
        lines.append("")
        if outcome == "pass":
            lines += [
                f"## passes with more than one Dynamo graph ({len(several)})", "",
                "The tokens are right, but a graph break cut the model outside its splitting ops: the pieces on",
                "each side are separate graphs (more dispatch per step), and a graph without a splitting op is",
                "captured whole by its PIECEWISE graphs. The first break Dynamo reported:", "",
            ]
            if several:
                lines += ["| type | graphs | first graph break |", "| --- | --- | --- |"]
                lines += [f"| {r.arch} | {r.graphs} | {_cell(r.graph_break, 600)} |" for r in several]
            else:
                lines += ["None: every passing type compiled as one Dynamo graph. Breaks the library removed so far: a",
                          "`reshape(..., -1, d)` on the unbacked token count (qwen3_next, olmo_hybrid: `TokensFirst` tells",
                          "Dynamo a step has a token) and a buffer the forward assigns back to itself (ctrl: 9 graphs;",
                          "`hf/buffers.py`)."]
            lines.append("")
    return "\n".join(lines)


def vlm_table(results: list[Result], conditions: str) -> str:
    """The image-text-to-text section of docs/models.md (starts with :data:`VLM_MARK`)."""
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOMES}
    lines = [
        VLM_MARK,
        "# Image-text-to-text survey",
        "",
        "Every model type in transformers' `MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, run through",
        "`python examples/vlm_generate.py --arch TYPE --check`: a tiny random-weight model (`hf.tiny_random_vlm`),",
        "random pixel inputs of the shape it takes (`hf.random_mm_inputs`), a prompt with the image's placeholder",
        "tokens served beside a text-only prompt with chunked prefill, tokens compared with `model.generate` given",
        "the same inputs (a differing token passes only within 1e-3 of the forward's best logit). `refused`: refused",
        "up front by `HFEngine` with the reason (`hf/multimodal/families.py`'s REFUSED and its checks); `not built`: no tiny",
        "model or pixel inputs could be made for the type (the reason says why).",
        "",
        f"Conditions: {conditions}",
        "",
        "Counts: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES) + f" ({len(results)} types).",
        "",
    ]
    for outcome in OUTCOMES:
        group = [r for r in results if r.outcome == outcome]
        if group:
            lines += [f"## {outcome} ({len(group)})", "", "| type | outcome | reason | seconds |", "| --- | --- | --- | --- |"]
            lines += [f"| {r.arch} | {r.outcome} | {_cell(r.reason)} | {r.seconds:.1f} |" for r in group]
            lines.append("")
    return "\n".join(lines)


def sections(text: str) -> tuple[str, str]:
    """docs/models.md split into its causal-LM table and its image-text-to-text section ('' where absent)."""
    head, mark, tail = text.partition(VLM_MARK)
    return head.rstrip() + "\n", (mark + tail) if mark else ""


def parse(text: str) -> list[Result]:
    """The rows of a table written by :func:`table`."""
    rows, breaks = [], {}
    for line in text.splitlines():
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 4 and cells[1] in OUTCOMES:
            rows.append(Result(cells[0], cells[1], cells[2], float(cells[3])))
        elif len(cells) == 5 and cells[1] in OUTCOMES:
            rows.append(Result(cells[0], cells[1], cells[3], float(cells[4]), int(cells[2]) if cells[2].isdigit() else None))
        elif len(cells) == 3 and cells[1].isdigit():  # the section on passes with several graphs
            breaks[cells[0]] = cells[2]
    return [dataclasses.replace(r, graph_break=breaks.get(r.arch, "")) for r in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types to run (default: every causal-LM type)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per type")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "models.md")
    parser.add_argument("--conditions", default="", help="extra words for the conditions line (machine load, ...)")
    parser.add_argument("--merge", action="store_true", help="replace only these types' rows in --out, keep the others")
    parser.add_argument("--subprocess", action="store_true", help="a fresh interpreter per type (slower: imports each time)")
    parser.add_argument("--vlm", action="store_true", help="the image-text-to-text types (examples/vlm_generate.py)")
    args = parser.parse_args(argv)
    types = args.types or (image_text_to_text_types() if args.vlm else causal_lm_types())
    example = EXAMPLES[args.vlm]
    if not args.subprocess:  # imported once here, inherited by every forked child
        os.environ.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        sys.path.insert(0, str(ROOT / "src"))
        import torch
        import transformers  # noqa: F401

        import piecewise_backend.hf  # noqa: F401

        torch.set_num_threads(1)
    results = []
    for i, arch in enumerate(types):
        result = run_one(arch, args.timeout, example) if args.subprocess else run_forked(arch, args.timeout, example)
        results.append(result)
        print(f"[{i + 1}/{len(types)}] {arch}: {result.outcome} ({result.seconds:.1f} s) {result.reason[:160]}", flush=True)
    import torch
    import transformers

    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    device = "CUDA" if torch.cuda.is_available() else "simulated platform on the CPU"
    conditions = (f"{when}; torch {torch.__version__}, transformers {transformers.__version__}; {device}; "
                  f"{args.timeout:.0f} s per type, one at a time"
                  f"{' (fresh interpreter each)' if args.subprocess else ' (each in a child forked after importing torch and transformers)'}. "
                  f"{args.conditions}").strip()
    causal, vlm = sections(args.out.read_text()) if args.out.exists() else ("", "")
    if args.merge:  # rows of the other types kept from the existing table, with its conditions
        old_text = vlm if args.vlm else causal
        kept = [r for r in parse(old_text) if r.arch not in set(types)]
        previous = next(line.removeprefix("Conditions: ") for line in old_text.splitlines() if line.startswith("Conditions: "))
        conditions = f"{previous} Re-run later for {', '.join(types)}: {conditions}"
        results = sorted(kept + results, key=lambda r: r.arch)
    if args.vlm:
        args.out.write_text(causal + "\n" + vlm_table(results, conditions) + "\n")
    else:
        args.out.write_text(table(results, conditions) + "\n" + ("\n" + vlm if vlm else ""))
    print(", ".join(f"{sum(r.outcome == o for r in results)} {o}" for o in OUTCOMES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
