"""ringsched and llama.cpp's server side by side on this machine's cores, one sitting, the same prompts.

Builds `llama-server` from the PyPI sdist of `llama-cpp-python` (it vendors llama.cpp's source; cmake and a C++
compiler needed), converts the model to GGUF F32, BF16 and Q8_0 with llama.cpp's own converter (and to Q4_0,
Q4_K_M and Q8_0 with its `llama-quantize` from the F32 file), then for each dtype pair (F32 / float32, BF16 /
bfloat16, Q8_0 / --quantization int8; for a quantized file, both engines serve that same file, ringsched with
--quantization gguf) serves each engine in turn and runs
`ringsched.bench serve` against it: TPOT at one request, output throughput at each --concurrency (llama.cpp
gets as many slots as the largest). Rounds rotate the engines' order; the table gives medians. Everything is
cached under $RINGSCHED_CACHE/llamacpp.

    python scripts/bench_vs_llamacpp.py --rounds 3
    python scripts/bench_vs_llamacpp.py --dtypes f32 --concurrency 1 --ringsched-config "pp=2,threads=1"
    python scripts/bench_vs_llamacpp.py --dtypes q4_0,q4_k_m,gguf_q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from ringsched.cache_dir import cache_dir
from ringsched.weights.fetch import resolve_model

PAIRS = {"f32": ("f32", ["--dtype", "float32"]), "bf16": ("bf16", ["--dtype", "bfloat16"]),
         "q8_0": ("q8_0", ["--dtype", "float32", "--quantization", "int8"])}  # fmt: skip
# Files llama-quantize makes from the F32 conversion; both engines serve the file itself
QUANTS = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "gguf_q8_0": "Q8_0"}


def quantize(root: Path, f32: Path, qtype: str) -> Path:
    """`f32` quantized to `qtype` by llama.cpp's `llama-quantize` (built beside the server, no AMX)."""
    out = f32.with_name(f32.name.replace("-f32.gguf", f"-{qtype.lower()}.gguf"))
    if not out.exists():
        build = root / "build-noamx"  # build_llama_server's
        binary = build / "bin" / "llama-quantize"
        if not binary.exists():
            run(["cmake", "--build", str(build), "--target", "llama-quantize", "-j", str(os.cpu_count() or 2)])
        tmp = out.with_suffix(".tmp")
        run([str(binary), str(f32), str(tmp), qtype])
        tmp.rename(out)
    return out


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def build_llama_server(root: Path, version: str | None) -> tuple[Path, Path]:
    """(llama-server binary, the vendored llama.cpp source directory)."""
    src = root / "src"
    if not src.exists():
        spec = f"llama-cpp-python=={version}" if version else "llama-cpp-python"
        dl = root / "sdist"
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", spec, "-d", str(dl)])
        with tarfile.open(next(dl.glob("llama_cpp_python-*.tar.gz"))) as tar:
            tar.extractall(root / "extract", filter="data")
        next((root / "extract").glob("llama_cpp_python-*/vendor/llama.cpp")).rename(src)
    build = root / "build-noamx"
    binary = build / "bin" / "llama-server"
    if not binary.exists():
        # Native ISA minus ggml's AMX backend: built with GCC 12, its AMX matmul segfaults in llama-server on the first
        # request for Q4_0/Q8_0/Q4_K_M (half of the on-stack tile config left uninitialised at `ldtilecfg`; llama.cpp
        # #20824 / #26954). --no-repack would dodge it but also turn off the CPU repacking of Q4_0/Q4_K weights (its
        # fast AVX2/AVX-512 kernels); without AMX, repacking stays on. -mno-amx-* is an x86 option, so only there.
        no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if os.uname().machine == "x86_64" else ""
        run(["cmake", "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
             f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DLLAMA_CURL=OFF",
             "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON"], cwd=src)  # fmt: skip
        run(["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)])
    return binary, src


def convert(src: Path, model_dir: Path, outtype: str, out: Path) -> Path:
    if not out.exists():
        try:
            import sentencepiece  # noqa: F401  (the converter's gguf package imports it)
        except ImportError:
            run([sys.executable, "-m", "pip", "install", "sentencepiece"])
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}
        tmp = out.with_suffix(".tmp")
        run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
             "--outfile", str(tmp)], env=env)  # fmt: skip
        tmp.rename(out)
    return out


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready in {timeout:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def measure(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    prompts = args.prompts_single if concurrency == 1 else max(2 * concurrency, 16)
    out = Path(args.workdir) / "result.json"
    cmd = [sys.executable, "-m", "ringsched.bench", "serve", "--base-url", url, "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--ignore-eos", "--disable-tqdm", "--seed", "0",
           "--save-result", str(out)]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def serve_ringsched(model: str, flags: list[str], config: str, port: int) -> subprocess.Popen:
    extra, env = [], dict(os.environ)
    for item in filter(None, config.split(",")):
        key, value = item.split("=")
        if key.startswith("RINGSCHED_"):  # an environment variable for this server alone
            env[key] = value
        else:
            extra += {"pp": ["--pp-size", value], "threads": ["--threads-per-stage", value]}[key]
    cmd = [sys.executable, "-m", "ringsched.launch", "--model", model, "--port", str(port), *flags, *extra]
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def serve_llamacpp(binary: Path, gguf: Path, slots: int, threads: int, ctx: int, port: int) -> subprocess.Popen:
    # An HTTP thread per slot and a few more: with its default (a few threads) a streaming request holds one, and
    # at 16 or 64 concurrent the rest found their connections dropped ("Can not write request body").
    cmd = [str(binary), "-m", str(gguf), "-t", str(threads), "-np", str(slots), "-c", str(slots * ctx),
           "--threads-http", str(slots + 8), "--port", str(port)]  # fmt: skip
    return subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="f32,bf16,q8_0", help="of f32, bf16, q8_0, q4_0, q4_k_m, gguf_q8_0")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--prompts-single", type=int, default=4, help="requests of the one-request measurement")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's -t")
    ap.add_argument("--ringsched-config", action="append", default=None,
                    help="pp=N,threads=T and RINGSCHED_*=V environment variables (repeatable; default: pp=1 on "
                         "every core)")  # fmt: skip
    ap.add_argument("--llamacpp-version", default=None, help="llama-cpp-python sdist version (default: newest)")
    ap.add_argument("--workdir", default=str(cache_dir() / "llamacpp"))
    args = ap.parse_args()
    root = Path(args.workdir)
    root.mkdir(parents=True, exist_ok=True)
    binary, src = build_llama_server(root, args.llamacpp_version)
    model_dir = resolve_model(args.model)
    concurrency = [int(c) for c in args.concurrency.split(",")]
    configs = args.ringsched_config or [""]
    port = 31000
    results: dict[tuple[str, str, int], list[dict]] = {}
    for dtype in args.dtypes.split(","):
        outtype, flags = PAIRS[dtype] if dtype in PAIRS else ("f32", ["--quantization", "gguf"])
        gguf = convert(src, model_dir, outtype, root / f"{Path(model_dir).name}-{outtype}.gguf")
        if dtype in QUANTS:
            gguf = quantize(root, gguf, QUANTS[dtype])
        engines = [f"llama.cpp {dtype.upper()}"] + [f"ringsched {' '.join(flags[1::2])} {c}".strip() for c in configs]
        for r in range(args.rounds):
            for i in range(len(engines)):
                name = engines[(i + r) % len(engines)]
                if name.startswith("llama.cpp"):
                    proc = serve_llamacpp(binary, gguf, max(concurrency), args.threads,
                                          args.input_len + args.output_len + 64, port)  # fmt: skip
                else:
                    model = str(gguf) if dtype in QUANTS else args.model
                    proc = serve_ringsched(model, flags, configs[engines.index(name) - 1], port)
                try:
                    wait_ready(f"http://127.0.0.1:{port}", proc)
                    for c in concurrency:
                        res = measure(f"http://127.0.0.1:{port}", c, args)
                        results.setdefault((dtype, name, c), []).append(res)
                        print(f"round {r} {name} c={c}: TPOT {res['median_tpot_ms']:.1f} ms, "
                              f"{res['output_throughput']:.1f} tok/s", flush=True)  # fmt: skip
                finally:
                    stop(proc)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    print(f"\n{cpu}, {os.cpu_count()} cores; {args.input_len}-token prompts, {args.output_len} output tokens; "
          f"medians of {args.rounds}\n")
    heads = ["engine"] + [f"{c} concurrent: tok/s" if c > 1 else "1 request: TPOT (ms)" for c in concurrency]
    print("| " + " | ".join(heads) + " |\n|" + " --- |" * len(heads))
    for dtype in args.dtypes.split(","):
        names = sorted({n for d, n, _ in results if d == dtype}, key=lambda n: not n.startswith("llama"))
        for name in names:
            cells = []
            for c in concurrency:
                runs = results.get((dtype, name, c), [])
                key = "median_tpot_ms" if c == 1 else "output_throughput"
                cells.append(f"{statistics.median(r[key] for r in runs):.1f}" if runs else "")
            print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
