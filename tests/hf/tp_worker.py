"""One rank of tests/hf/test_tensor_parallel.py (run by torchrun): HFEngine over a tp_plan="auto" load of a
save_pretrained folder, checked against the unsharded model's greedy generate; each rank writes its JSON lines
to a file."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist

import piecewise_backend as pb
from piecewise_backend import hf
from piecewise_backend.platforms.simulated import collectives

REPLAYS = [0]
_replay = collectives.CollectiveOp.replay


def counted_replay(self: collectives.CollectiveOp) -> None:
    REPLAYS[0] += 1
    _replay(self)


collectives.CollectiveOp.replay = counted_replay  # counts the collectives the graphs replay

PROMPTS = [list(range(10, 13)), list(range(40, 47)), [77]]
#: the config's compile_pieces ("none": tests/hf/test_hf_no_dynamo.py serves the ranks without Dynamo)
PIECES = os.environ.get("PB_TP_COMPILE_PIECES", "eager")
NEW = [5, 3, 6]


def serve(folder: str) -> dict:
    transformers = hf.adapter.transformers_module()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    expected = []
    with torch.no_grad():
        for prompt, new in zip(PROMPTS, NEW):
            ids = torch.tensor([prompt])
            out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new,
                                     eos_token_id=None, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
    config = pb.CompilationConfig(platform="simulated", compile_pieces=PIECES, capture_sizes=[2, 4])
    with warnings.catch_warnings(record=True) as caught:  # transformers 5.24 deprecates a tp_plan= keyword
        warnings.simplefilter("always")
        engine = hf.HFEngine.from_pretrained(folder, config, tp_plan="auto", max_num_reqs=3, max_model_len=32, block_size=4)
    engine.capture()
    modes = []

    def on_step(info: hf.StepInfo) -> None:  # called after the step ran: the collectives its graph replayed
        modes.append((info.mode.name, bool(info.uniform_decode), REPLAYS[0]))
        REPLAYS[0] = 0

    REPLAYS[0] = 0
    greedy = engine.generate(PROMPTS, NEW, eos_token_id=None, on_step=on_step)
    sampled = engine.generate(PROMPTS, NEW, eos_token_id=None,
                              sampling=hf.SamplingParams(temperature=0.9, top_k=20, seed=7))
    torch.manual_seed(dist.get_rank())  # the ranks' generators differ: a seedless request takes rank 0's draw
    unseeded = engine.generate(PROMPTS, NEW, eos_token_id=None, sampling=hf.SamplingParams(temperature=0.9))
    cache = engine.cache
    result = {
        "rank": dist.get_rank(), "greedy": greedy, "expected": expected, "sampled": sampled, "unseeded": unseeded,
        "full_decode": sum(1 for m, d, _ in modes if m == "FULL" and d), "steps": len(modes),
        "piecewise": sum(1 for m, _, _ in modes if m == "PIECEWISE"),
        "full_collectives": sorted({c for m, d, c in modes if m == "FULL"}),
        "layers": reference.config.num_hidden_layers, "kv_heads": cache.key_caches[0].shape[2],
        "model_kv_heads": reference.config.num_key_value_heads, "memory_bytes": cache.memory_bytes,
        "tp_plan_warnings": [str(w.message) for w in caught if "tp_plan" in str(w.message)],
    }
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, result)
    result["peers_same"] = all(r["greedy"] == greedy and r["sampled"] == sampled and r["unseeded"] == unseeded
                               for r in everyone)
    return result


def disagree(folder: str) -> str:
    """The error HFEngine raises on every rank when the ranks pass different max_num_reqs."""
    transformers = hf.adapter.transformers_module()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
    config = pb.CompilationConfig(platform="simulated", compile_pieces=PIECES, capture_sizes=[2, 4])
    try:
        hf.HFEngine(model, config, max_num_reqs=3 + dist.get_rank(), max_model_len=32, block_size=4)
    except ValueError as e:
        return str(e)
    return "no error"


def refused_lazy(folder: str) -> str:
    """The error a tensor-parallel HFEngine with lazy_capture=True raises (before it changes the model)."""
    config = pb.CompilationConfig(platform="simulated", compile_pieces=PIECES, capture_sizes=[2, 4])
    try:
        hf.HFEngine.from_pretrained(folder, config, tp_plan="auto", lazy_capture=True, max_model_len=32)
    except ValueError as e:
        return str(e)
    return "no error"


def main(out: str, folders: list[str]) -> int:
    """Each rank writes its lines to ``out/rank<r>.txt`` (two ranks printing to one pipe can interleave)."""
    lines = [f"RESULT {json.dumps(serve(folder))}" for folder in folders]
    lines += [f"DISAGREE {json.dumps(disagree(folders[0]))}", f"LAZY {json.dumps(refused_lazy(folders[0]))}"]
    with open(f"{out}/rank{dist.get_rank()}.txt", "w") as f:
        f.write("\n".join(lines) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
