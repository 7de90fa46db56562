"""Haystack sources: real English prose found offline on every machine of this project,
split into sentences. Each source belongs to one role, and the roles never share one:

- "eval" (the quality suite, headwise eval): Debian's license texts, the docstrings of
  Python's standard library, and the section-1 manual pages;
- "calib" (calibration data, headwise calibrate): the GNU Info manuals and the README
  files of Debian's installed packages.

A calibration sentence that also occurs in an evaluation source is dropped (READMEs quote
licenses), so no sentence is in both. Nothing is downloaded: a missing source is an error
naming the Debian package that ships it.
"""
from __future__ import annotations

import ast
import gzip
import re
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

LICENSE_DIR = Path("/usr/share/common-licenses")
LICENSE_FILES = ["GPL-3", "Apache-2.0", "GFDL-1.3", "MPL-2.0", "LGPL-2.1", "GPL-2", "Artistic", "CC0-1.0"]
MAN_DIR = Path("/usr/share/man/man1")
# Common programs' pages (coreutils, findutils, grep, sed, tar, bash, ...); those present are read.
MAN_PAGES = ["bash", "ls", "cp", "mv", "rm", "grep", "find", "tar", "gzip", "sed", "make", "git", "ssh",
             "curl", "wget", "diff", "sort", "uniq", "date", "chmod", "chown", "ln", "du", "df", "ps", "less",
             "man", "xargs", "cat", "head", "tail", "cut", "tr", "tee", "env", "nice", "kill", "python3",
             "perl", "zip", "unzip", "bzip2", "xz", "dd", "install", "stat", "touch", "split", "timeout"]
INFO_DIR = Path("/usr/share/info")
DOC_DIR = Path("/usr/share/doc")
# Standard-library modules whose docstrings are read (by parsing their source; nothing imported).
STDLIB_MODULES = ["argparse", "asyncio/events", "asyncio/tasks", "collections/__init__", "concurrent/futures/_base",
                  "configparser", "contextlib", "csv", "dataclasses", "datetime", "decimal", "difflib",
                  "email/message", "enum", "fractions", "functools", "heapq", "http/client", "http/server",
                  "inspect", "ipaddress", "json/__init__", "logging/__init__", "mailbox", "multiprocessing/pool",
                  "pathlib", "pickle", "random", "shutil", "smtplib", "socket", "statistics", "string",
                  "subprocess", "tarfile", "tempfile", "textwrap", "threading", "typing", "unittest/case",
                  "urllib/request", "uuid", "warnings", "weakref", "zipfile"]

MIN_WORDS, MAX_WORDS = 5, 60


@dataclass(frozen=True)
class Source:
    name: str
    role: str                       # "eval" | "calib"
    read: Callable[[], list[str]]   # -> documents (plain text)
    package: str                    # what ships it, for the error when missing


def _gz_text(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", errors="replace")


def _licenses() -> list[str]:
    return [(LICENSE_DIR / f).read_text(errors="replace") for f in LICENSE_FILES if (LICENSE_DIR / f).is_file()]


def _pydoc() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for mod in STDLIB_MODULES:
        path = root / f"{mod}.py"
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(errors="replace"))
        for node in [tree] + [n for n in ast.walk(tree)
                              if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]:
            doc = ast.get_docstring(node)
            if doc:
                # Keep prose paragraphs: drop doctest and indented (code, option list) lines.
                docs.append("\n".join(l for l in doc.splitlines()
                                      if l.strip() and not l.startswith((" ", "\t", ">>>", "..."))))
    return docs


_ROFF_ESCAPES = [(r"\\f(\[[^\]]*\]|\(..|.)", ""), (r"\\\(em|\\\(en", "-"), (r"\\\(.{2}", ""),
                 (r"\\\*(\[[^\]]*\]|\(..|.)", ""), (r"\\-", "-"), (r"\\e", "\\\\"), (r"\\[&|^%:]", ""),
                 (r"\\s[+-]?\d", ""), (r'\\"', "")]


def roff_text(src: str) -> str:
    """Plain text of a man page's roff source: request lines dropped except the text of
    font macros (.B, .I, .BR, ...), escapes removed."""
    out = []
    for line in src.splitlines():
        if line.startswith((".", "'")):
            m = re.match(r"[.'](B|I|BR|RB|IR|RI|BI|IB|SM|SB)\s+(.*)", line)
            if not m:
                out.append("\n")  # a paragraph or section break
                continue
            line = " ".join(t.strip('"') for t in re.findall(r'"[^"]*"|\S+', m.group(2)))
        for pat, rep in _ROFF_ESCAPES:
            line = re.sub(pat, rep, line)
        out.append(line)
    return " ".join(out)


def _man() -> list[str]:
    return [roff_text(_gz_text(MAN_DIR / f"{p}.1.gz")) for p in MAN_PAGES if (MAN_DIR / f"{p}.1.gz").is_file()]


def _info() -> list[str]:
    docs = []
    for path in sorted(INFO_DIR.glob("*.info*.gz")):
        text = _gz_text(path)
        # Drop node headers, menus and cross-reference lines; keep paragraphs.
        keep = [l for l in text.splitlines()
                if not l.startswith(("File:", "* ", "\x1f", "Tag Table", "End Tag", "Node:", "   "))]
        docs.append("\n".join(keep))
    return docs


def _readmes() -> list[str]:
    return [_gz_text(p) for p in sorted(DOC_DIR.glob("*/README*")) if p.is_file()]


SOURCES = {s.name: s for s in [
    Source("licenses", "eval", _licenses, "base-files (/usr/share/common-licenses)"),
    Source("pydoc", "eval", _pydoc, "Python's standard library"),
    Source("man", "eval", _man, "man-db / manpages (/usr/share/man/man1)"),
    Source("info", "calib", _info, "the GNU packages' Info manuals (/usr/share/info)"),
    Source("readme", "calib", _readmes, "Debian packages' documentation (/usr/share/doc/*/README*)"),
]}
EVAL_SOURCES = tuple(n for n, s in SOURCES.items() if s.role == "eval")
CALIB_SOURCES = tuple(n for n, s in SOURCES.items() if s.role == "calib")


def split_sentences(text: str) -> list[str]:
    """Sentences of MIN_WORDS..MAX_WORDS words that read as prose (mostly words of letters,
    no addresses), each ending in one space."""
    text = re.sub(r"\s+", " ", text)
    out = []
    for s in re.split(r"(?<=[.;:?!])\s+", text):
        words = s.split()
        if not MIN_WORDS <= len(words) <= MAX_WORDS or "://" in s or "@" in s:
            continue
        if sum(w.strip(",.;:()'\"?!").isalpha() for w in words) < 0.8 * len(words):
            continue
        out.append(s.strip() + " ")
    return out


@lru_cache(maxsize=None)
def sentences(name: str) -> tuple[str, ...]:
    """The prose sentences of source `name`, in document order, without duplicates."""
    if name not in SOURCES:
        raise ValueError(f"unknown haystack source {name!r}; choose from {', '.join(SOURCES)}")
    src = SOURCES[name]
    out = list(dict.fromkeys(s for doc in src.read() for s in split_sentences(doc)))
    if src.role == "calib":
        held_out = set().union(*(sentences(e) for e in EVAL_SOURCES))
        out = [s for s in out if s not in held_out]
    if len(out) < 200:
        raise FileNotFoundError(f"haystack source {name!r} found only {len(out)} sentences; it needs "
                                f"{src.package}")
    return tuple(out)
