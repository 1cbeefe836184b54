"""Record raw FP8 tensor-core instructions with a nonzero accumulator, for tests/test_mma.py (#13 item 6).

Run on an H100/H200 with torch and nvcc:  python scripts/capture_fp8_mma.py OUTDIR

Issued from inline PTX (nvcc, sm_90a): ``mma.sync.aligned.m16n8k32.row.col.f32.{e4m3,e5m2}``, one warp per
instance, and ``wgmma.mma_async.sync.aligned.m64n8k32.f32.{e4m3,e5m2}`` from shared memory, one warpgroup per
instance: D = A B + C with C loaded from memory (K = 32: one instruction) and two instructions chained through
the accumulator (K = 64). Triton's ``tl.dot`` never issues this form (each tl.dot starts from zero and adds into
its accumulator with an FP32 add, tests/data/triton_dot.npz); this capture decides what the instructions
themselves do with C. One-hot layout probes check the fragment and shared-memory layouts first. Writes
fp8_mma_sync.npz: operands and results as raw bits (wgmma reuses the mma.sync operands, four 16-row slices
stacked into one 64-row tile).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import torch

from amla_sim._seeds import derive_seed

INSTANCES = 384
SOURCE = r"""
#include <cstdint>
template <int FMT>
__device__ void mma(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4]) {
  if (FMT == 0)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n" : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
  else
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%10,%11,%12,%13};\n" : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]),
                   "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

// A: (n, 16, K) row-major bytes, B: (n, K, 8) row-major bytes, C and D: (n, 16, 8) float. One warp per instance.
template <int FMT>
__global__ void chain(const uint8_t* A, const uint8_t* B, const float* C, float* D, int K) {
  int inst = blockIdx.x, lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const uint8_t* a = A + (size_t)inst * 16 * K;
  const uint8_t* b = B + (size_t)inst * K * 8;
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = C[(size_t)inst * 128 + (g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  for (int k0 = 0; k0 < K; k0 += 32) {
    uint32_t ar[4], br[2];
    for (int r = 0; r < 4; ++r) {  // a_i, i = 4 r + e: row g (+8 for r odd), column 4 t + e (+16 for r >= 2)
      uint32_t v = 0;
      for (int e = 0; e < 4; ++e)
        v |= (uint32_t)a[(g + 8 * (r & 1)) * K + k0 + 4 * t + e + 16 * (r >> 1)] << (8 * e);
      ar[r] = v;
    }
    for (int r = 0; r < 2; ++r) {  // b_i, i = 4 r + e: row 4 t + e (+16 for r = 1), column g
      uint32_t v = 0;
      for (int e = 0; e < 4; ++e) v |= (uint32_t)b[(k0 + 4 * t + e + 16 * r) * 8 + g] << (8 * e);
      br[r] = v;
    }
    float d[4];
    mma<FMT>(d, ar, br, acc);
    for (int i = 0; i < 4; ++i) acc[i] = d[i];
  }
  for (int i = 0; i < 4; ++i) D[(size_t)inst * 128 + (g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = acc[i];
}

// wgmma m64n8k32 from shared memory (no swizzle, K-major core matrices of 8 rows x 16 bytes), one warpgroup per
// instance: A (n, 64, K) and B^T (n, 8, K) bytes, C and D (n, 64, 8) float. Core matrix (r, k) of A sits at
// (r * KC + k) * 128 bytes, KC = 2 core matrices along k = 32; LBO and SBO (byte offsets between core matrices
// adjacent along K and along M/N) are arguments, so that the layout probe decides their roles.
__device__ uint64_t desc(const void* smem, int lbo, int sbo) {
  uint64_t addr = (uint64_t)__cvta_generic_to_shared(smem);
  return ((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) | ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

template <int FMT>
__global__ void wg_chain(const uint8_t* A, const uint8_t* B, const float* C, float* D, int K, int lbo, int sbo) {
  __shared__ __align__(128) uint8_t sa[64 * 32];
  __shared__ __align__(128) uint8_t sb[8 * 32];
  int inst = blockIdx.x, tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const uint8_t* a = A + (size_t)inst * 64 * K;
  const uint8_t* b = B + (size_t)inst * 8 * K;
  float d[4];
  for (int i = 0; i < 4; ++i) d[i] = C[(size_t)inst * 512 + (16 * w + g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  for (int k0 = 0; k0 < K; k0 += 32) {
    for (int e = tid; e < 64 * 32; e += 128) {  // element (r, k) into core matrix (r / 8, k / 16)
      int r = e / 32, k = e % 32;
      sa[((r / 8) * 2 + k / 16) * 128 + (r % 8) * 16 + k % 16] = a[r * K + k0 + k];
    }
    for (int e = tid; e < 8 * 32; e += 128) {
      int r = e / 32, k = e % 32;
      sb[(k / 16) * 128 + r * 16 + k % 16] = b[r * K + k0 + k];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    uint64_t da = desc(sa, lbo, sbo), db = desc(sb, lbo, sbo);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    if (FMT == 0)
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
    else
      asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                   "wgmma.mma_async.sync.aligned.m64n8k32.f32.e5m2.e5m2 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
                   : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "l"(da), "l"(db));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    __syncthreads();
  }
  for (int i = 0; i < 4; ++i) D[(size_t)inst * 512 + (16 * w + g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = d[i];
}

extern "C" void run_wg(int fmt, const uint8_t* A, const uint8_t* B, const float* C, float* D, int n, int K, int lbo,
                       int sbo) {
  if (fmt == 0) wg_chain<0><<<n, 128>>>(A, B, C, D, K, lbo, sbo); else wg_chain<1><<<n, 128>>>(A, B, C, D, K, lbo, sbo);
  cudaDeviceSynchronize();
}

extern "C" void run(int fmt, const uint8_t* A, const uint8_t* B, const float* C, float* D, int n, int K) {
  if (fmt == 0) chain<0><<<n, 32>>>(A, B, C, D, K); else chain<1><<<n, 32>>>(A, B, C, D, K);
  cudaDeviceSynchronize();
}
"""

FORMATS = {"e4m3": (0, ml_dtypes.float8_e4m3fn), "e5m2": (1, ml_dtypes.float8_e5m2)}


def build(folder: str) -> ctypes.CDLL:
    src, lib = os.path.join(folder, "fp8_mma.cu"), os.path.join(folder, "fp8_mma.so")
    with open(src, "w") as f:
        f.write(SOURCE)
    subprocess.run(["nvcc", "-O2", "-gencode", "arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC", src,
                    "-o", lib], check=True)
    return ctypes.CDLL(lib)


def device_chain(lib: ctypes.CDLL, fmt: str, a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    n, _, K = a.shape
    ta, tb = (torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda() for x in (a, b))
    tc = torch.from_numpy(np.ascontiguousarray(c)).cuda()
    td = torch.empty_like(tc)
    lib.run(FORMATS[fmt][0], ctypes.c_void_p(ta.data_ptr()), ctypes.c_void_p(tb.data_ptr()),
            ctypes.c_void_p(tc.data_ptr()), ctypes.c_void_p(td.data_ptr()), n, K)
    return td.cpu().numpy()


def device_wgmma(lib: ctypes.CDLL, fmt: str, a: np.ndarray, bt: np.ndarray, c: np.ndarray, lbo: int,
                 sbo: int) -> np.ndarray:
    """a: (n, 64, K), bt = B^T: (n, 8, K), c: (n, 64, 8)."""
    n, _, K = a.shape
    ta, tb = (torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).cuda() for x in (a, bt))
    tc = torch.from_numpy(np.ascontiguousarray(c)).cuda()
    td = torch.empty_like(tc)
    lib.run_wg(FORMATS[fmt][0], ctypes.c_void_p(ta.data_ptr()), ctypes.c_void_p(tb.data_ptr()),
               ctypes.c_void_p(tc.data_ptr()), ctypes.c_void_p(td.data_ptr()), n, K, lbo, sbo)
    return td.cpu().numpy()


def wgmma_layout(lib: ctypes.CDLL) -> tuple[int, int] | None:
    """The (LBO, SBO) for which one-hot products of wgmma land where they belong, or None."""
    dt = FORMATS["e4m3"][1]
    cases = [(i, k, j) for i in range(64) for k in range(32) for j in range(8) if (i * 7 + k * 3 + j) % 41 == 0]
    a = np.zeros((len(cases), 64, 32), dt)
    bt = np.zeros((len(cases), 8, 32), dt)
    want = np.zeros((len(cases), 64, 8), np.float32)
    for n, (i, k, j) in enumerate(cases):
        a[n, i, k], bt[n, j, k], want[n, i, j] = 1, 1, 1
    for lbo, sbo in ((128, 256), (256, 128)):
        d = device_wgmma(lib, "e4m3", a, bt, np.zeros_like(want), lbo, sbo)
        print(f"wgmma layout probe LBO={lbo} SBO={sbo}: {int((d != want).sum())} elements differ", flush=True)
        if np.array_equal(d, want):
            return lbo, sbo
    return None


def operands(fmt: str, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Products spread over a few binades, cancellations, and accumulators from far below to far above them."""
    rng = np.random.default_rng(derive_seed("fp8-mma", fmt, K))
    dt = FORMATS[fmt][1]
    a = rng.standard_normal((INSTANCES, 16, K)) * 2.0 ** rng.integers(-3, 4, (INSTANCES, 16, 1))
    b = rng.standard_normal((INSTANCES, K, 8)) * 2.0 ** rng.integers(-3, 4, (INSTANCES, 1, 8))
    a[::4, :, 1::2] = -a[::4, :, ::2]  # exact cancellations in a quarter of the instances
    c = rng.standard_normal((INSTANCES, 16, 8)) * 2.0 ** rng.integers(-24, 12, (INSTANCES, 16, 8))
    c[::5] = 0.0
    return a.astype(dt), b.astype(dt), c.astype(np.float32)


def layout_probe(lib: ctypes.CDLL) -> None:
    """One-hot A (row i, column k) and B (row k, column j): D must be 1 at (i, j) alone."""
    dt = FORMATS["e4m3"][1]
    cases = [(i, k, j) for i in range(16) for k in range(32) for j in range(8) if (i * 7 + k * 3 + j) % 17 == 0]
    a = np.zeros((len(cases), 16, 32), dt)
    b = np.zeros((len(cases), 32, 8), dt)
    for n, (i, k, j) in enumerate(cases):
        a[n, i, k], b[n, k, j] = 1, 1
    d = device_chain(lib, "e4m3", a, b, np.zeros((len(cases), 16, 8), np.float32))
    want = np.zeros_like(d)
    for n, (i, _, j) in enumerate(cases):
        want[n, i, j] = 1
    if not np.array_equal(d, want):
        sys.exit(f"fragment layout wrong: {int((d != want).sum())} elements differ")
    print(f"layout probe: {len(cases)} one-hot products in place", flush=True)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(tmp)
        layout_probe(lib)
        arrays = {}
        for fmt in FORMATS:
            for K in (32, 64):
                a, b, c = operands(fmt, K)
                d = device_chain(lib, fmt, a, b, c)
                arrays.update({f"{fmt}/K{K}/a": a.view(np.uint8), f"{fmt}/K{K}/b": b.view(np.uint8),
                               f"{fmt}/K{K}/c": c.view(np.uint32), f"{fmt}/K{K}/d": d.view(np.uint32)})
                print(f"{fmt} K={K}: {INSTANCES} instances", flush=True)
        layout = wgmma_layout(lib)
        if layout is not None:  # wgmma: the same operands, four 16-row slices stacked into one 64-row tile
            for fmt in FORMATS:
                for K in (32, 64):
                    a = arrays[f"{fmt}/K{K}/a"].view(FORMATS[fmt][1]).reshape(-1, 64, K)
                    b = arrays[f"{fmt}/K{K}/b"].view(FORMATS[fmt][1])[::4]
                    c = arrays[f"{fmt}/K{K}/c"].view(np.float32).reshape(-1, 64, 8)
                    d = device_wgmma(lib, fmt, a, np.swapaxes(b, 1, 2), c, *layout)
                    arrays.update({f"wgmma/{fmt}/K{K}/b": b.view(np.uint8), f"wgmma/{fmt}/K{K}/d": d.view(np.uint32)})
                    print(f"wgmma {fmt} K={K}: {a.shape[0]} instances", flush=True)
    arrays["device"] = np.array(torch.cuda.get_device_name())
    np.savez_compressed(os.path.join(out, "fp8_mma_sync.npz"), **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
