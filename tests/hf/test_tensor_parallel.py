"""HFEngine over a ``from_pretrained(path, tp_plan="auto")`` load on 2 gloo ranks (torchrun, simulated platform):
tokens equal the unsharded model's greedy generate, FULL decode graphs replay the collectives, each rank's
cache holds its share of the KV heads; the refusals (heads, no process group, ranks given different arguments)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import piecewise_backend as pb

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers' tp_plan loading needs it
from piecewise_backend import hf
from piecewise_backend.hf import tensor_parallel

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONFIG = pb.CompilationConfig(platform="simulated", compile_pieces="eager", capture_sizes=[2, 4])
#: 4 attention heads each; 2 KV heads (split) or 1 (multi-query: replicated, fewer KV heads than ranks)
MODELS = {"llama": ("llama", {}), "qwen3_moe": ("qwen3_moe", {}), "llama_mqa": ("llama", {"num_key_value_heads": 1})}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[dict[str, list[dict]], list[str]]:
    folders, out = {}, tmp_path_factory.mktemp("ranks")
    for name, (arch, sizes) in MODELS.items():
        folders[name] = tmp_path_factory.mktemp(name)
        hf.tiny_random_model(arch, **sizes).save_pretrained(folders[name])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(HERE / "tp_worker.py"), str(out), *(str(f) for f in folders.values())]
    # a hang fails after the timeout
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    lines = [(rank, line) for rank in range(2) for line in (out / f"rank{rank}.txt").read_text().splitlines()]

    def kind(what: str) -> list:  # rank 0's lines first, then rank 1's
        return [json.loads(line.split(" ", 1)[1]) for _, line in lines if line.startswith(what + " ")]
    results, errors = kind("RESULT"), kind("DISAGREE") + kind("LAZY")
    by_arch = {arch: results[i::len(folders)] for i, arch in enumerate(folders)}
    assert all(len(r) == 2 for r in by_arch.values()), proc.stdout
    return by_arch, errors


@pytest.mark.parametrize("arch", list(MODELS))
def test_two_ranks_serve_the_unsharded_models_tokens(ranks, arch):
    for r in ranks[0][arch]:
        assert r["greedy"] == r["expected"], r
        assert r["peers_same"], r  # greedy and seeded sampling: every rank drew the same tokens
        assert r["full_decode"] >= 4, r  # pure decode steps replayed FULL graphs
        if tensor_parallel.distributed_config_class() is not None:  # the plan went in a DistributedConfig
            assert r["tp_plan_warnings"] == [], r
        # every FULL replay ran the collectives inside the graph: embedding + 2 per layer + lm_head gather
        assert r["full_collectives"] == [2 * r["layers"] + 2], r
        assert r["kv_heads"] == max(1, r["model_kv_heads"] // 2), r  # this rank's share of the KV heads (or its one)
        assert r["memory_bytes"] == 25600, r  # per rank: 1 KV head x 2 layers x K and V (the unsharded llama: twice)


def test_ranks_given_different_arguments_are_refused(ranks):
    errors = ranks[1][:2]
    assert len(errors) == 2, ranks[1]
    assert all("max_num_reqs (rank 0: 3, rank 1: 4)" in e for e in errors), errors


def test_lazy_capture_is_refused_with_the_reason(ranks):
    lazy = ranks[1][2:]
    assert len(lazy) == 2 and all("lazy_capture=True is refused" in e for e in lazy), lazy


def test_tp_plan_without_a_process_group_is_refused(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hf.tiny_random_model("llama").config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no process group is initialized.*torchrun"):
        hf.HFEngine.from_pretrained(tmp_path, CONFIG, tp_plan="auto")


class _Loaded(Exception):
    """Raised by the patched AutoModelForCausalLM.from_pretrained: the keywords it got, and nothing loaded."""


@pytest.fixture
def load_kwargs(tmp_path, monkeypatch):
    """``load(**kwargs)``: the keywords HFEngine.from_pretrained hands transformers (no process group joined;
    ``overrides``: what ``_join_tensor_parallel`` says the K/V need)."""
    hf.tiny_random_model("llama").config.save_pretrained(tmp_path)
    overrides: dict[str, str] = {}
    monkeypatch.setattr(hf.engine, "_join_tensor_parallel", lambda folder: dict(overrides))

    def fake(folder, **kwargs):
        raise _Loaded(kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake)

    def load(extra: dict[str, str] | None = None, **kwargs) -> dict:
        overrides.clear()
        overrides.update(extra or {})
        with pytest.raises(_Loaded) as loaded:
            hf.HFEngine.from_pretrained(tmp_path, CONFIG, **kwargs)
        return loaded.value.args[0]
    return load


REPLICATED = {"model.layers.*.self_attn.k_proj": "replicate"}


def test_tp_plan_goes_to_transformers_in_a_distributed_config_where_it_takes_one(load_kwargs, monkeypatch):
    """transformers 5.24 deprecates from_pretrained(tp_plan=...) (a FutureWarning on every rank) for
    distributed_config=DistributedConfig(tp_plan=...); older versions get the keyword."""
    if tensor_parallel.distributed_config_class() is None:
        pytest.skip(f"transformers {transformers.__version__} has no DistributedConfig(tp_plan=...)")
    kwargs = load_kwargs(tp_plan="auto")
    assert "tp_plan" not in kwargs and kwargs["distributed_config"].tp_plan == "auto"
    assert load_kwargs(REPLICATED, tp_plan="auto")["distributed_config"].tp_plan == REPLICATED
    own = transformers.DistributedConfig(tp_plan="auto", fsdp_cpu_offload=True)  # the caller's own: kept, K/V overridden
    given = load_kwargs(REPLICATED, distributed_config=own)["distributed_config"]
    assert given.tp_plan == REPLICATED and given.fsdp_cpu_offload and own.tp_plan == "auto"
    with pytest.raises(ValueError, match="pass tp_plan= or distributed_config=DistributedConfig"):
        load_kwargs(tp_plan="auto", distributed_config=own)

    @dataclasses.dataclass
    class ExpertsOnly:  # transformers 4.5x's DistributedConfig: no tp_plan
        enable_expert_parallel: bool = False

    for old in (None, ExpertsOnly):
        # the module the package reads now: building a tiny model can replace sys.modules["transformers"]
        monkeypatch.setattr(tensor_parallel.transformers_module(), "DistributedConfig", old)
        kwargs = load_kwargs(REPLICATED, tp_plan="auto")
        assert kwargs["tp_plan"] == REPLICATED and "distributed_config" not in kwargs, (old, kwargs)


def test_a_world_size_that_does_not_divide_the_heads_is_refused():
    config = hf.tiny_random_model("llama").config  # 4 attention heads, 2 KV heads
    with pytest.raises(ValueError, match="4 attention heads do not divide by 3"):
        tensor_parallel.check_heads(config, 3)
    tensor_parallel.check_heads(config, 2)
    tensor_parallel.check_heads(config, 4)  # 2 KV heads, 4 ranks: replicated, each rank keeps the head its queries use
    mqa, three = copy.deepcopy(config), copy.deepcopy(config)
    mqa.num_key_value_heads = 1
    assert tensor_parallel.replicated_kv_plan(mqa, 2) == {
        "model.layers.*.self_attn.k_proj": "replicate", "model.layers.*.self_attn.v_proj": "replicate"}
    assert tensor_parallel.replicated_kv_plan(config, 2) == {}
    three.num_attention_heads, three.num_key_value_heads = 6, 3
    with pytest.raises(ValueError, match="3 KV heads neither divide by 2 nor divide it"):
        tensor_parallel.check_heads(three, 2)


def test_agreement_is_a_no_op_in_one_process():
    tensor_parallel.check_engine_agreement({"max_num_reqs": 3})
    assert not tensor_parallel.is_tensor_parallel(hf.tiny_random_model("llama"))
