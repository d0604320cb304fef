"""How a request samples and what constrains it: its parameters (`params.py`, vLLM's `SamplingParams`), the last
stage's sampler (`sampler.py`), and structured outputs through a grammar (`structured.py`)."""
