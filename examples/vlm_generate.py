"""Greedy generation with a stock Hugging Face image-text-to-text model on GraphRunner and a paged KV cache.

Builds a tiny random-weight model of transformers model type NAME (``hf.tiny_random_vlm``: nothing
downloaded) and random pixel inputs of the shape it takes (``hf.random_mm_inputs``), then serves two
prompts together: one with the image's placeholder tokens (between the model's vision start / end tokens
where its config names them), one text-only; prefill is chunked (``max_num_batched_tokens`` below the image
prompt's length, so a chunk cuts through the image tokens). With --check it compares every request's
tokens with ``model.generate(do_sample=False)`` given the same ``mm_inputs`` (a differing token passes only
within LOGIT_TOL of the best logit of the model's own forward over the engine's tokens: a tie).
Exit status: 0 served (and checked), 2 refused up front with the reason or not built, 1 wrong tokens or a crash.
Without CUDA it runs on the simulated graph platform and says so.

Run: python examples/vlm_generate.py --arch llava --check [--images 2]
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys

import torch

import piecewise_backend as pb
from piecewise_backend.hf import HFEngine, random_mm_inputs, tiny_random_vlm

NEW_TOKENS = 6
MAX_MODEL_LEN = 160
#: A token whose reference logit is within this of the best is a tie (float32 logits, float order differs).
LOGIT_TOL = 1e-3
#: Config fields naming the token before / after an image's placeholder tokens (first one the config has).
START_TOKENS = ("vision_start_token_id", "image_start_token_id", "boi_token_id", "boi_token_index")
END_TOKENS = ("vision_end_token_id", "image_end_token_id", "eoi_token_id", "eoi_token_index")


def _token(config: object, names: tuple[str, ...]) -> list[int]:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return [value]
    return []


def prompts(model: torch.nn.Module, image_tokens: list[int], gen: torch.Generator) -> tuple[list[int], list[int]]:
    """An image prompt (text, then per image: start, its placeholder tokens, end; then text) and a text-only one;
    text tokens drawn below the special ids at the top of the vocabulary."""
    config = model.config
    image = next(getattr(config, n) for n in ("image_token_id", "image_token_index") if isinstance(getattr(config, n, None), int))
    vocab = config.get_text_config().vocab_size
    text = lambda n: torch.randint(3, vocab - 32, (n,), generator=gen).tolist()  # noqa: E731
    with_image = text(3)
    for n in image_tokens:
        with_image += _token(config, START_TOKENS) + [image] * n + _token(config, END_TOKENS)
    return with_image + text(2), text(7)


def reference_kwargs(model: torch.nn.Module, ids: torch.Tensor, mm: dict | None) -> dict:
    """What the model's own generate / forward needs besides ``mm``: ``mm_token_type_ids`` where it takes them."""
    kwargs = dict(mm or {})
    if mm and "mm_token_type_ids" in inspect.signature(model.forward).parameters:
        image = next(getattr(model.config, n) for n in ("image_token_id", "image_token_index")
                     if isinstance(getattr(model.config, n, None), int))
        kwargs["mm_token_type_ids"] = (ids == image).int()
    return kwargs


def check(reference: torch.nn.Module, prompt: list[int], mm: dict | None, out: list[int], i: int) -> bool:
    """Whether the engine's ``out`` for ``prompt`` equals ``reference.generate`` (or ties its forward's best logits)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS, **reference_kwargs(reference, ids, mm))
    expected = full[0, len(prompt):].tolist()
    if out == expected:
        return True
    seq = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = reference(seq, attention_mask=torch.ones_like(seq), use_cache=False,
                           **reference_kwargs(reference, seq, mm)).logits[0, len(prompt) - 1:-1].float()
    short = logits.max(-1).values - logits.gather(1, torch.tensor(out)[:, None])[:, 0]
    if len(out) == len(expected) and short.max().item() <= LOGIT_TOL:
        print(f"TIE request {i}: engine {out} != generate {expected}; each engine token is within "
              f"{short.max().item():.1e} of the forward's best logit (accepted)")
        return True
    where = int((short > LOGIT_TOL).nonzero()[0]) if (short > LOGIT_TOL).any() else len(out)
    print(f"MISMATCH request {i}: engine {out} != generate {expected} (token {where})")
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="llava", help="transformers image-text-to-text model type (llava, qwen2_vl, ...)")
    parser.add_argument("--check", action="store_true", help="compare with model.generate(do_sample=False)")
    parser.add_argument("--images", type=int, default=1, help="images in the image prompt")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    config = pb.CompilationConfig(platform="cuda" if cuda else "simulated", compile_pieces="inductor" if cuda else "eager",
                                  capture_sizes=[1, 2, 4, 8, 16])
    print(f"arch: {args.arch}, platform: {config.platform}" + ("" if cuda else " (no CUDA device: simulated on the CPU)"))
    try:
        model = tiny_random_vlm(args.arch, device=device)
    except ValueError as e:
        parser.error(str(e))
    model.generation_config.eos_token_id = None  # both run NEW_TOKENS tokens
    reference = copy.deepcopy(model) if args.check else None
    chunk = 8  # below the image prompt's length: a chunk cuts through its image tokens
    try:
        engine = HFEngine(model, config, max_num_reqs=2, max_model_len=MAX_MODEL_LEN, block_size=4,
                          max_num_batched_tokens=chunk)
    except ValueError as e:  # refused up front, with the reason
        parser.error(str(e))
    try:
        mm, count = random_mm_inputs(reference if reference is not None else model, images=args.images)
    except Exception as e:  # noqa: BLE001  (the model's own encoder refuses every shape tried)
        parser.error(f"tiny_random_vlm cannot build inputs for {args.arch!r}: {type(e).__name__}: {e}")
    if count + 16 > MAX_MODEL_LEN:
        parser.error(f"tiny_random_vlm cannot build inputs for {args.arch!r} short enough: {count} image tokens")
    per_image = [count // args.images] * args.images
    gen = torch.Generator().manual_seed(1)
    image_prompt, text_prompt = prompts(model, per_image, gen)
    print(f"mm_inputs: {', '.join(f'{k} {tuple(v.shape)}' for k, v in mm.items())} -> {count} image tokens; "
          f"prompts of {len(image_prompt)} and {len(text_prompt)} tokens")
    report = engine.capture()
    print(f"captured {report.graphs} graphs in {report.seconds:.2f} s; chunks of {chunk} tokens")
    try:
        outputs = engine.generate([image_prompt, text_prompt], NEW_TOKENS, mm_inputs=[mm, None], eos_token_id=[])
    except ValueError as e:  # its mm_inputs refused at add_request, with the reason
        parser.error(str(e))
    for i, out in enumerate(outputs):
        print(f"request {i}: -> {out}")
    if not args.check:
        return 0
    try:
        good = [check(reference, p, m, out, i) for i, (p, m, out) in enumerate(zip((image_prompt, text_prompt), (mm, None),
                                                                                 outputs))]
    except Exception as e:  # noqa: BLE001  (nothing to compare with: not a served type)
        parser.error(f"tiny_random_vlm's {args.arch!r} model cannot be checked: its own generate fails "
                     f"({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    print(f"check: {sum(good)}/2 requests match model.generate ({count} image tokens, chunks of {chunk})")
    return 0 if all(good) else 1


if __name__ == "__main__":
    sys.exit(main())
