"""``python -m piecewise_backend inspect MODULE:FACTORY [--tokens N] [--dump DIR] [--context MODULE:FUNC]``."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from piecewise_backend import inspect_cli

ROOT = Path(__file__).resolve().parents[2]
TOY = "piecewise_backend.toy_llama:make_model"


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "support"), os.environ.get("PYTHONPATH")])))
    env.pop("TORCH_LOGS", None)
    return subprocess.run(
        [sys.executable, "-m", "piecewise_backend", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )


# Factories for in-process runs (imported by name, like a user's own module).
@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    return cli("inspect", TOY, "--tokens", "6", "--dump", str(dump)), dump


def _table_rows(stdout: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if re.match(r"^\d+\s+submod_\d+\s", line)]


def test_inspect_toy_prints_piece_table(toy_run):
    proc, _ = toy_run
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "inputs: torch.randint(0, 128, (6,))" in out  # vocab from model.cfg, --tokens honoured
    assert "graphs: 1" in out
    assert "graph 0: 5 pieces, 2 splitting, 3 compiled" in out
    assert re.search(r"^index\s+name\s+kind\s+nodes\s+inputs\s+outputs\s+splitting op$", out, re.M)
    rows = _table_rows(out)
    assert [r[:3] for r in rows] == [
        ["0", "submod_0", "compiled"],
        ["1", "submod_1", "splitting"],
        ["2", "submod_2", "compiled"],
        ["3", "submod_3", "splitting"],
        ["4", "submod_4", "compiled"],
    ]
    for r in rows:
        assert all(c.isdigit() for c in r[3:6]), r
    # attention pieces: one op; q, k, v and the out buffer in; nothing out (the op writes `out`)
    assert [r[3:] for r in rows if r[2] == "splitting"] == [["1", "4", "0", "pb_toy::attention"]] * 2
    assert all(int(r[3]) > 5 and int(r[5]) >= 1 for r in rows if r[2] == "compiled")
    assert "splitting ops found: pb_toy::attention\n" in out
    not_found = re.search(r"^splitting ops not found: (.*)$", out, re.M).group(1).split(", ")
    assert sorted(not_found) == ["pb_toy::attention_fresh", "torch.nn.functional.scaled_dot_product_attention"]
    assert "eager check: compiled output matches eager" in out
    assert "Traceback" not in proc.stderr
    assert "split into" not in proc.stderr  # the package's DEBUG log stays off without TORCH_LOGS


def test_inspect_dump_writes_readable_python(toy_run):
    proc, dump = toy_run
    assert proc.returncode == 0, proc.stderr
    graph_dirs = [d for d in dump.iterdir() if d.is_dir()]
    assert [d.name for d in graph_dirs] == ["graph_0"]
    files = sorted(f.name for f in graph_dirs[0].iterdir())
    assert files == sorted(
        ["split.py"] + [f"submod_{i}_{'splitting' if i % 2 else 'compiled'}.py" for i in range(5)]
    )
    assert f"dumped 6 files to {dump}" in proc.stdout
    for f in graph_dirs[0].iterdir():
        ast.parse(f.read_text(), filename=str(f))  # readable Python, not a repr
    split = (graph_dirs[0] / "split.py").read_text()
    assert all(f"submod_{i}" in split for i in range(5))
    attn = (graph_dirs[0] / "submod_1_splitting.py").read_text()
    assert "torch.ops.pb_toy.attention" in attn
    assert "pb_toy" not in (graph_dirs[0] / "submod_0_compiled.py").read_text()


def test_inspect_factory_with_example_inputs(capsys):
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:pair_factory", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "inputs: example inputs from the factory (--tokens ignored)" in out
    assert "model: pbtest.cli_factories:pair_factory (ToyLlama)" in out
    assert "splitting ops found: torch.nn.functional.scaled_dot_product_attention\n" in out
    assert [r[2] for r in _table_rows(out)] == ["compiled", "splitting", "compiled", "splitting", "compiled"]
    assert "eager check: compiled output matches eager" in out


def test_inspect_reports_mismatch_and_unsplit_graph(capsys):
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:noisy_factory", "--tokens", "4"]) == 1
    out = capsys.readouterr().out
    assert "inputs: torch.randint(0, 128, (4,))" in out  # no cfg/config: default vocab
    assert "graph 0: 1 pieces, 0 splitting, 1 compiled" in out
    assert "splitting ops found: none" in out
    assert "note: no splitting op appeared" in out
    assert "eager check: MISMATCH" in out


def test_vocab_size_sources():
    class Cfg:
        vocab_size = 77

    class A:
        cfg = Cfg()

    class B:
        config = Cfg()

    assert inspect_cli.vocab_size(A()) == 77
    assert inspect_cli.vocab_size(B()) == 77
    assert inspect_cli.vocab_size(object()) == 128


@pytest.mark.parametrize(
    "argv, message",
    [
        (["inspect", "piecewise_backend.toy_llama"], "expected MODULE:FACTORY"),
        (["inspect", ":make_model"], "expected MODULE:FACTORY"),
        (["inspect", "no_such_module_pb:make"], "cannot import module 'no_such_module_pb'"),
        (["inspect", "piecewise_backend.toy_llama:no_such_factory"], "has no attribute 'no_such_factory'"),
        (["inspect", "pbtest.cli_factories:not_a_factory"], "is not callable"),
        (["inspect", TOY, "--tokens", "0"], "argument --tokens: must be a positive integer, got 0"),
        (["inspect", TOY, "--tokens", "-3"], "argument --tokens: must be a positive integer, got -3"),
        (["inspect", TOY, "--tokens", "many"], "argument --tokens: must be a positive integer, got 'many'"),
        (["inspect"], "the following arguments are required: MODULE:FACTORY"),
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        inspect_cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: python -m piecewise_backend" in err
    assert message in err


def test_bad_argument_exit_code_in_subprocess():
    proc = cli("inspect", "no_such_module_pb:make")
    assert proc.returncode == 2
    assert "error: cannot import module 'no_such_module_pb'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_inspect_hf_model_gets_2d_keyword_ids(capsys):
    pytest.importorskip("transformers")
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:hf_factory", "--tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "model: pbtest.cli_factories:hf_factory (LlamaForCausalLM)" in out
    assert "inputs: input_ids=torch.randint(0, 64, (1, 5)), use_cache=False" in out
    assert "splitting ops found: torch.nn.functional.scaled_dot_product_attention\n" in out
    assert [r[2] for r in _table_rows(out)] == ["compiled", "splitting", "compiled", "splitting", "compiled"]
    assert "eager check: compiled output matches eager" in out


def test_inspect_keyword_example_inputs(capsys):
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:keyword_factory"]) == 0
    out = capsys.readouterr().out
    assert "inputs: example inputs from the factory" in out
    assert "eager check: compiled output matches eager" in out


@pytest.mark.parametrize(
    "target, message",
    [
        (
            "pbtest.cli_factories:raising_factory",
            r"error: the factory pbtest.cli_factories:raising_factory raised ValueError: no weights here "
            r"\(at .*cli_factories.py:\d+\)",
        ),
        (
            "pbtest.cli_factories:failing_model_factory",
            r"error: the model on torch.randint\(0, 128, \(8,\)\) raised TypeError: .*'mask'; "
            r"return \(model, example_inputs\) from the factory",
        ),
    ],
)
def test_failing_factory_or_model_is_one_clean_line(target, message, capsys):
    assert inspect_cli.main(["inspect", target]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(message + "\n", err), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["inspect", "pbtest.cli_factories:factory_with_arguments"],
            "pbtest.cli_factories:factory_with_arguments needs arguments (size)",
        ),
        (["inspect", TOY, "--dump", __file__], f"argument --dump: {__file__!r} is a file; give a directory"),
    ],
)
def test_factory_arguments_and_dump_file_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        inspect_cli.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_failing_factory_in_subprocess_has_no_traceback():
    proc = cli("inspect", "pbtest.cli_factories:raising_factory")
    assert proc.returncode == 1
    assert "error: the factory pbtest.cli_factories:raising_factory raised ValueError: no weights here" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("context, scale", [("scale_context", "6.0"), ("fixed_context", "0.5")])
def test_inspect_runs_a_model_that_reads_the_forward_context(context, scale, capsys):
    """--context MODULE:FUNC: FUNC (given the model's inputs, or none if it takes none) returns the
    forward-context attributes; the eager and the compiled run both see them."""
    argv = ["inspect", "pbtest.cli_factories:context_model_factory", "--tokens", "6",
            "--context", f"pbtest.cli_factories:{context}"]
    assert inspect_cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"forward context: pbtest.cli_factories:{context} (scale={scale})" in out
    assert "eager check: compiled output matches eager" in out


def test_inspect_without_a_context_says_to_pass_one(capsys):
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:context_model_factory"]) == 1
    err = capsys.readouterr().err
    assert "raised RuntimeError: no forward context is set" in err and "pass --context MODULE:FUNC" in err, err


@pytest.mark.parametrize(
    "context, message",
    [
        ("pbtest.cli_factories:not_a_dict_context", "returned list; expected a dict of forward-context attributes"),
        ("pbtest.cli_factories:nope", "module 'pbtest.cli_factories' has no attribute 'nope'"),
        ("no_colon", "argument --context: expected MODULE:FUNC"),
    ],
)
def test_inspect_bad_context_is_a_usage_error(context, message, capsys):
    with pytest.raises(SystemExit) as exc:
        inspect_cli.main(["inspect", "pbtest.cli_factories:context_model_factory", "--context", context])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_inspect_names_the_graph_break_that_cut_the_model(capsys):
    assert inspect_cli.main(["inspect", "pbtest.cli_factories:graph_break_factory"]) == 0
    out = capsys.readouterr().out
    assert "graph 0: " in out and "(graph break: Dynamo ended this graph at a graph break at " in out, out
    assert "note: Dynamo broke the model into 2 graphs at graph breaks" in out, out
