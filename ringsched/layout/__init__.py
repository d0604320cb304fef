"""Where everything runs, as plain values at the bottom of the package: rank coordinates (`rank.py`), the layer
split (`partition.py`), the flexible cut's range and chooser (`flex.py`) and the context-parallel splits of a
sequence (`cp_split.py`). Nothing here imports another ringsched package."""
