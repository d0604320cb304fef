"""Greedy tokens of long prompts at every layout: PP 1-3, fixed and dynamic chunk sizes (with --cp: CP=2 and
CP=2 x PP=2), against PP=1 with fixed chunks (and, with --hf, transformers on the first --hf-prompts prompts).
Prints one line per layout and exits 1 on any difference. Minutes of CPU: a correctness check to run by hand,
not a test.

    python scripts/check_long_prompts.py --lengths 2000,4500,7000 --hf
    python scripts/check_long_prompts.py --cp --lengths 100,2000,4500,7000 --hf --hf-prompts 4
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from ringsched.engine import Engine
from ringsched.sampling.params import SamplingParams


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="2000,4500,7000", help="prompt lengths in tokens")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--hf", action="store_true", help="also compare the first prompts with transformers")
    p.add_argument("--hf-prompts", type=int, default=2, help="how many prompts --hf compares (the longest are slow)")
    p.add_argument("--cp", action="store_true", help="the layouts: PP=1, CP=2 and CP=2 x PP=2")
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 49152) for _ in range(int(n))] for n in args.lengths.split(",")]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    layouts = [dict(pp_size=pp, enable_dynamic_chunking=dyn) for pp in (1, 2, 3) for dyn in (False, True)]
    if args.cp:
        layouts = [dict(pp_size=1), dict(cp_size=2), dict(cp_size=2, pp_size=2)]
    reference, failed = None, False
    for layout in layouts:
        start = time.perf_counter()
        with Engine(threads_per_stage=1, kv_cache_memory="512M", log_level="warning",
                    chunked_prefill_size=args.chunked_prefill_size, **layout) as llm:  # fmt: skip
            outs = [o.token_ids for o in llm.generate(prompts, params)]
        reference = reference or outs
        same = outs == reference
        failed |= not same
        print(f"{layout}: {'identical to PP=1' if same else 'DIFFERS'} ({time.perf_counter() - start:.0f} s)",
              flush=True)  # fmt: skip
    if args.hf:
        import torch
        from transformers import AutoModelForCausalLM

        from ringsched.weights.fetch import gguf_path

        gguf = gguf_path()
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
        for ids, ours in list(zip(prompts, reference, strict=True))[: args.hf_prompts]:
            with torch.no_grad():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens,
                                  do_sample=False)[0, len(ids):].tolist()  # fmt: skip
            same = out == ours
            failed |= not same
            print(f"transformers, {len(ids)} tokens: {'equal' if same else 'DIFFERS'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
