"""The KV cache: the block table, prefix cache and pool (`cache.py`) and, under `--cp-size`, the placement of a
request's blocks over a stage's CP ranks (`cp_blocks.py`)."""
