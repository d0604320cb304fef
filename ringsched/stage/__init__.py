"""One stage process: its setup (`worker`), the ring loop (`loop`, with the plans' way in `plans` and the
sampled tokens' way back in `outputs`), the last stage's sampler state, its time accounting, GC policy and
profiler."""
