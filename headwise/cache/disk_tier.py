"""A second KV tier in a directory (with an optional host-memory tier in front of it:
pinned on CUDA): cached prefixes evicted from the pool are written here and read back
instead of recomputed, also by a later process.

One file per entry: a full-head block ("b-" file) or a window-state snapshot ("s-"), keyed by
the chained hash of the tokens it stands for, in safetensors with the bytes of its pages
and, as metadata, the tokens of its last block, the previous block's hash, the
fingerprint and a checksum, so that a hit is verified against the prompt's tokens and
the bytes against the checksum, never trusted on the hash alone. Files live under
DIR/<fingerprint>/, the fingerprint naming the model file, the layout, the KV dtype,
the block size and the format version; other fingerprints are ignored.

Writes are atomic (a temporary file, then rename) and run on a background thread; reads
run on READERS others, into host memory, where the cache manager picks them up on a later step
(a request waiting for its prefix stays queued while others run). Anything unreadable,
truncated or not matching its checksum is skipped (one warning, a counter) and the
prefix is recomputed; a full disk stops offloading with one warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save

from headwise.cache.block_pool import PageKind

FORMAT_VERSION = "1"
# Reader threads: a cached document is hundreds of one-block files, whose opening and
# checksumming overlap across threads (hashlib and file reads release the GIL).
READERS = 4
log = logging.getLogger("headwise.kv_tier")


@dataclass
class TierEntry:
    """What an entry holds besides its bytes: enough to verify it against a prompt."""
    kind: PageKind         # a full-head block or a window-state snapshot
    key: int               # chained hash of the tokens up to the end of its last block
    parent: int            # hash of the block before it (the chain's root for the first)
    tokens: list[int]      # tokens of its last block


@dataclass
class TierStats:
    entries: int = 0
    bytes: int = 0
    host_entries: int = 0  # the host-memory tier in front of the directory
    host_bytes: int = 0
    hit_tokens: int = 0    # prompt tokens served from this tier
    served: dict = field(default_factory=lambda: {"host": 0, "disk": 0})  # entries, by tier
    errors: int = 0        # unreadable / corrupted entries skipped, failed writes
    read_seconds: list[float] = field(default_factory=list)   # drained by the metrics
    write_seconds: list[float] = field(default_factory=list)


def fingerprint(model_id: str, cache_root: int, kv_dtype: str, block_size: int) -> str:
    text = json.dumps([model_id, cache_root, kv_dtype, block_size, FORMAT_VERSION])
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


class DiskTier:
    def __init__(self, directory: str | Path | None, max_bytes: int, fp: str, host_bytes: int = 0,
                 pin: bool = False) -> None:
        """directory None: the host-memory tier alone (host_bytes > 0)."""
        self.root = Path(directory) if directory is not None else None
        self.dir = self.root / fp if self.root is not None else None
        self.max_bytes = max_bytes
        self.fingerprint = fp
        self.host_bytes, self.pin = host_bytes, pin
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[str, int], int] = OrderedDict()  # LRU: (kind, key) -> bytes
        self._ram: OrderedDict[tuple[str, int], tuple[TierEntry, torch.Tensor]] = OrderedDict()  # host tier
        self._host: dict[tuple[str, int], tuple[TierEntry, torch.Tensor]] = {}  # read, awaiting use
        self._pending: set[tuple[str, int]] = set()
        self._writing: set[tuple[str, int]] = set()
        # Evicted entries whose bytes the engine has still to copy out (put() follows)
        self._queued: set[tuple[str, int]] = set()
        self._writes_on = self.dir is not None
        self._closed = False
        self._progress = threading.Event()  # set whenever a read finishes
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._scan()
        self._wq: queue.Queue = queue.Queue()
        self._rq: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._writer, name="headwise-kv-writer", daemon=True)]
        self._threads += [threading.Thread(target=self._reader, name=f"headwise-kv-reader-{i}", daemon=True)
                          for i in range(READERS)]
        for t in self._threads:
            t.start()

    # ---- index ----------------------------------------------------------------------
    def _path(self, kind: PageKind, key: int) -> Path:
        return self.dir / f"{kind}-{key:016x}.safetensors"

    def _scan(self) -> None:
        others = [p.name for p in self.root.iterdir() if p.is_dir() and p.name != self.fingerprint]
        if others:
            log.warning("kv tier %s: ignoring %d entry folder(s) of another model, layout, dtype or "
                        "format: %s", self.root, len(others), ", ".join(sorted(others)[:3]))
        files = []
        for p in self.dir.iterdir():
            if p.name.startswith(".tmp-"):
                p.unlink(missing_ok=True)  # a write that did not finish
                continue
            try:
                kind, hexkey = p.stem.split("-")
                files.append((p.stat().st_mtime, PageKind(kind), int(hexkey, 16), p.stat().st_size))
            except (ValueError, OSError):
                continue
        for _, kind, key, size in sorted(files):  # oldest first: LRU order
            self._index[(kind, key)] = size
        self.stats.entries, self.stats.bytes = len(self._index), sum(self._index.values())
        self._shrink()

    def has(self, kind: PageKind, key: int) -> bool:
        item = (kind, key)
        with self._lock:
            return not self._closed and (item in self._ram or item in self._index or item in self._writing
                                         or item in self._queued)

    def _forget(self, item: tuple[str, int]) -> None:
        size = self._index.pop(item, None)
        if size is not None:
            self.stats.entries -= 1
            self.stats.bytes -= size
        self._path(*item).unlink(missing_ok=True)

    def _shrink(self) -> None:
        while self._index and self.stats.bytes > self.max_bytes:
            self._forget(next(iter(self._index)))

    def drop(self, kind: PageKind, key: int, why: str) -> None:
        """An entry failed verification: skip it for good."""
        log.warning("kv tier: skipping %s entry %016x (%s); its prefix will be recomputed", kind, key, why)
        with self._lock:
            self.stats.errors += 1
            self._host.pop((kind, key), None)
            self._drop_ram((kind, key))
            if self.dir is not None:
                self._forget((kind, key))

    # ---- writes -----------------------------------------------------------------------
    def expect(self, kind: PageKind, key: int) -> None:
        """An entry was evicted and its put() follows once the engine has copied its pages
        (before the next step): a prefix lookup meanwhile waits for it instead of finding
        its chain broken."""
        with self._lock:
            if not self._closed and (self._writes_on or self.host_bytes):
                self._queued.add((kind, key))

    def put(self, entry: TierEntry, data: torch.Tensor) -> None:
        """Keep an entry in the host tier and queue it for writing (data: its pages'
        bytes, uint8 on the CPU)."""
        item = (entry.kind, entry.key)
        with self._lock:
            self._queued.discard(item)
            if self.host_bytes and item not in self._ram and data.numel() <= self.host_bytes:
                self._ram[item] = (entry, data.pin_memory() if self.pin else data)
                self.stats.host_entries += 1
                self.stats.host_bytes += data.numel()
                while self.stats.host_bytes > self.host_bytes:
                    self._drop_ram(next(iter(self._ram)))
            if self._closed or not self._writes_on or item in self._index or item in self._writing:
                return
            self._writing.add(item)
        self._wq.put((entry, data))

    def _drop_ram(self, item: tuple[str, int]) -> None:
        got = self._ram.pop(item, None)
        if got is not None:
            self.stats.host_entries -= 1
            self.stats.host_bytes -= got[1].numel()

    def _writer(self) -> None:
        while True:
            job = self._wq.get()
            if job is None:
                self._wq.task_done()
                return
            entry, data = job
            try:
                self._write(entry, data)
            finally:
                with self._lock:
                    self._writing.discard((entry.kind, entry.key))
                self._wq.task_done()

    def _write(self, entry: TierEntry, data: torch.Tensor) -> None:
        t0 = time.perf_counter()
        meta = {"kind": str(entry.kind), "key": str(entry.key), "parent": str(entry.parent),
                "tokens": json.dumps(entry.tokens), "fingerprint": self.fingerprint,
                "format": FORMAT_VERSION, "checksum": _checksum(data)}
        blob = save({"kv": data.contiguous()}, metadata=meta)
        final = self._path(entry.kind, entry.key)
        tmp = self.dir / f".tmp-{uuid.uuid4().hex}"
        try:
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, final)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            with self._lock:
                self.stats.errors += 1
                if self._writes_on:
                    self._writes_on = False
                    log.warning("kv tier %s: writing failed (%s); offloading stops, serving goes on", self.dir, e)
            return
        with self._lock:
            self._index[(entry.kind, entry.key)] = len(blob)
            self.stats.entries += 1
            self.stats.bytes += len(blob)
            self._shrink()
            self.stats.write_seconds.append(time.perf_counter() - t0)

    # ---- reads ------------------------------------------------------------------------
    def ready(self, kind: PageKind, key: int) -> tuple[TierEntry, torch.Tensor] | None:
        """An entry already read into host memory, or None."""
        with self._lock:
            return self._host.get((kind, key))

    def prefetch(self, items: list[tuple[str, int]]) -> None:
        """Bring entries to host memory: at once from the host tier, else read from disk in
        the background (ready() tells when)."""
        with self._lock:
            if self._closed:
                return
            for i in items:
                if i in self._ram and i not in self._host:
                    self._host[i] = self._ram[i]
                    self._ram.move_to_end(i)
                    self.stats.served["host"] += 1
            new = [i for i in items if i not in self._host and i not in self._pending and i in self._index]
            self._pending.update(new)
        for i in new:
            self._rq.put(i)

    def is_pending(self, kind: PageKind, key: int) -> bool:
        """Being read, or still to be copied out or written (readable once written)."""
        with self._lock:
            return (kind, key) in self._pending or (kind, key) in self._writing or (kind, key) in self._queued

    def release(self, kind: PageKind, key: int) -> None:
        """The entry went back into the pool: drop its host copy, mark it recently used."""
        with self._lock:
            self._host.pop((kind, key), None)
            if (kind, key) in self._index:
                self._index.move_to_end((kind, key))

    def count_hit(self, tokens: int) -> None:
        with self._lock:
            self.stats.hit_tokens += tokens

    def _reader(self) -> None:
        while True:
            item = self._rq.get()
            if item is None:
                return
            t0 = time.perf_counter()
            try:
                got = self._read(*item)
            except Exception as e:  # any damage: skip it, recompute
                with self._lock:
                    self._pending.discard(item)
                self.drop(*item, f"unreadable: {type(e).__name__}: {e}")
                self._progress.set()
                continue
            with self._lock:
                self._pending.discard(item)
                self._host[item] = got
                self.stats.served["disk"] += 1
                self.stats.read_seconds.append(time.perf_counter() - t0)
            self._progress.set()

    def _read(self, kind: PageKind, key: int) -> tuple[TierEntry, torch.Tensor]:
        with safe_open(str(self._path(kind, key)), framework="pt") as f:
            meta = f.metadata() or {}
            data = f.get_tensor("kv")
        if (meta.get("fingerprint"), meta.get("format"), meta.get("kind"), meta.get("key")) != (
                self.fingerprint, FORMAT_VERSION, kind, str(key)):
            raise ValueError("metadata does not match the file name or this engine")
        if meta.get("checksum") != _checksum(data):
            raise ValueError("checksum mismatch")
        return TierEntry(kind, key, int(meta["parent"]), json.loads(meta["tokens"])), data

    def wait_for_reads(self, timeout: float) -> None:
        """Block until a read finishes (or `timeout`), if any is under way: an engine with
        nothing else to run waits here instead of spinning against the reader threads."""
        with self._lock:
            if not self._pending:
                return
        self._progress.wait(timeout)
        self._progress.clear()

    # ---- life -------------------------------------------------------------------------
    def flush(self) -> None:
        """Wait until every queued write is on disk."""
        self._wq.join()

    def close(self) -> None:
        """Finish the writes and stop the threads; later puts are ignored."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        self._wq.put(None)
        for _ in range(READERS):
            self._rq.put(None)
        for t in self._threads:
            t.join(timeout=10)


def _checksum(data: torch.Tensor) -> str:
    return hashlib.blake2b(data.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
