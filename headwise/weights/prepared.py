"""Prepared weights on disk: what CausalLM.prepare_weights leaves (decode copies, norms,
biases, and each packed weight in plain layout), so a later start of the same model,
dtype, head order and choice of dense copies skips loading and preparing.

An entry is a directory under <cache dir>/prepared named by a key over everything the
tensors depend on: the model file's identity (path, size, modification time, a hash of
its first MiB), the compute dtype, the layout's head order, torch's version, and the
source of the code that prepares weights (so a change there never reads an old entry).
Files of an entry:
    manifest.json  the config, and per tensor its module, attribute, kind, dtype, shape,
                   file and offset
    kept.bin       tensors the model keeps (4-bit and int8 copies, norms, biases): mapped
                   copy-on-write and used in place, so untouched pages are never read
    dense.bin      packed weights in plain layout: each read once into memory of its
                   own, packed for oneDNN, freed
Raw bytes, not torch.save: writing is bound by the disk either way, and a plain file maps
and reads with no parsing. Entries are written on a background thread after the engine is ready (a process
that ends sooner waits for it),
into a temporary directory renamed into place, so a reader never sees half an entry; the
least recently used entries go beyond PREPARED_BYTES. The cache never fills its disk: an
entry is written only where it leaves min_free_bytes free on the file system (least
recently used entries go first to make room; where they do not, the entry is skipped with
a log line). The directory is safe to delete. An
entry that does not read back (damaged, or it does not fit the model) is deleted and
rebuilt, with one log line.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch import nn

import headwise
from headwise.layers.linear import FusedInt4, Linear
from headwise.layers.norm import RMSNorm
from headwise.models.causal_lm import CausalLM
from headwise.models.config import ModelConfig

log = logging.getLogger("headwise.prepared")

FORMAT = 1
PREPARED_BYTES = 16 << 30  # the cache directory's bound (least recently used go first)
ALIGN = 64
STALE_TMP_S = 3600  # a temporary directory this old is a writer that died
# Space an entry must leave free on its file system. A cache is the last thing that should
# fill a disk: other processes on it (a package install, a second server) fail on a full one.
MIN_FREE_BYTES = 2 << 30
MIN_FREE_FRACTION = 0.05
# The code whose output an entry holds: any change to it is a new key.
_SOURCES = ("layers/linear.py", "layers/int4.py", "layers/embedding.py", "layers/quant.py", "layers/norm.py",
            "models/causal_lm.py", "models/head_order.py", "models/llama.py", "models/gemma3.py",
            "weights/gguf_codes.py", "weights/gguf_loader.py", "weights/prepared.py",
            "kernels/int8_matmul.py", "kernels/weight_codes.py", "kernels/cpu_weights.c")
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                               torch.int32, torch.int64)}


class PreparedError(ValueError):
    """An entry that does not read back into the model."""


def _code_hash() -> str:
    root = Path(headwise.__file__).parent
    h = hashlib.sha256()
    for rel in _SOURCES:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    return h.hexdigest()


def file_identity(path: Path) -> list:
    """A model file's resolved path, size, modification time and the hash of its first MiB."""
    path = path.resolve()
    st = path.stat()
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()
    return [str(path), st.st_size, st.st_mtime_ns, head]


class PreparedWeights:
    """The cache entry of one (model file, dtype, head order, dense copies or not)."""

    def __init__(self, root: Path, model_path: Path, dtype: torch.dtype, head_order: list[list[int]],
                 dense: bool = True) -> None:
        # dense: as CausalLM.prepare_weights' (False: 4-bit weights kept as codes only)
        self.root = Path(root)
        ident = json.dumps({"format": FORMAT, "headwise": headwise.__version__, "torch": torch.__version__,
                            "code": _code_hash(), "file": file_identity(model_path), "dtype": str(dtype),
                            "head_order": head_order, "dense": dense})
        self.key = hashlib.sha256(ident.encode()).hexdigest()[:32]
        self.dir = self.root / self.key
        self.dtype = dtype
        self.writer: threading.Thread | None = None

    # ---- reading ------------------------------------------------------------------
    def load(self, cfg: ModelConfig) -> CausalLM | None:
        """The prepared model, or None where there is no entry. An entry that does not read
        back is deleted (one log line) and None returned: the caller prepares anew."""
        manifest = self.dir / "manifest.json"
        try:
            # Marked recently used before it is read, so that another process's eviction
            # passes it over. One that deletes it all the same leaves what is mapped or
            # open readable; the entry is then prepared anew only if a file was not yet.
            os.utime(manifest)
        except FileNotFoundError:
            return None
        except OSError:  # a read-only cache directory is read all the same
            pass
        t0 = time.perf_counter()
        try:
            model = self._read(cfg, json.loads(manifest.read_text()))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            if not self.dir.exists():  # another process deleted it meanwhile: nothing damaged
                log.info("prepared weights %s were deleted while being read; preparing anew", self.dir)
                return None
            log.warning("prepared weights %s do not read back (%s: %s); deleting them and preparing anew",
                        self.dir, type(e).__name__, e)
            shutil.rmtree(self.dir, ignore_errors=True)
            return None
        log.info("prepared weights read from %s in %.1f s", self.dir, time.perf_counter() - t0)
        return model

    def _read(self, cfg: ModelConfig, manifest: dict) -> CausalLM:
        if manifest.get("format") != FORMAT or manifest.get("config") != _config_json(cfg):
            raise PreparedError("written for another model or format")
        kept = self.dir / "kept.bin"
        mapped = np.memmap(kept, dtype=np.uint8, mode="c") if kept.stat().st_size else np.empty(0, np.uint8)
        with torch.device("meta"):
            model = CausalLM(cfg)
        modules = dict(model.named_modules())
        for m in modules.values():  # nothing is kept but what the entry holds
            for attr in list(m._parameters):
                m._parameters[attr] = None
            for attr in list(m._buffers):
                m._buffers[attr] = None
        for m in list(modules.values()):
            if hasattr(m, "fuse_int4"):
                m.fuse_int4()  # the fused modules, empty (their parts have no weights)
        modules = dict(model.named_modules())
        packs = []
        for e in manifest["tensors"]:
            module = modules[e["module"]]
            if e["kind"] == "packed":
                packs.append((module, e))
                continue
            size = _nbytes(e)
            raw = mapped[e["offset"]: e["offset"] + size]
            if len(raw) != size:
                raise PreparedError("kept.bin is truncated")
            t = torch.from_numpy(raw).view(_DTYPES[e["dtype"]]).view(e["shape"])
            setattr(module, e["attr"], nn.Parameter(t, requires_grad=False) if e["kind"] == "parameter" else t)
        # Each dense weight read into a scratch buffer of its thread's and packed from
        # there: mapped, the whole file would stay resident beside the packed copies, and
        # memory of its own per weight would be faulted in afresh each time (3.1 GB for
        # Qwen2.5-Coder-1.5B). Largest first, so each buffer is allocated once.
        packs.sort(key=lambda me: -_nbytes(me[1]))
        fd, scratch = os.open(self.dir / "dense.bin", os.O_RDONLY), threading.local()
        try:
            with ThreadPoolExecutor(2) as pool:  # reads and oneDNN's reorders release the GIL
                list(pool.map(lambda me: _read_and_pack(fd, *me, scratch), packs))
        finally:
            os.close(fd)
        model.model.embed_tokens.dtype = self.dtype
        _check_complete(model)
        model.model.build_rotary(cfg, "cpu")
        return model.eval()

    # ---- writing ------------------------------------------------------------------
    def save_in_background(self, model: CausalLM) -> None:
        """Write the entry on a thread (engine start does not wait; the process's exit
        does); nothing where it exists or another writer is at it."""
        if self.dir.exists() or any(not _dead(p) for p in self.root.glob(f".tmp-{self.key}-*")):
            return
        # Not a daemon: a process that ends sooner (a one-shot generate) finishes the entry
        # first, so the next start finds it. The tensors are listed here, on the caller's
        # thread: the engine goes on adding buffers to the modules (decode capture's keys).
        self.writer = threading.Thread(target=self._save_logged, args=(_snapshot(model), model.config),
                                       name="prepared-weights")
        self.writer.start()

    def _save_logged(self, tensors: list, cfg: ModelConfig) -> None:
        try:
            self.save(tensors, cfg)
        except OSError as e:  # a full disk, a read-only cache: the engine runs on
            log.warning("prepared weights not saved to %s: %s", self.dir, e)

    def save(self, tensors: list[tuple[str, str, torch.Tensor, str]], cfg: ModelConfig) -> None:
        """Write the entry of a prepared model's tensors (_snapshot)."""
        t0 = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        _sweep(self.root)
        size, margin = sum(t.numel() * t.element_size() for _, _, t, _ in tensors), min_free_bytes(self.root)
        free = _evict(self.root, PREPARED_BYTES, keep=self.dir, need_free=size + margin)
        if free < size + margin:
            log.warning("prepared weights not saved to %s: the entry (%.1f GiB) would leave less than %.1f GiB "
                        "free on its file system (%.1f GiB free)", self.dir, size / 2**30, margin / 2**30,
                        free / 2**30)
            return
        tmp = self.root / f".tmp-{self.key}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            entries = []
            with open(tmp / "kept.bin", "wb") as kept, open(tmp / "dense.bin", "wb") as dense:
                for name, attr, t, kind in tensors:
                    plain = t.to_dense() if kind == "packed" else t.detach().contiguous()
                    entries.append(_write(dense if kind == "packed" else kept, plain, name, attr, kind))
            (tmp / "manifest.json").write_text(json.dumps({"format": FORMAT, "config": _config_json(cfg),
                                                           "tensors": entries}))
            try:
                os.rename(tmp, self.dir)
            except OSError:  # another writer was first
                shutil.rmtree(tmp, ignore_errors=True)
                return
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        size = sum(_nbytes(e) for e in entries)
        log.info("prepared weights saved to %s (%.0f MiB, %.1f s)", self.dir, size / 2**20, time.perf_counter() - t0)
        _evict(self.root, PREPARED_BYTES, keep=self.dir)


def _snapshot(model: CausalLM) -> list[tuple[str, str, torch.Tensor, str]]:
    """(module, attribute, tensor, kind) of every tensor a prepared model runs on: its
    parameters, its buffers (not decode capture's op keys, which each engine assigns) and
    its packed weights ("packed": written in plain layout)."""
    out = []
    for name, m in model.named_modules():
        out += [(name, a, t, "parameter") for a, t in m._parameters.items() if t is not None]
        out += [(name, a, t, "buffer") for a, t in m._buffers.items() if t is not None and a != "op_key"]
        if isinstance(m, Linear) and m.packed is not None:
            out.append((name, "weight", m.packed, "packed"))
    return out


def _nbytes(e: dict) -> int:
    return int(np.prod(e["shape"], dtype=np.int64)) * _DTYPES[e["dtype"]].itemsize


def _read_and_pack(fd: int, module: Linear, e: dict, scratch: threading.local) -> None:
    """Read a packed weight's plain copy into this thread's scratch buffer (grown where too
    small) and pack it; pack() lets go of the plain copy, so the buffer is free again."""
    n = _nbytes(e)
    if getattr(scratch, "buf", None) is None or scratch.buf.numel() < n:
        scratch.buf = torch.empty(n, dtype=torch.uint8)
    raw = scratch.buf[:n]
    if os.preadv(fd, [raw.numpy()], e["offset"]) != n:
        raise PreparedError("dense.bin is truncated")
    module.weight = nn.Parameter(raw.view(_DTYPES[e["dtype"]]).view(e["shape"]), requires_grad=False)
    if not module.pack():
        raise PreparedError(f"{e['module']} did not pack")


def _check_complete(model: CausalLM) -> None:
    """Raise PreparedError unless every layer has what it runs on."""
    embed = model.model.embed_tokens
    fused = {p for m in model.modules() if isinstance(m, FusedInt4) and m.codes_only for p in m.parts}
    missing = [name for name, m in model.named_modules()
               if (isinstance(m, Linear) and m.packed is None and m.weight is None and not m.codes_only
                   and m not in fused)
               or (isinstance(m, RMSNorm) and m.weight is None)]
    if embed.weight is None and embed.int8_codes is None:
        missing.append("model.embed_tokens")
    if missing or any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        raise PreparedError(f"the entry lacks weights of {missing[:3] or 'some layers'}")


def _write(f, t: torch.Tensor, module: str, attr: str, kind: str) -> dict:
    pad = -f.tell() % ALIGN
    f.write(b"\0" * pad)
    offset = f.tell()
    f.write(memoryview(t.view(-1).view(torch.uint8).numpy()) if t.numel() else b"")
    return {"module": module, "attr": attr, "kind": kind, "dtype": str(t.dtype), "shape": list(t.shape),
            "file": os.path.basename(f.name), "offset": offset}


def _config_json(cfg: ModelConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def _dead(tmp: Path) -> bool:
    """Whether a temporary directory's writer is gone: its process (named in the directory,
    .tmp-<key>-<host>-<pid>-<random>) no longer runs on this host, or, on another host
    sharing the cache directory, it is older than STALE_TMP_S. A writer killed part way
    (a process ended with os._exit) would otherwise keep every start from writing the
    entry for an hour."""
    try:
        if time.time() - tmp.stat().st_mtime > STALE_TMP_S:
            return True
    except OSError:
        return True
    parts = tmp.name.split("-", 2)[-1].rsplit("-", 2)  # past ".tmp-<key>-": [host, pid, random]
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    try:
        os.kill(int(parts[1]), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: alive
        pass
    return False


def _sweep(root: Path) -> None:
    """Remove temporary directories of writers that died."""
    for p in root.glob(".tmp-*"):
        if _dead(p):
            shutil.rmtree(p, ignore_errors=True)


def min_free_bytes(root: Path) -> int:
    """Bytes the cache leaves free on root's file system: MIN_FREE_BYTES, or
    MIN_FREE_FRACTION of the file system where that is more."""
    return max(MIN_FREE_BYTES, int(MIN_FREE_FRACTION * shutil.disk_usage(root).total))


def _evict(root: Path, bound: int, keep: Path, need_free: int = 0) -> int:
    """Delete the least recently used entries (by their manifest's time) beyond `bound`
    bytes, and while fewer than `need_free` bytes are free on the file system; returns the
    bytes free after."""
    entries = []
    for d in root.iterdir():
        if d.name.startswith("."):
            continue
        try:
            entries.append(((d / "manifest.json").stat().st_mtime, sum(p.stat().st_size for p in d.iterdir()), d))
        except FileNotFoundError:  # no entry yet, or another process deleted it meanwhile
            continue
    total, free = sum(e[1] for e in entries), shutil.disk_usage(root).free
    # Entries go for room only where deleting them all would make it.
    room = free + sum(size for _, size, d in entries if d != keep) >= need_free
    for _, size, d in sorted(entries):
        if total <= bound and (free >= need_free or not room):
            break
        if d != keep:
            shutil.rmtree(d, ignore_errors=True)
            total, free = total - size, shutil.disk_usage(root).free
    return free
