"""The process side: flags (`cli_args`), the supervisor that spawns, watches and stops a node's stage
processes, the rendezvous between nodes, a headless node's health endpoint, and the per-process policies a stage
starts with (CPU affinity, heap)."""
