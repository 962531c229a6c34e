"""Greedy generation with a stock Hugging Face model on GraphRunner and a paged KV cache.

Builds a tiny random-weight model of transformers model type NAME (nothing downloaded), serves
prompts of different lengths that finish at different steps (steps with prompt tokens replay
PIECEWISE graphs, pure decode steps one FULL graph), and with --check compares every request's
tokens with ``model.generate(do_sample=False)`` (a differing token passes only if it ties the
reference's best logit within LOGIT_TOL given the same prefix; see ``check``); where the model's own
generate raises, with greedy decoding by a full recompute of its forward (``reference_tokens``).
It prints how many Dynamo graphs the engine compiled (``dynamo graphs: N``; more than one names the
first graph break). Exit status: 0 served (and checked), 2 refused up front with the reason, 1 wrong tokens or a crash.
Without CUDA it runs on the simulated graph platform and says so.

``--lazy`` serves before capturing (``lazy_capture=True``: the first steps run eagerly), then captures
what that traffic asked for (``capture_idle``) and serves the same prompts again on graphs (with
``--check`` both runs are checked). ``--sample`` also samples the prompts twice with one seed (temperature 0.8, top-k 50, top-p
0.95): both draws must agree. ``--stream`` prints each token as it is produced. ``--check`` always
compares the greedy run with ``generate``.

``--tp`` serves it tensor-parallel (started by torchrun; on by itself there): every rank saves the same seeded
model with ``save_pretrained``, loads it with ``HFEngine.from_pretrained(path, config, tp_plan="auto")`` (its
shard of the weights, collectives inside the graphs) and checks against the unsharded model; rank 0 prints.

Run: python examples/hf_generate.py --arch llama --check [--lazy] [--sample] [--stream]
     python -m torch.distributed.run --standalone --nproc-per-node 2 examples/hf_generate.py --arch llama --tp --check
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence

import torch

import piecewise_backend as pb
from piecewise_backend.hf import HFEngine, SamplingParams, StepInfo, tiny_random_model
from piecewise_backend.hf.engine import UNAPPLIED
from piecewise_backend.parallel import init_tensor_parallel

PROMPT_LENS = (5, 12, 3, 9, 7)
NEW_TOKENS = (6, 3, 9, 4, 7)  # per request: they finish at different steps
#: generation_config settings no engine applies (it warns naming them), off in the reference too.
UNAPPLIED_OFF = {name: off for name, off in UNAPPLIED.items() if name != "do_sample"}
#: The per-token settings (bart's forced EOS, marian's banned pad, ...): HFEngine applies them as generate
#: does; off in the reference of an engine that does not (SpecEngine: ``check(..., rules_applied=False)``).
RULES_OFF = dict(forced_bos_token_id=None, forced_eos_token_id=None, bad_words_ids=None, suppress_tokens=None,
                 begin_suppress_tokens=None, min_length=0, min_new_tokens=None, no_repeat_ngram_size=0,
                 repetition_penalty=1.0)
#: A token whose reference logit is within this of the best is a tie (float32 logits, float order differs).
LOGIT_TOL = 1e-3


def check(
    reference: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]], new_tokens: Sequence[int],
    eos: int | list[int] | None, ties: list[int] | None = None, rules_applied: bool = True,
) -> list[int]:
    """Indices of the requests the engine served wrongly, compared with ``reference``.

    ``eos`` is what the engine was given: an int or a list of stop tokens, or None for the model's
    own (``generation_config.eos_token_id``), which ``generate`` then uses too; ``rules_applied``: whether
    the engine applies the model's per-token settings (:data:`RULES_OFF` are off in the reference otherwise).

    A request passes if its tokens equal ``reference.generate(do_sample=False)``, or if every token
    the engine picked is within ``LOGIT_TOL`` of the reference's best logit given the engine's own
    prefix (teacher forcing): the two differ only where the reference's top logits tie within the
    tolerance, so a different order of float operations may pick either. A token below the best by
    more than the tolerance is wrong. Where the reference's forward has a clear margin at the first
    difference, generate (its cached path) left the model's own forward: said so and accepted, as the
    engine equals that forward. Requests accepted either way are appended to ``ties``.
    """
    bad = []
    device = next(reference.parameters()).device
    for i, (prompt, out) in enumerate(zip(prompts, outputs)):
        expected = reference_tokens(reference, prompt, new_tokens[i], eos, rules_applied)
        if out == expected:
            continue
        with torch.no_grad():  # the reference's logits at every engine token, given the engine's prefix
            cache = {"use_cache": False} if RECOMPUTED else {}  # a generate that raised: its forward would build the same cache
            logits = reference(torch.tensor([prompt + out], device=device), **cache).logits[0, len(prompt) - 1 : -1].float()
        picked = logits.gather(1, torch.tensor(out, device=device)[:, None])[:, 0]
        short = logits.max(-1).values - picked
        if len(out) == len(expected) and short.max().item() <= LOGIT_TOL:
            first = next(j for j, (a, b) in enumerate(zip(out, expected)) if a != b)
            top2 = logits[first].topk(2).values
            if (top2[0] - top2[1]).item() > LOGIT_TOL:  # no tie where they part: generate left the forward
                print(f"FORWARD request {i}: engine {out} != generate {expected}; at token {first} the model's own "
                      f"forward over the same tokens picks the engine's token by {(top2[0] - top2[1]).item():.3g}: "
                      "generate's cached path disagrees with the model's forward (accepted)")
            else:
                print(f"TIE request {i}: engine {out} != generate {expected}; each engine token is within "
                      f"{short.max().item():.1e} <= {LOGIT_TOL} of the reference's best logit (accepted)")
            if ties is not None:
                ties.append(i)
            continue
        bad.append(i)
        where = int((short > LOGIT_TOL).nonzero()[0]) if (short > LOGIT_TOL).any() else len(out)
        print(f"MISMATCH request {i}: engine {out} != generate {expected} "
              f"(token {where}: {short[where].item() if where < len(out) else float('nan'):.3g} below the best logit)")
    return bad


#: Why generate could not be the reference (None: it was): then every request is compared with a full recompute.
RECOMPUTED: list[str] = []


def reference_tokens(
    reference: torch.nn.Module, prompt: list[int], new_tokens: int, eos: int | list[int] | None, rules_applied: bool = True,
) -> list[int]:
    """``reference.generate(do_sample=False)``'s new tokens, or, where generate itself raises (transformers 5.24's
    recurrent_gemma without an attention layer: its cache's ``get_seq_length`` refuses a cache of recurrent layers
    only), greedy decoding by a full recompute: the model's own forward over the whole sequence, without a cache,
    for every token. Says so once and notes it in :data:`RECOMPUTED`."""
    device = next(reference.parameters()).device
    ids = torch.tensor([prompt], device=device)
    stop = {} if eos is None else {"eos_token_id": eos}  # generate without it: the model's generation_config
    pad = eos if isinstance(eos, int) else reference.generation_config.pad_token_id
    try:
        with torch.no_grad():
            full = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new_tokens, pad_token_id=pad, **stop, **UNAPPLIED_OFF,
                                      **({} if rules_applied else RULES_OFF))
        return full[0, len(prompt):].tolist()
    except Exception as e:  # noqa: BLE001  (the reference's own generate, whatever it raises: its forward judges instead)
        if not RECOMPUTED:
            print(f"REFERENCE: {type(reference).__name__}.generate raised {type(e).__name__}: {e}; "
                  "every request is compared with a full recompute (the model's forward without a cache, per token)")
        RECOMPUTED.append(f"{type(e).__name__}")
    stops = set(eos if isinstance(eos, list) else [eos] if eos is not None else _eos_ids(reference))
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            seq.append(int(reference(torch.tensor([seq], device=device), use_cache=False).logits[0, -1].argmax()))
            if seq[-1] in stops:
                break
    return seq[len(prompt):]


def _eos_ids(model: torch.nn.Module) -> list[int]:
    eos = model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llama", help="transformers model type (llama, qwen2, mistral, ...)")
    parser.add_argument("--check", action="store_true", help="compare with model.generate(do_sample=False)")
    parser.add_argument("--lazy", action="store_true", help="serve before capturing, then capture_idle and serve again")
    parser.add_argument("--sample", action="store_true", help="also sample (seeded) twice and compare the draws")
    parser.add_argument("--stream", action="store_true", help="print each token as it is produced")
    parser.add_argument("--compile-pieces", choices=("inductor", "eager"),
                        help="how pieces are compiled (default: inductor on CUDA, eager on the simulator)")
    parser.add_argument("--tp", action="store_true",
                        help="tensor parallel over torchrun's ranks (tp_plan='auto'; on by itself under torchrun)")
    args = parser.parse_args(argv)
    if args.tp or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return tensor_parallel(args, parser)
    return serve(args, parser)


def tensor_parallel(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``serve`` on every rank of torchrun's group over a ``tp_plan="auto"`` load; rank 0 prints."""
    import torch.distributed as dist

    if "WORLD_SIZE" not in os.environ:
        parser.error("--tp runs under torchrun: python -m torch.distributed.run --standalone --nproc-per-node 2 "
                     "examples/hf_generate.py --tp ...")
    init_tensor_parallel()
    rank = dist.get_rank()
    quiet = open(os.devnull, "w") if rank else None
    folder = [tempfile.mkdtemp(prefix="hf_generate_tp_") if rank == 0 else None]
    dist.broadcast_object_list(folder)  # one folder on this machine: save_pretrained writes on rank 0 only
    try:
        with contextlib.redirect_stdout(quiet) if quiet else contextlib.nullcontext():
            try:
                if rank == 0:
                    tiny_random_model(args.arch).save_pretrained(folder[0])
                dist.barrier()
            except ValueError as e:
                parser.error(str(e))
            status = serve(args, parser, folder[0])
        failed: list = [None] * dist.get_world_size()
        dist.all_gather_object(failed, status)
        dist.barrier()  # no rank tears gloo down (or removes the folder) while a peer still runs
        return max(failed)
    finally:
        if quiet:
            quiet.close()
        if rank == 0:
            shutil.rmtree(folder[0], ignore_errors=True)
        dist.destroy_process_group()


def serve(args: argparse.Namespace, parser: argparse.ArgumentParser, folder: str | None = None) -> int:
    """Serve the prompts (from a tp_plan load of ``folder`` when given) and check them; the exit status."""

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = pb.CompilationConfig(
        cudagraph_mode="FULL_AND_PIECEWISE",
        capture_sizes=[2, 4, 8, 16, 32],  # no size 1: Dynamo would specialize and trace the model a second time
        platform="cuda" if cuda else "simulated",
        # the simulator records ATen ops, not fused kernels
        compile_pieces=args.compile_pieces or ("inductor" if cuda else "eager"),
    )
    print(f"arch: {args.arch}, platform: {config.platform}" + ("" if cuda else " (no CUDA device: simulated on the CPU)"))

    try:
        model = tiny_random_model(args.arch, device=device)
    except ValueError as e:
        parser.error(str(e))
    reference = copy.deepcopy(model) if args.check else None  # keeps HF's own SDPA attention
    # step_capture_budget_s=0: only capture_idle captures (a lazy engine otherwise catches up inside steps)
    options = dict(max_num_reqs=4, max_model_len=64, block_size=8, lazy_capture=args.lazy, step_capture_budget_s=0)
    try:
        if folder is None:
            engine = HFEngine(model, config, **options)
        else:  # this rank's shard of the saved weights
            engine = HFEngine.from_pretrained(folder, config, tp_plan="auto", **options)
            print(f"tensor parallel: {engine.model.pb_tp_size} ranks, this rank's cache holds "
                  f"{engine.cache.key_caches[0].shape[2]} of {model.config.num_key_value_heads} KV heads")
    except ValueError as e:  # an architecture the paged attention cannot serve, and why
        parser.error(str(e))
    if not args.lazy:
        report = engine.capture()
        print(f"captured {report.graphs} graphs in {report.seconds:.2f} s ({report.stats})")

    gen = torch.Generator().manual_seed(1)
    text = model.config.get_text_config()  # a multimodal model's language part
    prompts = [torch.randint(3, text.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    eos = None  # the model's generation_config.eos_token_id (an int or a list), for the engine and generate alike

    def show(info: StepInfo) -> None:
        kind = "decode" if info.uniform_decode else "mixed "
        print(f"step {info.step:2d}: {info.num_tokens:2d} tokens, {info.num_reqs} reqs, {kind} -> {info.mode.name}")

    def stream(request: int, token: int) -> None:
        print(f"  token: request {request} -> {token}")

    on_token = stream if args.stream else None
    outputs = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, on_step=show, on_token=on_token)
    for i, out in enumerate(outputs):
        print(f"request {i}: prompt {len(prompts[i]):2d} tokens -> {out}")
    failed = 0
    if args.lazy:
        captured = engine.capture_idle(max_seconds=120.0)
        print(f"capture_idle: {len(captured)} graphs captured: "
              + ", ".join(f"{mode.name} {desc.num_tokens}" for mode, desc in captured))
        again = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, on_step=show)
        # eager and captured attention may round differently (a near-tie can flip): --check judges both runs
        print(f"lazy: the run on graphs {'equals' if again == outputs else 'differs from'} the run before capture")
        if args.check:
            failed += len(check(reference, prompts, again, NEW_TOKENS, eos))
    if args.sample:
        params = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=0)
        drawn = [engine.generate(prompts, NEW_TOKENS, eos_token_id=eos, sampling=params, on_token=on_token) for _ in range(2)]
        for i, out in enumerate(drawn[0]):
            print(f"sampled {i}: {out}")
        same = drawn[0] == drawn[1]
        failed += not same
        print(f"sample: seed 0 drew {'the same' if same else 'DIFFERENT'} tokens twice")
    splits = engine.backend.splits  # one per graph Dynamo compiled: more than one means a graph break (or a recompile)
    cut = next((s.graph_break for s in splits if s.graph_break is not None), None)
    print(f"dynamo graphs: {len(splits)}" + (f"; first graph break: {cut}" if cut else ""))
    if not args.check:
        return 1 if failed else 0
    ties: list[int] = []
    bad = len(check(reference, prompts, outputs, NEW_TOKENS, eos, ties))
    tied = f" ({len(ties)} of them only within {LOGIT_TOL} of the forward's best logit: see TIE/FORWARD)" if ties else ""
    against = "a full recompute (generate raised)" if RECOMPUTED else "model.generate"
    print(f"check: {len(prompts) - bad}/{len(prompts)} requests match {against}{tied}")
    return 1 if bad or failed else 0


if __name__ == "__main__":
    sys.exit(main())
