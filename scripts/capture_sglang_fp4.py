"""SGLang's own FP4 KV-cache quantizer and dequantizer (``--kv-cache-dtype fp4_mx_block16``, the MLA pool's), run
from the 0.5.23 wheel: the bytes tests/test_sglang_fp4_cache.py holds amla_sim.algorithms.deployed.sglang.fp4_cache
to.

    pip download --no-deps sglang==0.5.23 -d W && python -m zipfile -e W/sglang-0.5.23-*.whl DIR
    python scripts/capture_sglang_fp4.py --sglang-dir DIR --out tests/data/sglang_fp4_cache.npz [--device cuda]

Needs torch (with a C++ compiler for a CPU run; triton for a CUDA one) and numpy, nothing of amla_sim. The wheel's
``sglang/srt/layers/quantization/kvfp4_tensor.py`` is imported unchanged; its package ``__init__`` files, which pull
in the whole server, are skipped, and ``sglang.srt.runtime_context`` (which only the NVFP4 class calls) is a stub.
``FP4MXBlock16KVQuantizeUtil.batched_quantize`` and ``batched_dequantize`` run under their own ``@torch.compile``
as the server runs them, on ``k_nope`` (T, 1, 512) and ``k_rope`` (T, 1, 64) as ``MLATokenToKVPoolFP4.
set_mla_kv_buffer`` calls them, the rows concatenated as the pool stores them; the dequantizer reads the 288-byte
rows back as ``get_key_buffer`` does.

Nothing is stored twice: the inputs are rebuilt from the recipe in the file's meta by :func:`quantize_inputs` and
:func:`dequantize_inputs` (NumPy only; the test imports them from this file). A run on one device (``cpu``,
``cuda``) adds its arrays, ``{device}__...``, to those of the other already in ``--out``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import types

import numpy as np

SGLANG_VERSION = "0.5.23"
D_NOPE, D_ROPE, D = 512, 64, 576
RECIPE = {
    "seed": 523,
    "random_rows_per_dist": 16,  # rows of 576 for each of the four distributions of random_inputs
    "tie_exponents": [-33, -20, -1, 0, 1, 5, 40, 100, 125],
    "saturation_exponents": [-34, -33, -32, -1, 0, 1, 63, 124, 125],
    "underflow_anchor_exponents": [0, 10, 20, 23, 24, 30],
}
E2M1 = (0, .5, 1, 1.5, 2, 3, 4, 6)
BOUNDS = (.25, .75, 1.25, 1.75, 2.5, 3.5, 5.0)
BF16_MAX = float.fromhex("0x1.fep127")


# --- the inputs, NumPy only -------------------------------------------------------------------------------------


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, np.uint32) << 16).view(np.float32)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """Finite values rounded to BF16 (nearest even), as float32."""
    b = np.asarray(x, np.float32).view(np.uint32)
    b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
    return b.view(np.float32)


def _next(x: float, k: int = 1) -> float:
    """The BF16 value k steps above positive x (k < 0: below)."""
    return float(bf16_bits_to_f32(np.array([(int(np.float32(x).view(np.uint32)) >> 16) + k]))[0])


def _rows(blocks: list) -> np.ndarray:
    """Blocks of 16 values laid out in rows of 576 (36 blocks), the last padded with zero blocks."""
    v = np.asarray(blocks, np.float32).reshape(-1, 16)
    pad = -len(v) % (D // 16)
    return np.concatenate([v, np.zeros((pad, 16), np.float32)]).reshape(-1, D)


def _grid() -> np.ndarray:
    """Every E2M1 code under every scale a finite block can have (e = -33..126): the codes' values times 2^e, -0
    replaced by -2^(e-3) (code 8); at e = 126, where 4 * 2^126 is past BF16, +-4 and +-6 replaced by +-BF16_MAX."""
    base = np.array(E2M1 + (-0.125,) + tuple(-v for v in E2M1[1:]), np.float64)
    blocks = []
    for e in range(-33, 127):
        blk = np.ldexp(base, e)
        if e == 126:
            big = np.abs(base) >= 4
            blk[big] = np.sign(base[big]) * BF16_MAX
        blocks.append(blk)
    return _rows(blocks)


def _ties(exps: list) -> np.ndarray:
    """Each bound between E2M1 magnitudes (a tie), the BF16 values either side and 5.5 .. 6, both signs, under
    anchors 6 * 2^e that fix the scale."""
    vals = [_next(t, k) for t in BOUNDS for k in (-1, 0, 1)] + [5.5, 5.75, _next(6.0, -1), 6.0]
    vals = vals + [-v for v in vals]  # 50 values: 4 blocks of an anchor and up to 15 of them
    blocks = []
    for e in exps:
        for i in range(0, len(vals), 15):
            chunk = vals[i:i + 15]
            blocks.append(np.ldexp([6.0] + chunk + [0.0] * (15 - len(chunk)), e))
    return _rows(blocks)


def _saturation(exps: list) -> np.ndarray:
    """Blocks whose largest magnitude is 6 * 2^e or a BF16 step either side (scale e or e + 1), its negation,
    -0.5 .. 0.5 of it; BF16's largest values (whose 4s and 6s come back Inf), 6e-10 (the 1e-10 floor)."""
    amaxes = []
    for e in exps:
        for k in (-1, 0, 1):
            amaxes.append(_next(np.ldexp(6.0, e), k))
    amaxes += [BF16_MAX, _next(BF16_MAX, -1), np.ldexp(3.5, 126), _next(np.ldexp(3.5, 126), -1), 6e-10,
               _next(np.ldexp(6.0, -34), -1)]
    blocks = []
    for a in amaxes:
        a = float(to_bf16(np.float32(a)))
        blocks.append(to_bf16(np.float32(a) * np.linspace(-1, 1, 16, dtype=np.float32)))
        blocks.append(to_bf16(np.float32(a) * np.array([1, -1] + [0.5, -0.25] * 7, np.float32)))
    return _rows(blocks)


def _zeros() -> np.ndarray:
    z = [np.zeros(16), np.full(16, -0.0), np.tile([0.0, -0.0], 8), np.array([1.0] + [-0.0] * 15),
         np.array([-0.0] * 15 + [-6.0]), np.array([-0.0, 0.0] * 7 + [-1e-10, 1e-10])]
    return _rows(z)


def _subnormal(exps: list) -> np.ndarray:
    """BF16's 254 nonzero subnormals: alone (the 1e-10 floor's scale), then beside anchors 6 * 2^e, which put
    x / 2^e near and below FP32's least subnormal (a negative one that underflows is +0, else -0); and tiny normal
    negatives under anchors that push them under FP32's range."""
    sub = bf16_bits_to_f32(np.concatenate([np.arange(1, 128), np.arange(0x8001, 0x8080)]).astype(np.uint32))
    blocks = list(np.concatenate([sub, np.zeros(-len(sub) % 16, np.float32)]).reshape(-1, 16))
    for e in exps:
        for chunk in np.array_split(sub, int(np.ceil(len(sub) / 15))):
            blocks.append(np.concatenate([[np.ldexp(6.0, e)], chunk, np.zeros(15 - len(chunk))]))
    tiny = -np.ldexp(1.0, np.arange(-126, -111))  # -2^-126 .. -2^-112
    for e in (20, 24, 25, 30, 40):
        blocks.append(np.concatenate([[np.ldexp(6.0, e)], tiny]))
    return _rows(blocks)


def _every_scale() -> np.ndarray:
    """Every finite BF16 magnitude a (0 and the subnormals included) as a block [a, -a, 0 ...]: every scale rule
    input there is."""
    a = bf16_bits_to_f32(np.arange(0, 0x7F80, dtype=np.uint32))
    blocks = np.zeros((len(a), 16), np.float32)
    blocks[:, 0], blocks[:, 1] = a, -a
    return _rows(blocks)


def _every_value() -> np.ndarray:
    """Every BF16 value in [-6, 6] under the scale 1 (anchor 6): every q the rounding sees, as q = x / 2^e only
    shifts exponents."""
    bits = np.arange(0, 0x10000, dtype=np.uint32)
    x = bf16_bits_to_f32(bits)
    with np.errstate(invalid="ignore"):
        x = x[np.abs(x) <= 6.0]
    blocks = []
    for chunk in np.array_split(x, int(np.ceil(len(x) / 15))):
        blocks.append(np.concatenate([[6.0], chunk, np.zeros(15 - len(chunk))]))
    return _rows(blocks)


def random_inputs(seed: int, rows: int) -> np.ndarray:
    """576-wide rows: N(0, 1); N(0, 2^k) with k in -40..40 a row; Student t (2 degrees: heavy tails); DeepSeek-like
    rows (the NoPE part N(0, 0.5) with a few outlier channels x 50, the RoPE part N(0, 3))."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, D))
    b = rng.standard_normal((rows, D)) * np.ldexp(1.0, rng.integers(-40, 41, (rows, 1)))
    c = rng.standard_t(2, (rows, D))
    d = rng.standard_normal((rows, D)) * 0.5
    d[:, rng.choice(D_NOPE, 8, replace=False)] *= 50
    d[:, D_NOPE:] = rng.standard_normal((rows, D_ROPE)) * 3
    return to_bf16(np.concatenate([a, b, c, d]).astype(np.float32))


def _nonfinite() -> np.ndarray:
    inf, nan = np.inf, np.nan
    blocks = [[inf] + [1.0, -3.0, 0.5, -0.0] * 3 + [2, -2, 6], [-inf] + [1.0] * 15, [nan] + [-1.0] * 15,
              [inf, -inf] + [0.0] * 14, [nan, inf] + [4.0] * 14, [1.0] * 15 + [nan], [-0.0] * 15 + [-inf]]
    r = _rows(blocks)
    ok = random_inputs(1, 1)[:2]  # a whole row, one Inf in its RoPE part and one NaN in its NoPE part
    ok[0, D_NOPE + 3], ok[1, 100] = inf, nan
    return np.concatenate([r, ok])


#: The quantizer's cases: name -> (T, 576) rows of BF16 values as float32.
def quantize_inputs(recipe: dict) -> dict[str, np.ndarray]:
    return {
        "grid": _grid(),
        "ties": _ties(recipe["tie_exponents"]),
        "saturation": _saturation(recipe["saturation_exponents"]),
        "zeros": _zeros(),
        "subnormal": _subnormal(recipe["underflow_anchor_exponents"]),
        "every_scale": _every_scale(),
        "every_value": _every_value(),
        "random": random_inputs(recipe["seed"], recipe["random_rows_per_dist"]),
        "nonfinite": _nonfinite(),
    }


def dequantize_inputs(recipe: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The dequantizer's own case, ``codes``: every code in both nibbles of a byte under every scale byte 0..255,
    (T, 1, 288) bytes and (T, 36) scale bytes."""
    lo = np.array([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE], np.uint8)
    hi = ((lo & 0x0F) << 4) | (lo >> 4)
    blocks = [lo] * 256 + [hi] * 256
    scales = list(range(256)) * 2
    pad = -len(blocks) % 36
    blocks, scales = blocks + [lo] * pad, scales + [127] * pad
    packed = np.stack(blocks).reshape(-1, 1, 288)
    return {"codes": (packed, np.array(scales, np.uint8).reshape(-1, 36))}


# --- SGLang's functions ------------------------------------------------------------------------------------------


def load_kvfp4(sglang_dir: str):
    """The wheel's kvfp4_tensor module, imported without the package __init__ files (which import the server)."""
    root = os.path.join(os.path.abspath(sglang_dir), "sglang")
    if not os.path.isfile(os.path.join(root, "srt/layers/quantization/kvfp4_tensor.py")):
        raise SystemExit(f"--sglang-dir: no sglang/srt/layers/quantization/kvfp4_tensor.py under {sglang_dir}")
    for name, sub in [("sglang", ""), ("sglang.srt", "srt"), ("sglang.srt.layers", "srt/layers"),
                      ("sglang.srt.layers.quantization", "srt/layers/quantization")]:
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, sub) if sub else root]
        sys.modules[name] = mod
    stub = types.ModuleType("sglang.srt.runtime_context")

    def get_platform():
        raise RuntimeError("runtime_context is stubbed: only the NVFP4 class calls it")

    stub.get_platform = get_platform
    sys.modules[stub.__name__] = stub
    from sglang.srt.layers.quantization import kvfp4_tensor
    return kvfp4_tensor


def _wheel_version(sglang_dir: str) -> str | None:
    for entry in os.listdir(sglang_dir):
        if entry.startswith("sglang-") and entry.endswith(".dist-info"):
            return entry[len("sglang-"):-len(".dist-info")]
    return None


def capture(sglang_dir: str, device: str, recipe: dict) -> tuple[dict, dict]:
    import torch

    util = load_kvfp4(sglang_dir).FP4MXBlock16KVQuantizeUtil
    qin = quantize_inputs(recipe)
    names, rows = list(qin), [len(v) for v in qin.values()]
    x = torch.from_numpy(np.concatenate(list(qin.values()))).to(device).to(torch.bfloat16).view(-1, 1, D)
    nope, rope = x[..., :D_NOPE].contiguous(), x[..., D_NOPE:].contiguous()
    pn, sn = util.batched_quantize(nope)  # as set_mla_kv_buffer: two calls
    pr, sr = util.batched_quantize(rope)
    packed, scales = torch.cat([pn, pr], dim=-1), torch.cat([sn, sr], dim=-1)  # the pool's row layout
    pw, sw = util.batched_quantize(x)
    split_is_whole = bool(torch.equal(pw, packed) and torch.equal(sw, scales))
    deq = util.batched_dequantize(packed, scales)  # get_key_buffer: the default dtype, BF16
    assert deq.dtype == torch.bfloat16 and deq.shape == x.shape
    out, start = {}, 0
    to_np = lambda t: t.cpu().numpy()  # noqa: E731
    for name, n in zip(names, rows):
        sl = slice(start, start + n)
        out[f"q_{name}_packed"] = to_np(packed[sl])
        out[f"q_{name}_scales"] = to_np(scales[sl])
        out[f"q_{name}_deq"] = to_np(deq[sl].contiguous().view(torch.int16)).view(np.uint16)
        start += n
    eager = getattr(util.batched_quantize, "_torchdynamo_orig_callable", None)
    if eager is None:
        raise SystemExit("batched_quantize is not a torch.compile wrapper: cannot run it eagerly")
    sat = torch.from_numpy(qin["saturation"]).to(device).to(torch.bfloat16).view(-1, 1, D)
    out["eager_saturation_scales"] = to_np(eager(sat)[1])
    for name, (p, s) in dequantize_inputs(recipe).items():
        d = util.batched_dequantize(torch.from_numpy(p).to(device), torch.from_numpy(s).to(device))
        out[f"d_{name}"] = to_np(d.contiguous().view(torch.int16)).view(np.uint16)
    info = {
        "device_name": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device == "cuda" else None,
        "split_is_whole": split_is_whole,
    }
    if device == "cuda":
        import triton
        info["triton"] = triton.__version__
    return info, out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sglang-dir", required=True, help="the unzipped sglang 0.5.23 wheel")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = ap.parse_args(argv)
    version = _wheel_version(args.sglang_dir)
    if version != SGLANG_VERSION:
        raise SystemExit(f"--sglang-dir: expected the sglang {SGLANG_VERSION} wheel, found {version!r}")
    info, arrays = capture(args.sglang_dir, args.device, RECIPE)
    meta = {"sglang": SGLANG_VERSION, "recipe": RECIPE, "captures": {}}
    kept = {}
    if os.path.exists(args.out):  # keep the other device's capture
        with np.load(args.out) as z:
            old = json.loads(str(z["meta"]))
            if old["recipe"] != RECIPE or old["sglang"] != SGLANG_VERSION:
                raise SystemExit(f"--out: {args.out} holds another recipe or version; write a new file")
            meta["captures"] = {k: v for k, v in old["captures"].items() if k != args.device}
            kept = {k: z[k] for k in z.files if k != "meta" and not k.startswith(f"{args.device}__")}
    meta["captures"][args.device] = info
    arrays = {f"{args.device}__{k}": v for k, v in arrays.items()}
    buf = io.BytesIO()
    np.savez_compressed(buf, meta=np.array(json.dumps(meta, sort_keys=True)), **kept, **arrays)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(args.out)), suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(buf.getvalue())
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {args.device} ({info['device_name']}), {len(arrays)} arrays, "
          f"{os.path.getsize(args.out)} bytes; split == whole: {info['split_is_whole']}")


if __name__ == "__main__":
    main()
