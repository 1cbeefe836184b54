"""The capture file, one format for every kernel: an ``.npz`` of named arrays (raw bits) and a JSON ``meta``.

:func:`read_capture` checks a file before anything is decompressed (a readable zip without pickles, a bounded
size, a JSON object for ``meta``). Inputs are mostly not stored: a capture names the recipe that rebuilds them
and their CRC (:func:`input_crc`), or a shared inputs file and its SHA-256 (:func:`inputs_digest`), so that a
replay proves it rebuilt the very inputs the device saw.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
import zlib
from pathlib import Path

import numpy as np

from .._validate import DataError

__all__ = ["CaptureError", "MAX_CAPTURE_BYTES", "read_capture", "input_crc", "inputs_digest"]


class CaptureError(DataError):
    """A capture file that is missing, unreadable or not what the capture format says."""


#: Uncompressed arrays of one capture, at most; the committed ones hold under 10 MB.
MAX_CAPTURE_BYTES = 1 << 30


def read_capture(path: str | Path, *, what: str = "replay",
                 need_meta: bool = True) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of any capture file, checked before anything is decompressed: a readable .npz without
    pickles, at most MAX_CAPTURE_BYTES of arrays, and a 'meta' that is a JSON object (``{}`` where there is none
    and `need_meta` is false: any file of named arrays). what: the command named in errors."""
    path = Path(path)
    if not path.is_file():
        raise CaptureError(f"{what}: {path} is not a file")
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
            size = sum(i.file_size for i in infos)
            if size > MAX_CAPTURE_BYTES:
                raise CaptureError(f"{what}: {path} holds {size / 2**20:.0f} MiB of arrays, more than a capture may "
                                   f"({MAX_CAPTURE_BYTES >> 20} MiB)")
            arrays = {info.filename.removesuffix(".npy"): _member(zf, info, f"{what}: {path}") for info in infos}
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, zlib.error) as e:
        raise CaptureError(f"{what}: {path} is not a readable capture (.npz): {e}") from None
    if "meta" not in arrays:
        if not need_meta:
            return {}, arrays
        raise CaptureError(f"{what}: {path} has no 'meta' array")
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except json.JSONDecodeError:
        meta = None
    if not isinstance(meta, dict):
        raise CaptureError(f"{what}: {path}: 'meta' is not a JSON object")
    return meta, arrays


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> np.ndarray:
    """One .npy member, its header checked against the bytes it holds before the data is read."""
    if not info.filename.endswith(".npy"):
        raise CaptureError(f"{where}: member {info.filename!r} is not an array (.npy)")
    with zf.open(info) as f:
        try:
            version = np.lib.format.read_magic(f)
            header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                      else np.lib.format.read_array_header_2_0)
            shape, fortran, dtype = header(f)
        except ValueError as e:
            raise CaptureError(f"{where}: member {info.filename!r} is not npy data ({e})") from None
        if dtype.hasobject:
            raise CaptureError(f"{where}: member {info.filename!r} holds Python objects, which a capture never does")
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
