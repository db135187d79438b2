"""The autotuning cache: plain JSON files, one per (device_kind, op), validated on load.

Layout: ``<root>/<device_kind>/<op>.json`` under two roots, the package's shipped
``tokamax_torch/data/autotuning`` and the user's ``<cache_dir>/autotuning``; user entries win.
File format (nothing is ever unpickled or evaluated)::

    {"format": "tokamax_torch.autotuning/1", "op": "ragged_dot", "device_kind": "...",
     "entries": {"<canonical key as JSON>": {
         "results": [{"config": {"block_m": 144, ...}, "median_ms": 1.2, "min_ms": 1.1, "samples": 5}, ...],
         "metadata": {"tokamax_torch": "0.1.0", "torch": "2.13.0", "date": "2026-12-02T..."}}}}

A file that cannot be read, does not parse, has the wrong shape or types, another format
version, or a config the C++ ``Validate()`` rejects gives one warning naming the file and is
ignored as a whole; lookups then fall back to the heuristics. Writers take an exclusive
``fcntl`` lock on ``<op>.json.lock``, merge with what is on disk, and replace the file
atomically (temporary file + ``os.replace``), so concurrent autotuners add up, never clobber.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import pathlib
import tempfile
import time
import warnings
from typing import Optional

FORMAT = "tokamax_torch.autotuning/1"
SHIPPED_ROOT = pathlib.Path(__file__).resolve().parent.parent / "data" / "autotuning"

_warned: set[str] = set()
# Parsed files by path, for lookups: (device, inode, size, mtime_ns) and the entries. A lookup
# per product per call re-read and re-validated both files (295 ms per get_configs with a
# 2000-entry user file, an audit found); a file replaced or rewritten changes its stat.
_parsed: dict = {}


def canonical_key(key: dict) -> str:
    return json.dumps(key, sort_keys=True, separators=(",", ":"))


def _warn_once(path: pathlib.Path, reason: str) -> None:
    if (str(path), reason) in _warned:
        return
    _warned.add((str(path), reason))
    warnings.warn(f"tokamax_torch: ignoring autotuning cache file {path}: {reason}; "
                  "falling back to heuristic configs", RuntimeWarning, stacklevel=3)


class CacheFileError(ValueError):
    pass


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise CacheFileError(message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    """A finite number: Python's json reads `Infinity` and `NaN`, which no timing is."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _unique_pairs(pairs: list) -> dict:
    """An object's members, refusing a repeated name: json.loads would keep the last silently."""
    out = {}
    for name, value in pairs:
        if name in out:
            raise CacheFileError(f"member {name[:200]!r} appears twice in one object")
        out[name] = value
    return out


def parse_file(text: str, op: str, device_kind: str, config_cls) -> dict:
    """Validated entries of one file: {key: {"results": [...], "metadata": {...}}}, configs as
    config_cls instances. Raises CacheFileError saying what is wrong."""
    try:
        data = json.loads(text, object_pairs_hook=_unique_pairs)
    except CacheFileError:
        raise
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, huge ints, deep nesting
        raise CacheFileError(f"not valid JSON ({type(exc).__name__}: {str(exc)[:200]})") from None
    _check(isinstance(data, dict), "the top level must be an object")
    _check(data.get("format") == FORMAT, f"format must be {FORMAT!r}, got {data.get('format')!r}")
    _check(data.get("op") == op, f"op must be {op!r}, got {data.get('op')!r}")
    _check(data.get("device_kind") == device_kind,
           f"device_kind must be {device_kind!r}, got {data.get('device_kind')!r}")
    entries = data.get("entries")
    _check(isinstance(entries, dict), "entries must be an object")
    fields = [f.name for f in dataclasses.fields(config_cls)]
    parsed = {}
    for key, entry in entries.items():
        _check(isinstance(entry, dict), f"entry {key!r} must be an object")
        try:
            key_obj = json.loads(key, object_pairs_hook=_unique_pairs)
        except (ValueError, RecursionError):
            raise CacheFileError(f"key {key[:200]!r} is not a JSON argument spec") from None
        _check(isinstance(key_obj, dict), f"key {key!r} must encode an object")
        results = entry.get("results")
        _check(isinstance(results, list) and results, f"entry {key!r}: results must be a non-empty list")
        clean = []
        for r in results:
            _check(isinstance(r, dict), f"entry {key!r}: each result must be an object")
            cfg = r.get("config")
            _check(isinstance(cfg, dict) and sorted(cfg) == sorted(fields) and all(_is_int(cfg[f]) for f in fields),
                   f"entry {key!r}: config must be an object with int fields {fields}, got {cfg!r}")
            for stat in ("median_ms", "min_ms"):
                _check(_is_number(r.get(stat)) and r[stat] >= 0,
                       f"entry {key!r}: {stat} must be a finite number >= 0, got {r.get(stat)!r}")
            _check(_is_int(r.get("samples")) and r["samples"] > 0, f"entry {key!r}: samples must be a positive int")
            try:
                config = config_cls(**{f: cfg[f] for f in fields})  # runs the C++ Validate()
            except (RuntimeError, TypeError, ValueError) as exc:
                raise CacheFileError(f"entry {key!r}: invalid config {cfg!r}: {exc}") from None
            clean.append({"config": config, "median_ms": float(r["median_ms"]), "min_ms": float(r["min_ms"]),
                          "samples": r["samples"]})
        metadata = entry.get("metadata", {})
        _check(isinstance(metadata, dict), f"entry {key!r}: metadata must be an object")
        canonical = canonical_key(key_obj)
        # Two spellings of one argument spec (member order, spacing) would shadow each other.
        _check(canonical not in parsed, f"key {key!r} repeats an earlier key's argument spec")
        parsed[canonical] = {"results": clean, "metadata": metadata}
    return parsed


def _serialise(entries: dict, op: str, device_kind: str) -> str:
    out = {}
    for key in sorted(entries):
        entry = entries[key]
        results = sorted(entry["results"], key=lambda r: r["median_ms"])
        out[key] = {
            "results": [{"config": dataclasses.asdict(r["config"]), "median_ms": r["median_ms"],
                         "min_ms": r["min_ms"], "samples": r["samples"]} for r in results],
            "metadata": entry.get("metadata", {}),
        }
    return json.dumps({"format": FORMAT, "op": op, "device_kind": device_kind, "entries": out}, indent=1) + "\n"


def _file_mode(path: pathlib.Path) -> int:
    """The existing file's permissions, else 0644 less the umask (mkstemp makes 0600)."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


class ConfigCache:
    """The overlay of the shipped and the user cache for one op on one device kind."""

    def __init__(self, op: str, device_kind: str, config_cls, user_root: Optional[os.PathLike] = None,
                 shipped_root: os.PathLike = SHIPPED_ROOT) -> None:
        from tokamax_torch._settings import config as settings

        self.op = op
        self.device_kind = device_kind
        self.config_cls = config_cls
        user_root = pathlib.Path(user_root if user_root is not None else settings.cache_dir) / "autotuning"
        self.user_path = user_root / device_kind / f"{op}.json"
        self.shipped_path = pathlib.Path(shipped_root) / device_kind / f"{op}.json"

    def _read(self, path: pathlib.Path) -> dict:
        """Entries of `path`; {} when it does not exist. Raises CacheFileError when it is bad."""
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except UnicodeDecodeError:
            raise CacheFileError("not UTF-8 text") from None
        except OSError as exc:
            raise CacheFileError(f"cannot be read ({exc.strerror or exc})") from None
        return parse_file(text, self.op, self.device_kind, self.config_cls)

    def _load(self, path: pathlib.Path) -> dict:
        try:
            stat = path.stat()
        except OSError:
            stat = None
        memo_key = (str(path), self.op, self.device_kind, self.config_cls)
        signature = None if stat is None else (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        memo = _parsed.get(memo_key)
        if signature is not None and memo is not None and memo[0] == signature:
            return memo[1]
        try:
            entries = self._read(path)
        except CacheFileError as exc:
            _warn_once(path, str(exc))
            return {}
        if signature is not None:
            _parsed[memo_key] = (signature, entries)
        return entries

    def entries(self) -> dict:
        merged = dict(self._load(self.shipped_path))
        merged.update(self._load(self.user_path))  # the user directory wins
        return merged

    def lookup(self, key: dict):
        """The fastest config stored under `key`, or None."""
        entry = self.entries().get(canonical_key(key))
        if entry is None:
            return None
        return min(entry["results"], key=lambda r: r["median_ms"])["config"]

    def record(self, new_entries: dict) -> Optional[pathlib.Path]:
        """Merges {key dict as canonical str: entry} into the user file. Returns its path, or None
        (with a warning) when the directory cannot be written."""
        path = self.user_path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_name(path.name + ".lock"), "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                try:
                    current = self._read(path)
                except CacheFileError as exc:
                    # Never merge into (and so erase) a file we cannot parse, e.g. one written
                    # by a newer version: keep it beside the new one.
                    # A fresh name each time (mkstemp): an earlier backup is never overwritten.
                    handle, kept_name = tempfile.mkstemp(prefix=f"{path.name}.bad-{int(time.time())}-",
                                                         dir=path.parent)
                    os.close(handle)
                    kept = pathlib.Path(kept_name)
                    os.replace(path, kept)
                    warnings.warn(f"tokamax_torch: autotuning cache file {path} is invalid ({exc}); "
                                  f"moved it to {kept} and starting a new one", RuntimeWarning, stacklevel=2)
                    current = {}
                for key, entry in new_entries.items():
                    old = current.get(key, {"results": []})
                    by_config = {r["config"]: r for r in old["results"]}
                    by_config.update({r["config"]: r for r in entry["results"]})  # new timings win
                    current[key] = {"results": list(by_config.values()), "metadata": entry.get("metadata", {})}
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
                with contextlib.ExitStack() as stack:
                    stack.callback(lambda: os.path.exists(tmp) and os.unlink(tmp))
                    os.chmod(tmp, _file_mode(path))
                    with os.fdopen(fd, "w", encoding="utf-8") as f:
                        f.write(_serialise(current, self.op, self.device_kind))
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
        except OSError as exc:
            warnings.warn(f"tokamax_torch: cannot write the autotuning cache {path} "
                          f"({exc.strerror or exc}); results are kept in memory only", RuntimeWarning, stacklevel=2)
            return None
        return path
