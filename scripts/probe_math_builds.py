"""What CUDA C++'s exp2f, log2f, logf and '/' compile to with and without ``--use_fast_math`` on sm_90a, and what the
shipped FlashMLA libraries hold.

Run on a CUDA machine with nvcc:  python scripts/probe_math_builds.py OUTDIR [LIBRARY.so ...]

1. Compiles one probe program twice (``-O3 -arch=sm_90a``, with and without ``--use_fast_math``): every function
   applied elementwise, and the PTX instructions ``ex2.approx.f32`` and ``lg2.approx.f32`` (without ``.ftz``) beside
   them. Over all 2^32 FP32 inputs it counts where the precise build's ``exp2f`` and ``log2f`` differ from those
   instructions, and where each build's function differs from the other's (``NaN`` equal to ``NaN``), keeping the
   first 4096 inputs of each difference.
2. Writes ``math_builds.npz``: on a fixed sample of inputs (random bit patterns, the subnormal boundaries, ranges
   near 1), the outputs of each function in each build (``{fn}_{build}``), with the inputs (``x``, ``a``, ``b``).
3. Writes ``sass_census.txt``: for the probe and each library named, the count of each MUFU, division-subroutine
   and flush-to-zero instruction kind in each kernel function, from ``cuobjdump -sass``.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

_PROBE = r"""
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <cmath>

__device__ __forceinline__ float ex2_asm(float x) { float y; asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }
__device__ __forceinline__ float lg2_asm(float x) { float y; asm("lg2.approx.f32 %0, %1;" : "=f"(y) : "f"(x)); return y; }

__global__ void k_unary(int fn, const float* x, float* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = x[i];
    float r;
    switch (fn) {
        case 0: r = exp2f(v); break;
        case 1: r = log2f(v); break;
        case 2: r = logf(v); break;
        case 3: r = v / (float)M_LOG2E; break;
        case 4: r = 1.0f / v; break;
        case 5: r = expf(v); break;
        case 6: r = ex2_asm(v); break;
        default: r = lg2_asm(v); break;
    }
    y[i] = r;
}

__global__ void k_div(const float* a, const float* b, float* y, size_t n) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a[i] / b[i];
}

__device__ __forceinline__ bool same(float p, float q) {
    uint32_t u = __float_as_uint(p), v = __float_as_uint(q);
    return u == v || (p != p && q != q);
}

// every FP32 bit pattern: fn(x) against ex2/lg2 asm; counts and the first inputs that differ
__global__ void k_sweep(int fn, unsigned long long* count, uint32_t* first, uint32_t hi) {
    uint32_t bits = (hi << 16) | (blockIdx.x * blockDim.x + threadIdx.x);
    float x = __uint_as_float(bits);
    float p = fn == 0 ? exp2f(x) : log2f(x);
    float q = fn == 0 ? ex2_asm(x) : lg2_asm(x);
    if (!same(p, q)) {
        unsigned long long k = atomicAdd(count, 1ULL);
        if (k < 4096) first[k] = bits;
    }
}

static void check(cudaError_t e) { if (e != cudaSuccess) { fprintf(stderr, "CUDA: %s\n", cudaGetErrorString(e)); exit(1); } }

int main(int argc, char** argv) {
    // probe unary FN IN OUT | probe div A B OUT | probe sweep FN OUT
    if (!strcmp(argv[1], "sweep")) {
        int fn = atoi(argv[2]);
        unsigned long long* count; uint32_t* first;
        check(cudaMalloc(&count, 8)); check(cudaMemset(count, 0, 8));
        check(cudaMalloc(&first, 4096 * 4)); check(cudaMemset(first, 0, 4096 * 4));
        for (uint32_t hi = 0; hi < 65536; ++hi) k_sweep<<<256, 256>>>(fn, count, first, hi);
        check(cudaGetLastError()); check(cudaDeviceSynchronize());
        unsigned long long c; uint32_t f[4096];
        check(cudaMemcpy(&c, count, 8, cudaMemcpyDeviceToHost));
        check(cudaMemcpy(f, first, 4096 * 4, cudaMemcpyDeviceToHost));
        FILE* o = fopen(argv[3], "wb"); fwrite(&c, 8, 1, o); fwrite(f, 4, 4096, o); fclose(o);
        return 0;
    }
    int binary = !strcmp(argv[1], "div");
    const char* out = argv[binary ? 4 : 4];
    FILE* fa = fopen(argv[binary ? 2 : 3], "rb"); fseek(fa, 0, SEEK_END); size_t n = ftell(fa) / 4; rewind(fa);
    float* ha = (float*)malloc(n * 4); fread(ha, 4, n, fa); fclose(fa);
    float *da, *db, *dy; check(cudaMalloc(&da, n * 4)); check(cudaMalloc(&dy, n * 4));
    check(cudaMemcpy(da, ha, n * 4, cudaMemcpyHostToDevice));
    if (binary) {
        FILE* fb = fopen(argv[3], "rb"); float* hb = (float*)malloc(n * 4); fread(hb, 4, n, fb); fclose(fb);
        check(cudaMalloc(&db, n * 4)); check(cudaMemcpy(db, hb, n * 4, cudaMemcpyHostToDevice));
        k_div<<<(n + 255) / 256, 256>>>(da, db, dy, n);
    } else {
        k_unary<<<(n + 255) / 256, 256>>>(atoi(argv[2]), da, dy, n);
    }
    check(cudaGetLastError()); check(cudaDeviceSynchronize());
    check(cudaMemcpy(ha, dy, n * 4, cudaMemcpyDeviceToHost));
    FILE* o = fopen(out, "wb"); fwrite(ha, 4, n, o); fclose(o);
    return 0;
}
"""

UNARY = ("exp2f", "log2f", "logf", "div_log2e", "rcp", "expf", "ex2_asm", "lg2_asm")
BUILDS = {"precise": [], "fast": ["--use_fast_math"]}


def sample_inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x for the unary functions; a, b for the division. Random bit patterns of every sign and exponent, then the
    ranges each model turns on: exp2 near the subnormal results (-150..-120) and on [-30, 30], logs near 1, on the
    subnormals and near the normal boundary, quotients near 1 and with subnormal and huge operands."""
    rng = np.random.default_rng(20261128)
    bits = rng.integers(0, 2**32, 8192, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([
        bits,
        rng.uniform(-152, -118, 8192), rng.uniform(-30, 30, 8192), rng.uniform(120, 129, 1024),
        rng.uniform(0.5, 2.0, 8192), 1 + rng.uniform(-2**-10, 2**-10, 4096),
        rng.uniform(1, 2, 4096) * 2.0 ** rng.integers(-149, -120, 4096),
        rng.uniform(1, 2, 8192) * 2.0 ** rng.integers(-126, 128, 8192),
        [0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 2.0, 0.5, -1.0, 1e-45, 1.1754942e-38, 1.17549435e-38, 3.4028235e38,
         -126.0, -127.0, -149.0, -150.0, 128.0, 127.99999],
    ]).astype(np.float32)
    b = np.concatenate([rng.uniform(1, 2, 8192) * 2.0 ** rng.integers(-10, 11, 8192),
                        rng.uniform(1, 2, 2048) * 2.0 ** rng.integers(-149, -120, 2048),
                        rng.uniform(1, 2, 2048) * 2.0 ** rng.integers(120, 128, 2048),
                        bits[:4096]]).astype(np.float32)
    a = (rng.uniform(-2, 2, b.size) * 2.0 ** rng.integers(-130, 128, b.size)).astype(np.float32)
    return x, a, b


_SASS_KINDS = ("MUFU.EX2", "MUFU.LG2", "MUFU.RCP", "MUFU.RSQ", "FMUL.FTZ", "FFMA.FTZ", "FADD.FTZ", "FSETP", "CALL.REL")


def sass_census(path: str) -> str:
    """Per kernel function of `path`: how many of each instruction kind of :data:`_SASS_KINDS` its SASS has."""
    text = subprocess.run(["cuobjdump", "-sass", path], capture_output=True, text=True).stdout
    lines, fn, counts = [], None, collections.Counter()

    def flush():
        if fn is not None:
            lines.append(f"{fn[:160]}\t" + " ".join(f"{k}={counts[k]}" for k in _SASS_KINDS if counts[k]))

    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            flush()
            fn, counts = m.group(1), collections.Counter()
            continue
        for k in _SASS_KINDS:
            if k in line:
                counts[k] += 1
    flush()
    return "\n".join(lines)


def main() -> None:
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    work = tempfile.mkdtemp()
    src = os.path.join(work, "probe.cu")
    with open(src, "w") as f:
        f.write(_PROBE)
    exe = {}
    for build, flags in BUILDS.items():
        exe[build] = os.path.join(work, f"probe_{build}")
        subprocess.run(["nvcc", "-O3", "-std=c++17", "-D_USE_MATH_DEFINES", "-gencode",
                        "arch=compute_90a,code=sm_90a", *flags, "-o", exe[build], src], check=True)
    x, a, b = sample_inputs()
    got = {"x": x, "a": a, "b": b}

    def run(*args: str) -> None:
        subprocess.run([*args], check=True)

    for build in BUILDS:
        xin, ain, bin_ = (os.path.join(work, n) for n in ("x.bin", "a.bin", "b.bin"))
        x.tofile(xin), a.tofile(ain), b.tofile(bin_)
        for k, name in enumerate(UNARY):
            y = os.path.join(work, "y.bin")
            run(exe[build], "unary", str(k), xin, y)
            got[f"{name}_{build}"] = np.fromfile(y, np.float32)
        y = os.path.join(work, "y.bin")
        run(exe[build], "div", ain, bin_, y)
        got[f"div_{build}"] = np.fromfile(y, np.float32)
    report = []
    for fn, name in ((0, "exp2f"), (1, "log2f")):
        for build in BUILDS:
            path = os.path.join(work, f"sweep_{name}_{build}.bin")
            run(exe[build], "sweep", str(fn), path)
            raw = np.fromfile(path, np.uint8)
            count = int(raw[:8].view(np.uint64)[0])
            first = raw[8:].view(np.uint32)[:min(count, 4096)]
            got[f"sweep_{name}_{build}"] = first
            asm = "ex2.approx.f32" if fn == 0 else "lg2.approx.f32"
            report.append(f"{name} ({build}) differs from {asm} on {count} of 2^32 inputs")
    np.savez_compressed(os.path.join(out, "math_builds.npz"), **got)
    census = [f"== probe ({b})\n" + sass_census(exe[b]) for b in BUILDS]
    census += [f"== {lib}\n" + sass_census(lib) for lib in sys.argv[2:]]
    with open(os.path.join(out, "sass_census.txt"), "w") as f:
        f.write("\n".join(report) + "\n\n" + "\n\n".join(census) + "\n")
    for b in BUILDS:
        text = subprocess.run(["cuobjdump", "-sass", exe[b]], capture_output=True, text=True).stdout
        with open(os.path.join(out, f"probe_{b}.sass"), "w") as f:
            f.write(text)
    print("\n".join(report))


if __name__ == "__main__":
    main()
