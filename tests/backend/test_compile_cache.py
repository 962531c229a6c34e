"""cache_dir: compiled pieces reused across backends and processes; every misuse warns and compiles."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

import piecewise_backend as pb
from piecewise_backend.backend import cache as compile_cache
from piecewise_backend.backend.keys import Uncacheable
from piecewise_backend.backend.trust import TRUST_ENV, UntrustedPathError
from pbtest.helpers import TINY_LLAMA, dynamo_graph, piece_fn, tiny_llama

ROOT = Path(__file__).resolve().parents[2]
X = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))


def compiled_piece_fn(cache_dir):
    torch._dynamo.reset()  # a fresh backend must really trace and compile
    config = pb.CompilationConfig(splitting_ops=[], cache_dir=cache_dir)
    return torch.compile(piece_fn, backend=pb.make_backend(config))


def entries(cache_dir) -> list[Path]:
    return sorted((Path(cache_dir) / "pieces").glob("*.piece"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A cache_dir holding the one piece of ``piece_fn``."""
    cache_dir = tmp_path_factory.mktemp("cache")
    with pb.expect(compiles=1, cache_saves=1, cache_loads=0):
        assert torch.equal(compiled_piece_fn(cache_dir)(X), piece_fn(X))
    assert len(entries(cache_dir)) == 1
    return cache_dir


def test_second_backend_loads_instead_of_compiling(saved):
    with pb.expect(compiles=0, cache_loads=1, cache_saves=0, cache_rejects=0):
        assert torch.equal(compiled_piece_fn(saved)(X), piece_fn(X))


def _copy(saved: Path, tmp_path: Path) -> Path:
    (tmp_path / "pieces").mkdir()
    for e in entries(saved):
        (tmp_path / "pieces" / e.name).write_bytes(e.read_bytes())
    return tmp_path


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 0xFF])


def _garbage(data: bytes) -> bytes:
    return b"not a cache entry"


def _valid_frame_bad_payload(data: bytes) -> bytes:
    # header and checksum right, payload not something torch can load: torch's loader fails
    import hashlib

    head = len(compile_cache.MAGIC) + 32
    payload = b"\x80\x04garbage"
    return compile_cache.MAGIC + hashlib.sha256(payload).digest() + data[head : head + 64] + payload


@pytest.mark.parametrize("damage", [_truncate, _flip_last_byte, _garbage, _valid_frame_bad_payload],
                         ids=lambda f: f.__name__.strip("_"))
def test_damaged_entry_warns_compiles_and_is_replaced(saved, tmp_path, caplog, damage):
    cache_dir = _copy(saved, tmp_path)
    (entry,) = entries(cache_dir)
    entry.write_bytes(damage(entry.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="piecewise_backend"):
        with pb.expect(compiles=1, cache_loads=0, cache_rejects=1, cache_saves=1):
            assert torch.equal(compiled_piece_fn(cache_dir)(X), piece_fn(X))
    assert any(str(entry) in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    with pb.expect(compiles=0, cache_loads=1):  # the recompiled piece replaced the damaged entry
        compiled_piece_fn(cache_dir)(X)


def test_entry_under_another_key_is_not_used(saved, tmp_path, caplog):
    cache_dir = _copy(saved, tmp_path)
    (entry,) = entries(cache_dir)
    cache = compile_cache.PieceCache(cache_dir)
    other = cache.path("0" * 64)
    other.write_bytes(entry.read_bytes())
    with caplog.at_level(logging.WARNING, logger="piecewise_backend"):
        assert cache.load("0" * 64) is None
    assert "another key" in caplog.text


def test_other_torch_version_is_another_key(saved, tmp_path, monkeypatch):
    cache_dir = _copy(saved, tmp_path)
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    compile_cache._environment.cache_clear()
    try:
        with pb.expect(compiles=1, cache_loads=0, cache_saves=1, cache_rejects=0):
            assert torch.equal(compiled_piece_fn(cache_dir)(X), piece_fn(X))
    finally:
        monkeypatch.undo()
        compile_cache._environment.cache_clear()
    assert len(entries(cache_dir)) == 2  # the other version's entry sits next to this one's


def test_grad_mode_is_part_of_the_key(saved):
    key = compile_cache.piece_key
    torch._dynamo.reset()
    gms = []
    torch.compile(piece_fn, backend=lambda gm, ex: gms.append(gm) or gm.forward)(X)
    with torch.no_grad():
        off = key(gms[0])
    assert key(gms[0]) != off


def test_unwritable_cache_dir_warns_and_compiles(tmp_path, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("a regular file cannot hold a directory, whoever writes (root included)")
    with caplog.at_level(logging.WARNING, logger="piecewise_backend"):
        with pb.expect(compiles=1, cache_saves=0, cache_loads=0):
            assert torch.equal(compiled_piece_fn(blocker / "cache")(X), piece_fn(X))
    assert "cannot write" in caplog.text and str(blocker / "cache") in caplog.text


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through directory permissions")
def test_read_only_cache_dir_warns_and_compiles(tmp_path, caplog):
    cache_dir = tmp_path / "ro"
    (cache_dir / "pieces").mkdir(parents=True)
    os.chmod(cache_dir / "pieces", 0o555)
    try:
        with caplog.at_level(logging.WARNING, logger="piecewise_backend"):
            with pb.expect(compiles=1, cache_saves=0):
                assert torch.equal(compiled_piece_fn(cache_dir)(X), piece_fn(X))
    finally:
        os.chmod(cache_dir / "pieces", 0o755)
    assert "cannot write" in caplog.text


def test_concurrent_writers_never_expose_a_partial_entry(saved, tmp_path):
    (entry,) = entries(saved)
    key = entry.stem
    artifact = compile_cache.PieceCache(saved).load(key)
    cache = compile_cache.PieceCache(tmp_path)
    stop, bad, saves = threading.Event(), [], []

    def write():
        for _ in range(20):
            saves.append(cache.save(key, artifact))

    def read():  # checks frame and checksum only: deserializing is the slow part, not the race
        while not stop.is_set():
            try:
                data = cache.path(key).read_bytes()
            except FileNotFoundError:
                continue
            if compile_cache.check_frame(data, key) is not None:
                bad.append(len(data))

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write) for _ in range(2)]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert all(saves) and len(saves) == 40
    assert bad == []
    assert [p.name for p in (tmp_path / "pieces").iterdir()] == [f"{key}.piece"]  # no temp file left
    assert cache.load(key) is not None


# --- the key covers everything that changes a piece's code, or the piece is not cached ---


class _Pass(CustomGraphPass):
    def __init__(self, uuid: str):
        self._uuid = uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        pass

    def uuid(self) -> str:
        return self._uuid


def test_custom_passes_enter_the_key_by_uuid():
    gm = dynamo_graph(piece_fn, X)
    keys = {"none": compile_cache.piece_key(gm)}
    for hook in ("post_grad_custom_post_pass", "post_grad_custom_pre_pass", "joint_custom_pre_pass"):
        for uuid in ("a", "b"):
            with torch._inductor.config.patch({hook: _Pass(uuid)}):
                keys[hook, uuid] = compile_cache.piece_key(gm)
                assert compile_cache.piece_key(gm) == keys[hook, uuid]  # another object, same uuid: same key
    assert len(set(keys.values())) == len(keys)



def test_every_pass_of_a_list_enters_the_key():
    gm = dynamo_graph(piece_fn, X)
    keys = {}
    for passes in (["a"], ["a", "b"], ["b", "a"]):
        with torch._inductor.config.patch({"post_grad_custom_post_pass": [_Pass(u) for u in passes]}):
            keys[tuple(passes)] = compile_cache.piece_key(gm)
    with torch._inductor.config.patch({"post_grad_custom_post_pass": _Pass("a")}):
        assert compile_cache.piece_key(gm) == keys["a",]  # one pass, alone or in a list: the same passes run
    assert len(set(keys.values())) == len(keys)

def test_compile_time_state_enters_the_key():
    gm = dynamo_graph(piece_fn, X)
    plain = compile_cache.piece_key(gm)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = compile_cache.piece_key(gm)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        float64 = compile_cache.piece_key(gm)
    finally:
        torch.set_default_dtype(saved)
    assert len({plain, autocast, float64}) == 3
    assert compile_cache.piece_key(gm) == plain


class _Gain:
    def __init__(self, value: float):
        self.value = value

    def __rmul__(self, t: torch.Tensor) -> torch.Tensor:
        return t * self.value


def _scaler(k):
    def scale(t):
        return t * k

    return torch.compiler.allow_in_graph(scale)


def test_functions_called_by_the_graph_are_keyed_by_their_code_and_cells():
    twice, thrice, twice_again = _scaler(2.0), _scaler(3.0), _scaler(2.0)
    key = compile_cache.piece_key
    assert key(dynamo_graph(lambda x: twice(x) + 1, X)) != key(dynamo_graph(lambda x: thrice(x) + 1, X))
    assert key(dynamo_graph(lambda x: twice(x) + 1, X)) == key(dynamo_graph(lambda x: twice_again(x) + 1, X))
    opaque = _scaler(_Gain(2.0))  # a cell holding an object the key cannot name across processes
    with pytest.raises(Uncacheable, match="_Gain"):
        key(dynamo_graph(lambda x: opaque(x) + 1, X))


_lib = torch.library.Library("pb_keytest", "DEF")
_lib.define("triple(Tensor x) -> Tensor")
_lib.impl("triple", lambda x: x * 3, "CompositeImplicitAutograd")  # Python inlined into every piece calling it


def test_python_kernel_inlined_into_the_piece_is_not_cached():
    gm = dynamo_graph(lambda x: torch.ops.pb_keytest.triple(x) + 1, X)
    with pytest.raises(Uncacheable, match="pb_keytest::triple.*CompositeImplicitAutograd.*Python"):
        compile_cache.piece_key(gm)


def _decomposed_op(name: str, factor):
    """A custom op whose body AOTAutograd inlines (as torch.library.triton_op does): a rule for
    FunctionalTensorMode, a closure over ``factor``."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    @torch.library.custom_op(f"pb_keytest::{name}", mutates_args=())
    def op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    op.register_fake(lambda x: torch.empty_like(x))

    def inline(mode, func, types, args, kwargs):
        with mode:
            return args[0] * factor

    op.register_torch_dispatch(FunctionalTensorMode, inline)
    return op


def test_inlined_rules_of_custom_ops_are_keyed_by_their_code():
    two, opaque = _decomposed_op("by2", 2.0), _decomposed_op("byg", _Gain(2.0))
    key = compile_cache.piece_key
    graph = dynamo_graph(lambda x: two(x) + 1, X)
    before = key(graph)
    _decomposed_op("by2", 5.0)  # the op redefined with another body: the same graph is other code now
    assert key(graph) != before
    with pytest.raises(Uncacheable, match="_Gain"):
        key(dynamo_graph(lambda x: opaque(x) + 1, X))


def test_pass_without_uuid_is_compiled_not_cached(tmp_path, caplog):
    with torch._inductor.config.patch(post_grad_custom_post_pass=lambda graph: None):
        with pytest.raises(Uncacheable, match="post_grad_custom_post_pass.*uuid"):
            compile_cache.piece_key(dynamo_graph(piece_fn, X))
        with caplog.at_level(logging.WARNING, logger="piecewise_backend"):
            with pb.expect(compiles=1, cache_saves=0, cache_loads=0):
                assert torch.equal(compiled_piece_fn(tmp_path)(X), piece_fn(X))
    assert "not cached" in caplog.text and "post_grad_custom_post_pass" in caplog.text
    assert entries(tmp_path) == []


# --- trust: entries are pickles, so only this user may be able to write them ---


@pytest.fixture
def untrusting(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


def test_cache_dir_others_can_write_is_refused(tmp_path, monkeypatch, untrusting):
    shared = tmp_path / "shared"
    shared.mkdir()
    for mode, who in ((0o777, "group and others"), (0o775, "its group"), (0o757, "others")):
        os.chmod(shared, mode)
        with pytest.raises(UntrustedPathError, match=f"{shared}.*writable by {who}.*{TRUST_ENV}=1"):
            pb.make_backend(pb.CompilationConfig(cache_dir=shared))
    os.chmod(shared, 0o777)  # anyone could rename ours away and put theirs in its place
    with pytest.raises(UntrustedPathError, match=f"through {shared}"):
        pb.make_backend(pb.CompilationConfig(cache_dir=shared / "mine"))
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot touch what they do not own
    pb.make_backend(pb.CompilationConfig(cache_dir=shared / "mine"))
    os.chmod(shared, 0o777)
    monkeypatch.setenv(TRUST_ENV, "1")  # the explicit opt-in
    pb.make_backend(pb.CompilationConfig(cache_dir=shared))


def test_cache_dir_reached_through_a_symlink_others_can_swap_is_refused(tmp_path, untrusting):
    """The path as given counts, not only where it resolves: a symlink in a directory anyone can
    write (not sticky) can be pointed elsewhere at any time, so the private directory it names now
    proves nothing."""
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    (shared / "link").symlink_to(private)
    os.chmod(shared, 0o777)
    try:
        with pytest.raises(UntrustedPathError, match=f"cache_dir '{shared / 'link'}' \\(through {shared}\\): {shared} is "
                                                     "writable by group and others"):
            pb.make_backend(pb.CompilationConfig(cache_dir=shared / "link"))
        (tmp_path / "hop").symlink_to(shared / "link")  # a trusted link to the swappable one: refused too
        with pytest.raises(UntrustedPathError, match=f"through {shared}"):
            pb.make_backend(pb.CompilationConfig(cache_dir=tmp_path / "hop"))
        with pytest.raises(UntrustedPathError, match=f"through {shared}"):  # the same for a relative link
            (tmp_path / "rel").symlink_to("shared/link")
            pb.make_backend(pb.CompilationConfig(cache_dir=tmp_path / "rel"))
        os.chmod(shared, 0o1777)  # sticky: only the link's owner (this user) may replace it
        pb.make_backend(pb.CompilationConfig(cache_dir=shared / "link"))
    finally:
        os.chmod(shared, 0o700)


def test_cache_dir_created_later_by_someone_else_is_checked_when_written(saved, tmp_path, untrusting):
    """A cache_dir that does not exist when the backend is made is checked again when it is first
    created or written, and before the first load from it."""
    (entry,) = entries(saved)
    artifact = compile_cache.PieceCache(saved).load(entry.stem)
    later = tmp_path / "later"
    cache = compile_cache.PieceCache(later)  # nothing there yet: nothing to refuse
    later.mkdir()
    os.chmod(later, 0o777)  # made by another user before this process writes
    try:
        with pytest.raises(UntrustedPathError, match=f"cache_dir '{later}': {later} is writable by group and others"):
            cache.save(entry.stem, artifact)
        assert not (later / "pieces").exists()  # nothing written into it
        with pytest.raises(UntrustedPathError, match=f"{later} is writable by group and others"):
            cache.load(entry.stem)
    finally:
        os.chmod(later, 0o700)
    assert cache.save(entry.stem, artifact) and cache.load(entry.stem) is not None


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another uid needs root")
def test_cache_dir_of_another_user_is_refused(tmp_path, untrusting):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 12345, -1)
    with pytest.raises(UntrustedPathError, match="owned by uid 12345"):
        pb.make_backend(pb.CompilationConfig(cache_dir=theirs))


def test_entry_others_can_write_is_refused(saved, tmp_path, untrusting):
    cache_dir = _copy(saved, tmp_path)
    (entry,) = entries(cache_dir)
    os.chmod(entry, 0o666)
    with pytest.raises(UntrustedPathError, match="compile cache entry.*writable by group and others"):
        compile_cache.PieceCache(cache_dir).load(entry.stem)


def test_home_is_expanded_and_new_directories_are_private(saved, tmp_path, monkeypatch, untrusting):
    (entry,) = entries(saved)
    artifact = compile_cache.PieceCache(saved).load(entry.stem)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert compile_cache.PieceCache("~/cache").save(entry.stem, artifact)
    assert not (tmp_path / "~").exists()
    created = tmp_path / "cache" / "pieces" / entry.name
    assert created.exists()
    modes = [created.parent.parent.stat().st_mode, created.parent.stat().st_mode, created.stat().st_mode]
    assert [m & 0o777 for m in modes] == [0o700, 0o700, 0o600]


# --- restart in a fresh process: cache_dir and the AOT file ---

CHILD = r"""
import json, sys, torch
import piecewise_backend as pb
import piecewise_backend.backend.cache
from piecewise_backend.toy_llama import make_model
torch.set_num_threads(1)
cache_dir, aot_path, dims = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
model = make_model(3, "inplace", **dims)
with torch.inference_mode():
    ids = torch.arange(5) % dims["vocab_size"]
    compiled = torch.compile(model, backend=pb.make_backend(pb.CompilationConfig(cache_dir=cache_dir)))
    cached = compiled(pb.mark_token_dim(ids.clone())).tolist()
    cache_counters = dict(pb.counters)
    pb.reset_counters()
    frames = torch._dynamo.utils.counters["frames"]["total"]
    loaded = pb.load_compiled(aot_path, model)
    aot = loaded(ids).tolist()
    aot_one = loaded(ids[:1]).tolist()
    aot_frames = torch._dynamo.utils.counters["frames"]["total"] - frames
def cond_model(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,)) + 1
graphs = []
torch.compile(cond_model, backend=lambda gm, example_inputs: graphs.append(gm) or gm.forward)(torch.ones(4))
cond_key = pb.backend.cache.piece_key(graphs[0])
print(json.dumps(dict(cache=cached, cache_counters=cache_counters, aot=aot, aot_one=aot_one,
                      aot_counters=dict(pb.counters), aot_frames=aot_frames, cond_key=cond_key)))
"""


def cond_model(x):
    return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,)) + 1


@pytest.fixture(scope="module")
def restart(tmp_path_factory) -> dict:
    """Compile a 3-layer toy with cache_dir and save it with aot_compile here; load both in a child."""
    tmp = tmp_path_factory.mktemp("restart")
    cache_dir, aot_path = tmp / "cache", tmp / "model.pb"
    torch._dynamo.reset()
    model = tiny_llama(3)
    with torch.inference_mode():  # inputs made outside would differ in dispatch keys: a second graph
        ids = torch.arange(5) % TINY_LLAMA["vocab_size"]
        compiled = torch.compile(model, backend=pb.make_backend(pb.CompilationConfig(cache_dir=cache_dir)))
        with pb.expect(graphs=1, compiled_pieces=4, compiles=3, cache_saves=3):
            here = compiled(pb.mark_token_dim(ids.clone()))
            compiled(ids[:1])  # T=1: the same Dynamo graph, nothing compiles
        with pb.expect(compiles=0, cache_loads=3):  # the AOT path reuses cache_dir's pieces too
            pb.aot_compile(model, [pb.mark_token_dim(ids.clone())], config=pb.CompilationConfig(cache_dir=cache_dir),
                           path=aot_path)
        reference, one = model(ids), model(ids[:1])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), str(aot_path), json.dumps(TINY_LLAMA)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return dict(out, here=here, reference=reference, one=one)


def test_fresh_process_loads_pieces_from_cache_dir(restart):
    c = restart["cache_counters"]
    assert c.get("cache_loads") == 3 and c.get("compiles", 0) == 0 and c.get("cache_rejects", 0) == 0
    assert torch.equal(torch.tensor(restart["cache"]), restart["here"])
    torch.testing.assert_close(torch.tensor(restart["cache"]), restart["reference"])


def test_fresh_process_loads_aot_file_without_dynamo(restart):
    assert restart["aot_frames"] == 0  # Dynamo traced nothing
    c = restart["aot_counters"]
    assert c.get("cache_loads") == 4 and c.get("compiles", 0) == 0 and c.get("graphs", 0) == 0
    assert torch.equal(torch.tensor(restart["aot"]), restart["here"])
    torch.testing.assert_close(torch.tensor(restart["aot_one"]), restart["one"])


def test_higher_order_op_pieces_have_the_same_key_in_a_fresh_process(restart):
    # the cond op's repr carries a memory address: a key holding it would never match after a restart
    assert compile_cache.piece_key(dynamo_graph(cond_model, torch.ones(4))) == restart["cond_key"]
