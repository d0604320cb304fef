"""`python -m ringsched.server.grammar_helper MODEL_DIR VOCAB_SIZE EOS_IDS MEMORY_MB`: one grammar checker.

A helper process of `grammar_pool.GrammarPool`. It caps its own address space at MEMORY_MB, asks the kernel to
kill it when its parent dies, builds the model's llguidance tokenizer, writes `{"ready": true}` and then answers
one JSON line per JSON line on standard input: `{"form": {...}}` (a `grammar_for` form) gets
`{"grammar": "..."}` once the grammar compiled, validated, built a matcher and computed its first token mask,
exactly what the last stage will do with it, or `{"error": "..."}` saying why not. A grammar that overflows
the native stack or runs away kills only this process; the pool replaces it. Native code printing to standard
output cannot garble the answers: they go to a duplicate of it, and fd 1 is pointed at standard error.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys

from ringsched.sampling.structured import GrammarError, Grammars, check, grammar_for

_PR_SET_PDEATHSIG = 1


def _confine(memory_mb: int) -> None:
    limit = memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crash on hostile input leaves no core file
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.nice(5)  # the stages' steps come first when the CPUs are busy


def prove(form: dict, grammars: Grammars) -> str:
    """The llguidance grammar of `form`, after the last stage's own work with it succeeded here."""
    grammar = grammar_for(**form)
    error = check(grammar)
    if error:
        raise GrammarError(f"the constraint is not valid: {error}")
    grammars.constraint(grammar).mask()
    return grammar


def _answer(job: dict, grammars: Grammars) -> dict:
    try:
        return {"grammar": prove(job["form"], grammars)}
    except GrammarError as e:
        return {"error": str(e)}
    except MemoryError:
        return {"error": "compiling it needs more memory than a grammar may use"}
    except Exception as e:  # anything else the compiler raises is still this request's problem
        return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str]) -> int:
    model_dir, vocab_size, eos, memory_mb = argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: the pool ends us (EOF)
    eos_ids = tuple(int(t) for t in eos.split(",") if t)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    _confine(int(memory_mb))
    grammars = Grammars(model_dir, int(vocab_size), eos_ids)
    grammars.constraint(grammar_for(regex="a"))  # builds the tokenizer before the first request waits on it
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:  # EOF: the pool closed us
        out.write(json.dumps(_answer(json.loads(line), grammars)) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
