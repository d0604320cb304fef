"""Speculative decoding's model-free drafters (stage 0 holds every request's tokens, so drafting adds no wire
traffic): `ngram.py` (prompt lookup), `suffix.py` (suffix trees over the request and recent requests), and the
vLLM-shaped `--speculative-config` they are chosen by (`config.py`)."""
