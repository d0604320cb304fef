#!/usr/bin/env bash
# Install everything the test suite needs, then run it; arguments go to pytest (e.g. -m "not slow" for the fast
# lane). System tools for the multi-node tests (slurm-wlm for tests/test_slurm.py, iproute2 for the network
# namespaces of tests/test_multinode.py, curl) come from apt-get where we are root; then CPU torch (pinned first,
# so nothing pulls a CUDA build), ringsched with its dev extras, and pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
for tool in slurmctld slurmd sbatch ip curl; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null && apt-get install -y -qq slurm-wlm iproute2 curl >/dev/null \
            || echo "warning: apt-get could not install slurm-wlm/iproute2/curl; the SLURM and netns tests will fail" >&2
    else
        echo "note: ${missing[*]} missing and not root with apt-get: the SLURM and netns tests skip" >&2
    fi
fi
pip install torch==2.13.0
pip install -e '.[dev]'
# Two workers, each taking whole test files (`--dist loadfile`: a module's shared engines and servers stay on one
# worker): much of the suite waits on stage processes, servers and clients rather than computing, so two files
# at a time fill the two cores better than one (12 minutes against 17 on 2 vCPUs).
python -m pytest -q -n 2 --dist loadfile "$@"
