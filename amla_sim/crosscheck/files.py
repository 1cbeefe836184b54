"""The capture file, one format for every kernel: an ``.npz`` of named arrays (raw bits) and a JSON ``meta``.

:func:`read_capture` checks a file before anything is decompressed (a readable zip without pickles, a bounded
size, a JSON object for ``meta``). Inputs are mostly not stored: a capture names the recipe that rebuilds them
and their CRC (:func:`input_crc`), or a shared inputs file and its SHA-256 (:func:`inputs_digest`), so that a
replay proves it rebuilt the very inputs the device saw.

A recipe's scalars are JSON numbers; a scale that is not finite (a descale of NaN or an infinity, which the kernels
take) is written as the string ``"inf"``, ``"-inf"`` or ``"nan"`` (:func:`encode_recipe`, :func:`decode_recipe`), so
the meta stays standard JSON. A capture of cases holds, per case ``i`` of ``meta["cases"]``, the arrays
``c{i}_{name}``; :func:`split_cases` and :func:`case_arrays` hand them out by case and refuse, by name, every array
that belongs to no case, so that nothing a file holds is left out of a replay unsaid.
"""

from __future__ import annotations

import hashlib
import json
import re
import zipfile
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .._validate import DataError

__all__ = ["CaptureError", "MAX_CAPTURE_BYTES", "read_capture", "split_cases", "case_arrays", "input_crc",
           "inputs_digest", "encode_recipe", "decode_recipe"]

#: a recipe's non-finite scalars as the meta writes them
_NONFINITE = {"inf": float("inf"), "-inf": float("-inf"), "nan": float("nan")}


def encode_recipe(recipe: dict) -> dict:
    """`recipe` with each non-finite float value written as ``"inf"``, ``"-inf"`` or ``"nan"``."""
    def enc(v: object) -> object:
        if isinstance(v, float) and not np.isfinite(v):
            return "nan" if v != v else "inf" if v > 0 else "-inf"
        return v
    return {k: enc(v) for k, v in recipe.items()}


def decode_recipe(recipe: object) -> object:
    """A recipe as :func:`encode_recipe` wrote it, its ``"inf"``, ``"-inf"`` and ``"nan"`` values floats again (anything
    that is not a dict is returned as it is, for the format checks to refuse)."""
    if not isinstance(recipe, dict):
        return recipe
    return {k: _NONFINITE[v] if isinstance(v, str) and v in _NONFINITE else v for k, v in recipe.items()}


class CaptureError(DataError):
    """A capture file that is missing, unreadable or not what the capture format says."""


#: Uncompressed arrays of one capture, at most; the committed ones hold under 10 MB.
MAX_CAPTURE_BYTES = 1 << 30


def read_capture(path: str | Path, *, what: str = "replay",
                 need_meta: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of any capture file, checked before anything is decompressed: a readable .npz without
    pickles, each member named once, at most MAX_CAPTURE_BYTES of arrays, and a 'meta' that is a JSON object
    (standard JSON: no NaN, no key twice; ``{}`` where there is none and `need_meta` is false: any file of named
    arrays). what: the command named in errors."""
    path = Path(path)
    if not path.is_file():
        raise CaptureError(f"{what}: {path} is not a file")
    where = f"{what}: {path}"
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            _check_names(infos, where)
            size = sum(i.file_size for i in infos)
            if size > MAX_CAPTURE_BYTES:
                raise CaptureError(f"{where} holds {size / 2**20:.0f} MiB of arrays, more than a capture may "
                                   f"({MAX_CAPTURE_BYTES >> 20} MiB)")
            arrays = {info.filename.removesuffix(".npy"): _member(zf, info, where) for info in infos}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error, RuntimeError, NotImplementedError) as e:
        if isinstance(e, CaptureError):
            raise
        raise CaptureError(f"{where} is not a readable capture (.npz): {e}") from None
    if "meta" not in arrays:
        if not need_meta:
            return {}, arrays
        raise CaptureError(f"{where} has no 'meta' array")
    return _meta(arrays.pop("meta"), where), arrays


def _check_names(infos: list[zipfile.ZipInfo], where: str) -> None:
    """Every member an array, named once (a zip may hold two members of one name: which one is read?)."""
    seen: set[str] = set()
    for info in infos:
        if not info.filename.endswith(".npy"):
            raise CaptureError(f"{where}: member {info.filename!r} is not an array (.npy)")
        name = info.filename.removesuffix(".npy")
        if name in seen:
            raise CaptureError(f"{where}: member {info.filename!r} is in the file twice")
        seen.add(name)


def _meta(a: np.ndarray, where: str) -> dict:
    """The JSON object of a 'meta' member: one string of standard JSON (NaN, Infinity and repeated keys refused)."""
    if a.shape != () or a.dtype.kind not in "US":
        raise CaptureError(f"{where}: 'meta' should be one JSON string, got {a.dtype} {a.shape}")
    text = a.item()
    try:
        text = text.decode() if isinstance(text, bytes) else text
        meta = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_once)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        meta = None
    except _Constant as e:
        try:
            at = _nonfinite_at(json.loads(text))
        except (ValueError, RecursionError):
            at = ""
        raise CaptureError(f"{where}: 'meta' holds {e}{at}, which is not JSON (a capture writes numbers or "
                           "null)") from None
    except ValueError as e:
        raise CaptureError(f"{where}: 'meta' {e}") from None
    if not isinstance(meta, dict):
        raise CaptureError(f"{where}: 'meta' is not a JSON object")
    return meta


class _Constant(ValueError):
    """NaN, Infinity or -Infinity in a meta."""


def _no_constant(name: str) -> None:
    raise _Constant(name)


def _nonfinite_at(value: object, at: str = "") -> str:
    """Where in a parsed meta the first NaN or infinity is (' at cases[0].batch'), or ''."""
    if isinstance(value, float) and not np.isfinite(value):
        return f" at {at.lstrip('.')}"
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _nonfinite_at(v, f"{at}.{k}" if isinstance(k, str) else f"{at}[{k}]")
        if found:
            return found
    return ""


def _once(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"names {k!r} twice in one object")
        out[k] = v
    return out


_CASE_MEMBER = re.compile(r"c(0|[1-9][0-9]*)_(.+)", re.DOTALL)


def split_cases(path: str | Path, meta: dict, arrays: Mapping[str, np.ndarray], *,
                what: str = "replay") -> list[dict[str, np.ndarray]]:
    """A capture's arrays by case: ``c{i}_{name}`` as ``[i][name]``, for every case ``meta["cases"]`` lists.

    A meta without a non-empty list of cases (a replay of nothing is never a pass), a case that is not a JSON
    object, and an array that belongs to no listed case are refused by name, before any work."""
    where = f"{what}: {path}"
    cases = meta.get("cases")
    if not isinstance(cases, list):
        raise CaptureError(f"{where}: 'meta' has no list of cases (got {_short(cases)})")
    if not cases:
        raise CaptureError(f"{where}: 'meta' has no list of cases (an empty one: a replay of nothing is never a "
                           "pass)")
    for i, case in enumerate(cases):
        if not isinstance(case, dict):
            raise CaptureError(f"{where}: case {i} is not a JSON object (got {_short(case)})")
    out: list[dict[str, np.ndarray]] = [{} for _ in cases]
    for key, arr in arrays.items():
        m = _CASE_MEMBER.fullmatch(key)
        if m is None:
            raise CaptureError(f"{where}: member {key!r} belongs to no case (a case's arrays are named "
                               "c{case}_{name})")
        i = int(m[1])
        if i >= len(cases):
            raise CaptureError(f"{where}: member {key!r} belongs to case {i}, but 'meta' lists cases 0 to "
                               f"{len(cases) - 1}")
        out[i][m[2]] = arr
    return out


def case_arrays(path: str | Path, meta: dict, arrays: Mapping[str, np.ndarray],
                stages: Mapping[str, npt.DTypeLike], *, shapes: Callable[[dict], Mapping[str, tuple]] | None = None,
                what: str = "replay") -> list[dict[str, np.ndarray]]:
    """Every case's stages, by case (:func:`split_cases`): each case must hold every one of `stages` (name ->
    dtype), of that dtype (and of the shape ``shapes(case)`` gives it, where given), and nothing else; anything
    else is refused by name, before any work."""
    where = f"{what}: {path}"
    out = split_cases(path, meta, arrays, what=what)
    for i, held in enumerate(out):
        for name, arr in held.items():
            if name not in stages:
                raise CaptureError(f"{where}: case {i}: member 'c{i}_{name}' is not one of its stages "
                                   f"({', '.join(stages)})")
            if arr.dtype != np.dtype(stages[name]):
                raise CaptureError(f"{where}: case {i}: member 'c{i}_{name}' should be {np.dtype(stages[name])}, "
                                   f"got {arr.dtype} {arr.shape}")
        for name in stages:
            if name not in held:
                raise CaptureError(f"{where}: case {i} has no member 'c{i}_{name}'")
        _check_shapes(where, i, meta["cases"][i], held, shapes)
    return out


def _check_shapes(where: str, i: int, case: dict, held: dict[str, np.ndarray],
                  shapes: Callable[[dict], Mapping[str, tuple]] | None) -> None:
    """Each stage of case `i` of the shape its recipe gives it."""
    if shapes is None:
        return
    try:
        want = shapes(case)
    except KeyError as e:
        raise CaptureError(f"{where}: case {i}: its recipe has no {e}") from None
    except (TypeError, ValueError) as e:
        raise CaptureError(f"{where}: case {i}: its recipe does not give the stages' shapes ({e})") from None
    for name, shape in want.items():
        if held[name].shape != tuple(shape):
            raise CaptureError(f"{where}: case {i}: member 'c{i}_{name}' should have shape {tuple(shape)} for its "
                               f"recipe, got {held[name].shape}")


def _short(value: object) -> str:
    """What a meta entry is, briefly (an object or a list by its kind only)."""
    if isinstance(value, (dict, list)):
        return f"a JSON {'object' if isinstance(value, dict) else 'list'} of {len(value)}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> np.ndarray:
    """One .npy member, its header checked against the bytes it holds before the data is read."""
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = header(f)
        except (ValueError, TypeError) as e:
            raise CaptureError(f"{where}: member {info.filename!r} is not npy data ({e})") from None
        if dtype.hasobject:
            raise CaptureError(f"{where}: member {info.filename!r} holds Python objects, which a capture never does")
        if dtype.kind == "V" and (dtype.fields is not None or dtype.itemsize not in (1, 2, 4, 8)):
            raise CaptureError(f"{where}: member {info.filename!r} holds {dtype} records, not the words of a number "
                               "format (raw words are 1, 2, 4 or 8 bytes)")
        count = 1
        for n in shape:
            count *= n
        held = info.file_size - f.tell()
        if count * dtype.itemsize != held:
            raise CaptureError(f"{where}: member {info.filename!r} claims shape {shape} of {dtype} "
                               f"({count * dtype.itemsize} bytes) but holds {held} bytes")
        data = f.read(held)
    a = np.frombuffer(bytearray(data), dtype=dtype)  # writable, as np.load gives it
    return a.reshape(shape[::-1]).T if fortran else a.reshape(shape)


def input_crc(*arrays: np.ndarray) -> int:
    """CRC-32 of the arrays' bytes, in order."""
    crc = 0
    for a in arrays:
        crc = zlib.crc32(np.ascontiguousarray(a).tobytes(), crc)
    return crc


def inputs_digest(q_bits: np.ndarray, kv_bits: np.ndarray) -> str:
    """SHA-256 of the inputs' shapes and bits: what a capture that shares its inputs records of them."""
    h = hashlib.sha256(json.dumps([list(q_bits.shape), list(kv_bits.shape)]).encode())
    h.update(np.ascontiguousarray(q_bits).tobytes())
    h.update(np.ascontiguousarray(kv_bits).tobytes())
    return h.hexdigest()
