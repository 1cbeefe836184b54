"""The sweep store: a folder of results that cannot lose or invent a number.

``results.csv`` holds one line per row; its last field is the CRC-32 of the rest of the line, so a torn or
altered line is recognised and never parsed into a number. Rows are appended one task at a time, with every byte
count checked and an fsync; they are never deleted (a later, smaller request reads a subset). One run at a time
holds the folder's lock. What the store reads back:

- a torn last line (an append cut off by a kill, or a hand edit of the last row) is set aside in
  ``results.rejected`` with a warning when the file is next compacted (also when only the last newline is missing,
  so that no appended row is glued to it);
- any other line that fails its check, or two rows of one key with different values, make the store *corrupt*:
  :class:`StoreCorrupt` names the file and the line, and :meth:`ResultStore.repair` keeps every valid row and
  moves the rest, byte for byte, to ``results.rejected``; ``ResultStore(..., repair=True)`` (the CLI's
  ``--repair``) repairs when it opens the folder, instead of refusing it;
- a file written before the checksums (its header has no ``crc32``) is read only by :meth:`~ResultStore.repair`,
  which keeps its whole lines that parse;
- lines ending in CRLF (a file that went through a Windows checkout) are read as if they ended in LF.
"""

from __future__ import annotations

import csv
import io
import json
import os
import warnings
import zlib
from collections.abc import Iterable, Sequence
from pathlib import Path

from .._files import atomic_write, write_all
from .._validate import DataError

__all__ = ["StoreCorrupt", "StoreLocked", "ResultStore", "atomic_write", "claim_folder", "read_json"]

_CRC = "crc32"


class StoreCorrupt(DataError):
    """A results file with damaged lines other than a torn last one (repairable with ``--repair``)."""


class StoreLocked(RuntimeError):
    """Another run holds the output folder."""


def _line(values: Sequence[str]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="").writerow(values)
    body = buf.getvalue()
    return f"{body},{zlib.crc32(body.encode()):08x}\n"


class _Lock:
    """An exclusive advisory lock on ``DIR/.lock`` (flock; msvcrt on Windows), released when the process ends."""

    def __init__(self, folder: Path):
        self.path = folder / ".lock"
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            _try_lock(self.fd)
        except OSError:
            holder = self.path.read_text().strip() or "another process"
            os.close(self.fd)
            raise StoreLocked(f"out: {folder} is in use by another amla-sim run ({holder}); wait for it to "
                              "finish or choose another --out") from None
        os.ftruncate(self.fd, 0)
        os.write(self.fd, f"pid {os.getpid()}".encode())

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # closing the descriptor releases the lock
            self.fd = -1


try:
    import fcntl

    def _try_lock(fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except ImportError:  # pragma: no cover - Windows
    import msvcrt

    def _try_lock(fd: int) -> None:
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)


class ResultStore:
    """Rows of string fields keyed by the first `key_fields` of them, in ``folder/results.csv``.

    Use as a context manager: entering takes the folder's lock (or raises :class:`StoreLocked`) and loads the
    rows (repairs them, with ``repair=True``); leaving releases the lock.
    """

    def __init__(self, folder: str | Path, fields: Sequence[str], key_fields: int, *, filename: str = "results.csv",
                 repair: bool = False):
        self.folder = Path(folder)
        self.fields = tuple(fields)
        self.key_fields = key_fields
        self.path = self.folder / filename
        self.rows: dict[tuple[str, ...], tuple[str, ...]] = {}
        self._torn_lines: list[bytes] = []  # torn last lines, kept until the next compaction sets them aside
        self._repair_on_open = repair
        self._unterminated = False  # the file does not end with a newline: compact before appending
        self._lock: _Lock | None = None

    # -- the lock ----------------------------------------------------------------------------------------------

    def __enter__(self) -> ResultStore:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = _Lock(self.folder)
        try:
            if self._repair_on_open and self.path.exists():
                kept, rejected = self.repair()
                warnings.warn(f"{self.path}: repaired: {kept} valid rows kept, {rejected} lines set aside in "
                              f"{self.folder / 'results.rejected'}", UserWarning, stacklevel=2)
            else:
                self.load()
        except BaseException:
            self._lock.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    # -- reading -------------------------------------------------------------------------------------------------

    @property
    def torn(self) -> int:
        """Torn last lines read and not yet set aside (the next compaction moves them to ``results.rejected``)."""
        return len(self._torn_lines)

    @property
    def header(self) -> str:
        return ",".join((*self.fields, _CRC)) + "\n"

    def _parse(self, raw: bytes, checked: bool) -> tuple[str, ...] | None:
        """The fields of one line (without its newline), or None when it fails its check."""
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            return None
        if checked:
            body, sep, crc = text.rpartition(",")
            if not sep or len(crc) != 8 or crc != f"{zlib.crc32(body.encode()):08x}":
                return None
            text = body
        try:
            values = next(csv.reader([text]))
        except (csv.Error, StopIteration):
            return None
        return tuple(values) if len(values) == len(self.fields) else None

    def _scan(self) -> tuple[bool, list[tuple[int, bytes, tuple[str, ...] | None]], bool]:
        """(checked, [(line number, raw, fields or None)], ends with a newline) of the file as it is."""
        data = self.path.read_bytes()
        lines = [ln.removesuffix(b"\r") for ln in data.split(b"\n")]
        ended = data.endswith(b"\n")
        if ended:
            lines.pop()
        if not lines:
            return True, [], ended
        head = lines[0].decode(errors="replace")
        if head == self.header.rstrip("\n"):
            checked = True
        elif head == ",".join(self.fields):
            checked = False
        else:
            raise StoreCorrupt(f"{self.path}: the header is {head[:80]!r}, expected {self.header.strip()!r}; "
                               "this is not a results file of this sweep (choose another --out)")
        parsed = [(i + 1, raw, self._parse(raw, checked)) for i, raw in enumerate(lines[1:], start=1)]  # 1-based
        return checked, parsed, ended

    def load(self) -> None:
        """Read every row; drop a torn last line; raise :class:`StoreCorrupt` on any other damage."""
        self.rows, self._torn_lines = {}, []
        if not self.path.exists():
            return
        checked, parsed, ended = self._scan()
        self._unterminated = bool(parsed) and not ended
        if not checked:
            raise StoreCorrupt(f"{self.path}: written without row checksums (by an older amla-sim); run again with "
                               "--repair to convert it (whole lines that parse are kept)")
        for k, (lineno, raw, values) in enumerate(parsed):
            if values is None:
                if not raw.strip():
                    continue  # a blank line holds no data
                if k == len(parsed) - 1 and not ended:
                    self._torn_lines.append(raw)  # an append cut off by a kill
                    continue
                raise StoreCorrupt(f"{self.path}: line {lineno} fails its checksum ({raw[:60]!r}); run again "
                                   "with --repair to keep every valid row and set the others aside")
            self._add(values, where=f"{self.path}: line {lineno}")

    def _add(self, values: tuple[str, ...], *, where: str) -> bool:
        key = values[: self.key_fields]
        old = self.rows.get(key)
        if old is not None and old != values:
            raise StoreCorrupt(f"{where}: a second row for {key} with other values ({old[self.key_fields:]} and "
                               f"{values[self.key_fields:]}); run again with --repair to keep the first")
        self.rows[key] = values
        return old is None

    def repair(self) -> tuple[int, int]:
        """Keep every valid row, move the other lines to ``results.rejected``; (rows kept, lines set aside)."""
        self.rows, self._torn_lines = {}, []
        if not self.path.exists():
            return 0, 0
        try:
            checked, parsed, ended = self._scan()
        except StoreCorrupt:
            checked, parsed, ended = True, [(1, ln, None) for ln in self.path.read_bytes().splitlines()], False
        rejected = []
        for k, (_, raw, values) in enumerate(parsed):
            torn_legacy = not checked and k == len(parsed) - 1 and not ended  # no checksum: trust whole lines
            if values is None or torn_legacy or self.rows.get(values[: self.key_fields], values) != values:
                if raw.strip():
                    rejected.append(raw)
                continue
            self.rows[values[: self.key_fields]] = values
        self._set_aside(rejected)
        self.compact()
        return len(self.rows), len(rejected)

    def _set_aside(self, lines: Sequence[bytes]) -> None:
        """Append `lines` to ``results.rejected`` (fsynced before the results file is rewritten without them)."""
        if lines:
            with open(self.folder / "results.rejected", "ab") as f:
                f.write(b"".join(r + b"\n" for r in lines))
                f.flush()
                os.fsync(f.fileno())

    # -- writing -------------------------------------------------------------------------------------------------

    def compact(self, order: Iterable[tuple[str, ...]] | None = None) -> None:
        """Rewrite the file atomically with every row (sorted by `order` of keys, then the rest by key)."""
        keys = list(order) if order is not None else []
        seen = set(keys)
        keys = [k for k in keys if k in self.rows] + sorted(k for k in self.rows if k not in seen)
        if self._torn_lines:
            self._set_aside(self._torn_lines)
            warnings.warn(f"{self.path}: its last line was torn (a run killed while appending, or a hand edit): set "
                          f"aside in {self.folder / 'results.rejected'}; its task runs again", UserWarning,
                          stacklevel=2)
            self._torn_lines = []
        atomic_write(self.path, self.header + "".join(_line(self.rows[k]) for k in keys))
        self._unterminated = False

    def append(self, rows: Iterable[Sequence[str]]) -> None:
        """Append rows in one checked write, then fsync: a kill leaves whole rows and at most one torn line."""
        new = [tuple(str(v) for v in r) for r in rows]
        for r in new:
            if len(r) != len(self.fields):
                raise ValueError(f"rows: expected {len(self.fields)} fields, got {len(r)}")
            if any("\n" in v or "\r" in v for v in r):
                raise ValueError(f"rows: a field holds a line break: {r}")
        new = [r for r in new if self._add(r, where="append")]  # a row already there is not written twice
        if not new:
            return
        if self._unterminated:  # a torn or unterminated last line would swallow the first new row
            self.compact()
        if not self.path.exists():
            atomic_write(self.path, self.header)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            write_all(fd, "".join(_line(r) for r in new).encode(), self.path)
            os.fsync(fd)
        finally:
            os.close(fd)


def claim_folder(folder: Path, record: dict, *, filename: str, what: str) -> None:
    """Write `record` (what the folder's rows mean) as ``folder/filename`` on first use; afterwards refuse a run
    whose record differs in any of its keys, naming them, rather than mix two runs' rows."""
    path = folder / filename
    if path.exists():
        old = read_json(path, f"the {what} record")
        diff = sorted(k for k in record if old.get(k) != record[k])
        if diff:
            raise ValueError(f"out: {folder} holds the results of another {what} (differs in {', '.join(diff)}); "
                             "choose another --out")
    atomic_write(path, json.dumps(record, indent=1))


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or a clear error naming it."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StoreCorrupt(f"{path}: cannot read {what} ({e})") from None
    if not isinstance(value, dict):
        raise StoreCorrupt(f"{path}: {what} is a JSON {type(value).__name__}, expected an object")
    return value
