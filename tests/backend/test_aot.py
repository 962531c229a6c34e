"""pb.aot_compile / pb.load_compiled: a compiled model saved to a file and loaded without Dynamo.

In-process tests with eager pieces (no Inductor); the fresh-process load of Inductor pieces is
in test_compile_cache.py (``test_fresh_process_loads_aot_file_without_dynamo``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re

import pytest
import torch

import piecewise_backend as pb
from piecewise_backend.backend import aot
from piecewise_backend.backend.trust import TRUST_ENV, UntrustedPathError
from pbtest.helpers import SIM, TINY_LLAMA, make_model, tiny_llama

EAGER = pb.CompilationConfig(compile_pieces="eager")


def ids(n: int) -> torch.Tensor:
    return torch.arange(n) % TINY_LLAMA["vocab_size"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("aot") / "model.pb"
    torch._dynamo.reset()
    model = tiny_llama(2)
    with torch.inference_mode():
        compiled = pb.aot_compile(model, [pb.mark_token_dim(ids(8))], config=EAGER, path=path)
        torch.testing.assert_close(compiled(ids(8)), model(ids(8)))
    return path


def test_load_runs_every_size_without_tracing(saved):
    model = tiny_llama(2)
    frames = torch._dynamo.utils.counters["frames"]["total"]
    with torch.inference_mode(), pb.expect(graphs=0, compiles=0, cache_loads=0):
        loaded = pb.load_compiled(saved, model)
        for n in (1, 3, 8, 13):
            torch.testing.assert_close(loaded(ids(n)), model(ids(n)))
    assert torch._dynamo.utils.counters["frames"]["total"] == frames


def test_weights_come_from_the_model_given_at_load(saved):
    other = make_model(2, "inplace", seed=1, **TINY_LLAMA)
    with torch.inference_mode():
        out = pb.load_compiled(saved, other)(ids(4))
        torch.testing.assert_close(out, other(ids(4)))
        assert not torch.allclose(out, tiny_llama(2)(ids(4)))


def test_grad_mode_must_match_compile_time(saved):
    loaded = pb.load_compiled(saved, tiny_llama(2))
    with pytest.raises(RuntimeError, match="grad mode disabled"):
        loaded(ids(4))


def test_input_outside_the_guards_is_refused(saved):
    loaded = pb.load_compiled(saved, tiny_llama(2))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="[Gg]uard"):
        loaded(ids(4).to(torch.int32))


def test_other_torch_version_refuses_to_load(saved, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    with pytest.raises(RuntimeError, match="compile again"):
        pb.load_compiled(saved, tiny_llama(2))


def _flip_nine_bytes(data: bytes) -> bytes:  # the "eps constant" edit: runs, wrong, silently
    mid = len(data) // 2
    return data[:mid] + bytes(b ^ 0x01 for b in data[mid : mid + 9]) + data[mid + 9 :]


def _truncate(data: bytes) -> bytes:
    return data[: len(data) * 2 // 3]


def _wrong_magic(data: bytes) -> bytes:
    return b"XXXXXXXX" + data[8:]


def _format_1(data: bytes) -> bytes:  # what this package wrote before files were framed
    return pickle.dumps({"something": "else"})


def _garbage(data: bytes) -> bytes:
    return b"garbage"


def _framed(payload: bytes) -> bytes:
    return aot.MAGIC + hashlib.sha256(payload).digest() + payload


def _bad_pickle(data: bytes) -> bytes:  # a right checksum over a payload that is not a pickle
    return _framed(b"\x80\x04garbage")


def _bad_function(data: bytes) -> bytes:  # a right frame and environment, torch cannot load the function
    return _framed(pickle.dumps({"env": aot._environment(), "grad_enabled": False, "inference_mode": True,
                                 "function": b"\x00not a compiled function"}))


DAMAGE = {
    _flip_nine_bytes: "corrupt or truncated", _truncate: "corrupt or truncated", _wrong_magic: "not a file saved by",
    _format_1: "not a file saved by", _garbage: "not a file saved by", _bad_pickle: "could not be read",
    _bad_function: "could not be loaded",
}


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda f: f.__name__.strip("_"))
def test_every_damaged_file_is_a_clear_error_naming_it(saved, tmp_path, damage):
    bad = tmp_path / "bad.pb"
    bad.write_bytes(damage(saved.read_bytes()))
    with pytest.raises(aot.AOTFileError, match=re.escape(str(bad)) + ".*" + DAMAGE[damage] + ".*compile again"):
        pb.load_compiled(bad, tiny_llama(2))


def test_file_others_can_write_is_refused(saved, tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    shared = tmp_path / "model.pb"
    shared.write_bytes(saved.read_bytes())
    os.chmod(shared, 0o664)
    with pytest.raises(UntrustedPathError, match=f"AOT file.*{shared}.*writable by its group"):
        pb.load_compiled(shared, tiny_llama(2))
    os.chmod(shared, 0o600)
    os.chmod(tmp_path, 0o777)  # a directory anyone can write: the file could be swapped
    try:
        with pytest.raises(UntrustedPathError, match=f"through {tmp_path}"):
            pb.load_compiled(shared, tiny_llama(2))
        pb.load_compiled(shared, tiny_llama(2), trust=True)  # the explicit opt-in
        monkeypatch.setenv(TRUST_ENV, "1")
        pb.load_compiled(shared, tiny_llama(2))
    finally:
        os.chmod(tmp_path, 0o700)


def test_file_reached_through_a_symlink_others_can_swap_is_refused(saved, tmp_path, monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    (private / "model.pb").write_bytes(saved.read_bytes())
    os.chmod(private / "model.pb", 0o600)
    (shared / "model.pb").symlink_to(private / "model.pb")
    (shared / "dir").symlink_to(private)
    os.chmod(shared, 0o777)
    try:
        for given in (shared / "model.pb", shared / "dir" / "model.pb"):
            with pytest.raises(UntrustedPathError, match=f"AOT file '{given}' \\(through {shared}\\)"):
                pb.load_compiled(given, tiny_llama(2))
        with pytest.raises(UntrustedPathError, match=f"refusing to save an AOT file into '{shared / 'dir'}'"):
            pb.load_compiled(private / "model.pb", tiny_llama(2)).save(shared / "dir" / "copy.pb")
        assert not (private / "copy.pb").exists()
    finally:
        os.chmod(shared, 0o700)
    pb.load_compiled(private / "model.pb", tiny_llama(2))


def test_saved_file_is_private_and_home_is_expanded(saved, tmp_path, monkeypatch):
    assert saved.stat().st_mode & 0o777 == 0o600
    monkeypatch.setenv("HOME", str(tmp_path))
    loaded = pb.load_compiled(saved, tiny_llama(2))
    loaded.save("~/again.pb")
    assert (tmp_path / "again.pb").stat().st_mode & 0o777 == 0o600
    pb.load_compiled("~/again.pb", tiny_llama(2))


def test_tensor_made_outside_inference_mode_is_a_clear_error(saved):
    loaded = pb.load_compiled(saved, tiny_llama(2))
    outside = ids(4)  # compiled with inference tensors; the guards tell the two apart
    with torch.inference_mode(), pytest.raises(RuntimeError, match="argument 0 is made outside torch.inference_mode"):
        loaded(outside)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids(4)), tiny_llama(2)(ids(4)))


def test_save_leaves_no_temp_file(saved):
    assert [p.name for p in saved.parent.iterdir()] == [saved.name]


def test_bad_arguments_name_the_type():
    with pytest.raises(TypeError, match="nn.Module, got function"):
        pb.aot_compile(lambda x: x, [ids(2)])
    with pytest.raises(TypeError, match="CompilationConfig, got dict"):
        pb.aot_compile(tiny_llama(1), [ids(2)], config={})


def test_marked_inputs_and_the_runner_work_with_a_loaded_model(saved):
    # the runner marks its views for tracing; a loaded model is traced already and drops the marks
    model = tiny_llama(2)
    loaded = pb.load_compiled(saved, model)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(pb.mark_token_dim(ids(5))), model(ids(5)))
        runner = pb.GraphRunner(loaded, SIM.replace(capture_sizes=[1, 2, 8]), [pb.StaticInput("input_ids")])
        runner.capture(progress=False)
        torch.testing.assert_close(runner.run(input_ids=ids(5)), model(ids(5)))
        torch.testing.assert_close(runner.run(input_ids=ids(1)), model(ids(1)))


def test_aot_compile_works_with_dynamos_aot_flag_off(tmp_path):
    # torch 2.11 ships torch.compile(...).aot_compile behind this flag, off by default; aot_compile
    # turns it on for its own compile only. Forcing it off here runs the 2.11 path on 2.13 too.
    model = tiny_llama(1)
    with torch._dynamo.config.patch(enable_aot_compile=False), torch.inference_mode():
        compiled = pb.aot_compile(model, [pb.mark_token_dim(ids(4))], config=EAGER, path=tmp_path / "m.pb")
        torch.testing.assert_close(compiled(ids(3)), model(ids(3)))
        assert torch._dynamo.config.enable_aot_compile is False  # left as the caller set it
        torch.testing.assert_close(pb.load_compiled(tmp_path / "m.pb", model)(ids(2)), model(ids(2)))


def test_importing_the_package_does_not_import_dynamo():
    """PiecewiseArtifact's base imports all of Dynamo (~1.2 s here): the class is built on first use, so a user
    of the compile-free API or the simulator does not pay for it at import."""
    import subprocess
    import sys

    code = ("import sys, piecewise_backend, piecewise_backend.backend.aot as aot; assert 'torch._dynamo' not in sys.modules; "
            "cls = aot.PiecewiseArtifact; assert 'torch._dynamo' in sys.modules and cls is aot._artifact_class(); "
            "print(cls.__module__, cls.__qualname__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["piecewise_backend.backend.aot", "PiecewiseArtifact"]
