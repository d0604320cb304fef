"""ringsched: a pipeline-parallel LLM inference server (one scheduler per stage, stages in a ring)."""

__version__ = "0.1.0"
