"""`python -m ringsched.generate --pp-size 2 "prompt" ...`: one-shot generation on the ring, printed."""

from __future__ import annotations

import argparse
import sys

from ringsched.process.cli_args import HelpFormatter, add_engine_args, config_from_args, engine_kwargs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringsched.generate", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    p.add_argument("prompts", nargs="+", help="prompt texts")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--stream", action="store_true", help="print tokens as they come (one prompt)")
    p.add_argument("--log-level", default="warning", help="info shows each stage's layers and KV capacity")
    args = p.parse_args(argv)
    cfg = config_from_args(args, log_level=args.log_level)
    from ringsched.engine import Engine
    from ringsched.sampling.params import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    kwargs = engine_kwargs(cfg)
    with Engine(model=cfg.model, **kwargs) as llm:
        prompts = args.prompts
        if args.chat:
            prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in prompts]
        if args.stream:
            ids: dict[int, list[int]] = {}
            shown: dict[int, str] = {}
            for ev in llm.stream(prompts, params):
                ids.setdefault(ev.index, []).extend(ev.token_ids)
                text = llm.tokenizer.decode(ids[ev.index])
                if not text.endswith("\ufffd"):
                    print(text[len(shown.get(ev.index, "")) :], end="", flush=True)
                    shown[ev.index] = text
            print()
            return 0
        for prompt, out in zip(args.prompts, llm.generate(prompts, params), strict=True):
            print(f"--- {prompt!r} ({out.finish_reason}, {len(out.token_ids)} tokens)")
            print(out.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
