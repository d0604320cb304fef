"""`python -m ringsched.bench {offline,serve,sweep,hf,cores,overhead}`: the offline engine, a running server, a
ladder of request rates against launched servers, transformers on the same requests, the CPUs, or the engine's own
work per step."""

from __future__ import annotations

import argparse
import importlib
import sys

from ringsched.process.cli_args import HelpFormatter

# command -> (module, help); each module has add_<command>_args(parser) and run_<command>(args).
COMMANDS = {
    "offline": ("ringsched.bench.offline", "saturate the offline engine (no HTTP)"),
    "serve": ("ringsched.bench.serve", "benchmark an OpenAI-compatible server, like `vllm bench serve`"),
    "sweep": ("ringsched.bench.sweep", "launch servers per configuration and run `serve` at a ladder of rates"),
    "hf": ("ringsched.bench.hf", "transformers' generate and generate_batch on the same requests"),
    "cores": ("ringsched.bench.cores", "how much parallel compute this machine's CPUs give"),
    "overhead": ("ringsched.bench.overhead", "the engine's own work per step, on a model of almost no compute"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ringsched.bench")
    sub = p.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, formatter_class=HelpFormatter)
        try:
            modules[name] = importlib.import_module(module)
        except ImportError as e:  # aiohttp, tqdm, matplotlib come with the `bench` and `dev` extras
            modules[name] = e
            continue
        getattr(modules[name], f"add_{name}_args")(sp)
    args = p.parse_args(argv)
    mod = modules[args.command]
    if isinstance(mod, ImportError):
        print(f"error: {mod}; pip install 'ringsched[bench]'", file=sys.stderr)
        return 2
    result = getattr(mod, f"run_{args.command}")(args)
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
