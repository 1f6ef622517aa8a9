"""ik_llama.cpp's own quant types against ik_llama.cpp itself: scripts/ik_fixtures.py had its llama-quantize write a
tensor of each type and dequantize it back to F32; ferry's float64 reference (ferry.quant.dequantize_ik) must give
those values, to float32's rounding of ik's two-step products (its scale times the sub-block's, then the value)."""

from pathlib import Path

import numpy as np
import pytest

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.quant import IK_TYPES, dequantize_ik, ik_type_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "ik"


@pytest.mark.parametrize("name", ["Q6_0", "IQ4_KS"])
def test_the_reference_dequantization_gives_ik_llama_cpps_own_values(name):
    f = np.load(FIXTURES / f"{name}.npz")
    raw_type, ne, raw = int(f["raw_type"]), tuple(int(v) for v in f["ne"]), f["raw"]
    assert IK_TYPES[raw_type][0] == name and raw.nbytes == ik_type_bytes(raw_type, ne)
    theirs = f["ik_values"].astype(np.float64)
    mine = dequantize_ik(raw, raw_type, ne)
    assert mine.shape == theirs.shape == tuple(reversed(ne))
    assert np.abs(mine - theirs).max() <= 2e-7 * np.abs(theirs).max()
    assert np.abs(theirs).max() > 0 and len(np.unique(theirs)) > 100  # real values, not a constant
    # flipped nibble bits move values: the comparison can fail
    broken = raw.copy()
    broken[::97] ^= 0x11
    assert np.abs(dequantize_ik(broken, raw_type, ne) - theirs).max() > 1e-3 * np.abs(theirs).max()


def test_a_type_not_yet_dequantized_is_named():
    with pytest.raises(FerryError, match=r"IQ2_KL \(type 157\) is an ik_llama.cpp quant type"):
        dequantize_ik(np.zeros(88, np.uint8), 157, (256, 1))


def test_a_reader_that_asks_keeps_ik_tensors_apart(tmp_path):
    """GGUFFile(ik=True) lists such tensors with their bytes (row metadata counted) instead of refusing the file."""
    from tests.test_gguf_file import _patch, _valid

    path = _valid(tmp_path / "m.gguf", n_tensors=2)
    _patch(path, "t0", 4 + 16, "<I", 133)  # Q8_0 (34 bytes a block) -> Q6_0 (26): the data still fits
    f = GGUFFile(path, ik=True)
    assert f.ik_tensors() == ["t0"] and "t0" not in f.tensors and "t1" in f.tensors
    raw_type, ne, data = f.ik_tensor("t0")
    assert raw_type == 133 and ne == (64, 3) and data.nbytes == 3 * 2 * 26
    with pytest.raises(FerryError, match="Q6_0 \\(type 133\\), one of ik_llama.cpp's own quant types"):
        GGUFFile(path)
