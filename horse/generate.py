"""Sample text from a trained checkpoint: top-k / temperature sampling with a KV cache.

    python -m horse.generate --ckpt runs/tiny-... --prompt "ROMEO:" [--max-new-tokens 300]
                             [--temperature 0.8] [--top-k 40] [--num-samples 1] [--seed 0]

--ckpt is a checkpoint directory, a run's output directory (its newest complete checkpoint), or a
Hugging Face GPT-2 / LLaMA folder with its tokenizer.json (``horse.hf``).
The prompt is fed once; after it every new token runs alone against the cached keys and values.
"""

import argparse
import contextlib

import torch

from horse import hf
from horse.model import GPT, KVCache


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    vocab_limit: int | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Continue idx (B, T) by max_new_tokens sampled tokens; returns (B, T + max_new_tokens).

    temperature 0 picks the most likely token; top_k keeps the k most likely; vocab_limit masks
    the ids at and above it (the padding rows of a vocabulary rounded up for the tensor cores).
    When the cache fills the block, the last half block is fed again into a fresh one.
    """
    block_size = model.config.block_size
    cache = KVCache(model.config)
    logits = model(idx[:, -block_size:], cache)[:, -1]  # (B, vocab_size)
    for _ in range(max_new_tokens):
        logits = logits.float()
        if vocab_limit is not None:
            logits[:, vocab_limit:] = float("-inf")
        if temperature == 0:
            next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]  # (B, 1)
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)  # (B, 1)
        idx = torch.cat([idx, next_id], dim=1)
        if cache.length == block_size:
            cache = KVCache(model.config)
            logits = model(idx[:, -(block_size // 2) :], cache)[:, -1]
        else:
            logits = model(next_id, cache)[:, -1]
    return idx


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m horse.generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, help="checkpoint, run directory, or Hugging Face folder")
    parser.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    parser.add_argument("--max-new-tokens", type=int, default=300)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: always the most likely token")
    parser.add_argument("--top-k", type=int, default=40, help="sample among the k most likely (0: all)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", choices=("triton", "reference"), help="default: triton on a GPU")
    args = parser.parse_args(argv)
    if args.temperature < 0:
        parser.error(f"--temperature must be at least 0, got {args.temperature}")
    if args.max_new_tokens < 0 or args.num_samples < 1 or args.top_k < 0:
        parser.error("--max-new-tokens and --top-k must be at least 0, --num-samples at least 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        backend = args.backend or ("triton" if device == "cuda" else "reference")
        model, tokenizer = hf.load_model(args.ckpt, backend)
    except (FileNotFoundError, ValueError) as e:
        parser.error(f"--ckpt: {e}")
    if tokenizer is None:
        parser.error(f"--ckpt {args.ckpt}: no {hf.TOKENIZER} in the folder to encode the prompt with")
    model.to(device).eval()
    ids = tokenizer.encode(args.prompt)
    if not ids:
        parser.error("--prompt must not be empty")
    idx = torch.tensor([ids] * args.num_samples, device=device)
    generator = torch.Generator(device).manual_seed(args.seed)
    autocast = torch.autocast("cuda", torch.float16) if device == "cuda" else contextlib.nullcontext()
    with autocast:
        out = generate(
            model,
            idx,
            args.max_new_tokens,
            args.temperature,
            args.top_k or None,
            tokenizer.vocab_size,
            generator,
        )
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        print(tokenizer.decode(row))


if __name__ == "__main__":
    main()
