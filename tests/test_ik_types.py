"""ik_llama.cpp's own quant types against ik_llama.cpp itself: scripts/ik_fixtures.py had its llama-quantize write a
tensor of each type and dequantize it back to F32; ferry's float64 reference (ferry.quant.dequantize_ik) must give
those values, to float32's rounding of ik's two-step products (its scale times the sub-block's, then the value).
The types ferry reads (Q6_0, IQ4_KS) are rewritten at load as Q8_0 (quant.ik_to_q8_0), checked against that
reference; a whole model as ik quantized it must give ik's llama-perplexity."""

import json
from pathlib import Path

import numpy as np
import pytest

from ferry.errors import FerryError
from ferry.gguf.file import GGUFFile
from ferry.kernels.cpu import native
from ferry.quant import (IK_PER_16, IK_TYPES, IkQuant, Q, _ik_k_parts, dequantize, dequantize_ik, ik_to_q8_0,
                         ik_type_bytes)

FIXTURES = Path(__file__).parent / "fixtures" / "ik"


TRELLIS = ["IQ1_KT", "IQ2_KT", "IQ3_KT", "IQ4_KT"]
TYPES = ["Q6_0", "IQ4_KS", "IQ5_KS", "IQ4_KSS", "IQ3_KS", "IQ2_KS", "IQ2_KL"] + list(IK_PER_16) + TRELLIS


INTERLEAVED = ["IQ4_KS_R4", "IQ4_K_R4", "IQ5_KS_R4", "IQ2_K_R4", "IQ3_K_R4", "IQ5_K_R4",  # ik's own types, and
               "Q8_0_R8", "Q4_K_R4", "Q6_K_R4", "Q5_K_R4", "IQ4_XS_R8", "Q4_0_R8",  # llama.cpp's
               "Q6_0_R4", "IQ4_NL_R4", "MXFP4_R8", "BF16_R16", "Q5_0_R4", "Q3_K_R4", "Q2_K_R4", "IQ3_XXS_R4", "IQ3_S_R4",
               "IQ2_XXS_R4", "IQ2_XS_R4", "IQ2_S_R4"]


@pytest.mark.parametrize("name", TYPES + INTERLEAVED)
def test_the_reference_dequantization_gives_ik_llama_cpps_own_values(name):
    f = np.load(FIXTURES / f"{name}.npz")
    raw_type, ne, raw = int(f["raw_type"]), tuple(int(v) for v in f["ne"]), f["raw"]
    assert IK_TYPES[raw_type][0] == name and raw.nbytes == ik_type_bytes(raw_type, ne)
    theirs = f["ik_values"].astype(np.float64)
    mine = dequantize_ik(raw, raw_type, ne)
    assert mine.shape == theirs.shape == tuple(reversed(ne))
    if name in TRELLIS:  # ik's F32 conversion is its reference dequantizer's; its kernels (ferry's values) scale
        # IQ2_KT's rows by 1.05 and IQ3_KT's by 1.01 more (ikquants/trellis.py)
        from ferry.ikquants.trellis import DEQUANTIZE, IQ4K_VALUES, KERNEL_FACTOR
        from ferry.quant import IQ4K_VALUES as IQ4K

        assert np.array_equal(IQ4K_VALUES, IQ4K[:16])  # its own copy of the table (ikquants stays below quant)

        reference = DEQUANTIZE[raw_type](raw, ne, kernel=False)
        assert np.abs(reference - theirs).max() <= 2e-7 * np.abs(theirs).max()
        factor = float(KERNEL_FACTOR[raw_type])
        assert np.abs(mine - factor * theirs).max() <= 1e-6 * np.abs(theirs).max()
        assert (factor != 1.0) == (name in ("IQ2_KT", "IQ3_KT"))
    elif name == "IQ6_K":  # ik's kernels read its table, its reference dequantizer a cubic: within half a step of it
        d, s, _ = _ik_k_parts(raw, raw_type, ne)
        step = np.abs(np.repeat(d, 16, axis=-1) * s).reshape(mine.shape[0], -1, 1)
        off = np.abs(mine - theirs).reshape(mine.shape[0], -1, 16)
        assert np.all(off <= 0.5 * step + 1e-6 * np.abs(theirs).max()) and off.max() > 0.3 * step.max() / 127
    else:
        assert np.abs(mine - theirs).max() <= 2e-7 * np.abs(theirs).max()
    # real values, not a constant (MXFP4's are few: 8 magnitudes under power-of-two scales)
    assert np.abs(theirs).max() > 0 and len(np.unique(theirs)) > (10 if name == "MXFP4_R8" else 50)
    # flipped nibble bits move values: the comparison can fail
    broken = raw.copy()
    broken[::97] ^= 0x11
    assert np.abs(dequantize_ik(broken, raw_type, ne) - theirs).max() > 1e-3 * np.abs(theirs).max()


def test_a_type_not_yet_dequantized_is_named():
    with pytest.raises(FerryError, match=r"IQ2_BN \(type 135\) is an ik_llama.cpp quant type ferry does not read"):
        dequantize_ik(np.zeros(20, np.uint8), 135, (64, 1))


def test_a_reader_that_asks_keeps_ik_tensors_apart(tmp_path):
    """GGUFFile(ik=True) lists such tensors with their bytes (row metadata counted) instead of refusing the file."""
    from tests.test_gguf_file import _patch, _valid

    path = _valid(tmp_path / "m.gguf", n_tensors=2)
    _patch(path, "t0", 4 + 16, "<I", 134)  # Q8_0 (34 bytes a block) -> IQ1_BN (13 a block + 2 a row): still fits
    f = GGUFFile(path, ik=True)
    assert f.ik_tensors() == ["t0"] and "t0" not in f.tensors and "t1" in f.tensors
    raw_type, ne, data = f.ik_tensor("t0")
    assert raw_type == 134 and ne == (64, 3) and data.nbytes == 3 * (2 + 13)
    with pytest.raises(FerryError, match=r"IQ1_BN \(type 134\), one of ik_llama.cpp's own quant types, which ferry "
                                         r"does not read yet \(of ik's types it reads Q6_0, IQ2_K, IQ3_K, IQ4_K, IQ5_K, IQ6_K, IQ4_KS, "
                                         r"IQ2_KS, IQ4_KSS, IQ5_KS, IQ2_KT, IQ3_KT, IQ4_KT, IQ3_KS, IQ2_KL, IQ1_KT, "
                                         r"IQ4_KS_R4, IQ4_K_R4, IQ5_KS_R4, IQ2_K_R4, IQ3_K_R4, IQ5_K_R4, Q8_0_R8, "
                                         r"Q4_K_R4, Q6_K_R4, Q5_K_R4, IQ4_XS_R8, Q4_0_R8, Q6_0_R4, IQ4_NL_R4, "
                                         r"MXFP4_R8, BF16_R16, Q5_0_R4, Q3_K_R4, Q2_K_R4, IQ3_XXS_R4, IQ3_S_R4, "
                                         r"IQ2_XXS_R4, IQ2_XS_R4, IQ2_S_R4\)"):
        GGUFFile(path)


def _fixture(name):
    f = np.load(FIXTURES / f"{name}.npz")
    return int(f["raw_type"]), tuple(int(v) for v in f["ne"]), f["raw"]


@pytest.mark.parametrize("name", TYPES)
def test_a_tensor_ferry_reads_is_rewritten_as_q8_0_with_its_values(name):
    """Q6_0's values are Q8_0's exactly; the others' sub-block scale (the row's scale times an integer) is kept in
    Q8_0's fp16: at most half an fp16 step (2^-11 of the value) away. The IQn_K types' 32 products of two 16s'
    scales and values are rounded to 255 levels: within half a level (1/254 of the 32's largest) and the scale's fp16
    rounding (2^-11 of it)."""
    raw_type, ne, raw = _fixture(name)
    q8 = ik_to_q8_0(raw, raw_type, ne)
    assert q8.nbytes == int(np.prod(ne)) // 32 * 34 and q8.nbytes > 0
    got, ref = dequantize(q8, Q.Q8_0, ne).astype(np.float64), dequantize_ik(raw, raw_type, ne)
    if name in IK_PER_16:
        largest = np.abs(ref).reshape(-1, 32).max(axis=-1, keepdims=True)
        off = np.abs(got - ref).reshape(-1, 32) / largest
        assert off.max() <= 1 / 254 + 2.0 ** -11 and off.max() > 1 / 1000  # rounded, not kept
    else:
        assert np.all(np.abs(got - ref) <= (0.0 if name == "Q6_0" else 2.0 ** -11) * np.abs(ref))
    assert np.array_equal(q8, native.ik_to_q8_0(raw, raw_type, ne[1], ne[0]))  # C as numpy


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows, blocks", [(1, 1), (7, 3)])
def test_the_c_rewrite_equals_numpys_on_random_bytes(name, rows, blocks):
    """Odd row counts and lengths, every byte value; the row scales spread over fp16's normal and subnormal ranges
    (a sub-block scale of 2^-30 rounds to fp16's smallest steps)."""
    assert native.compiled() is not None, "the test machine has a C compiler"
    raw_type = next(t for t, v in IK_TYPES.items() if v[0] == name)
    _, block, size, meta = IK_TYPES[raw_type]
    rng = np.random.default_rng(raw_type + rows)
    n = block * blocks
    if name == "Q6_0" or name in IK_PER_16:  # an fp16 scale opening each block
        raw = rng.integers(0, 256, (rows * blocks, size), dtype=np.uint8)
        raw[:, :2] = np.float16(rng.uniform(-1, 1, (rows * blocks, 1)) * 2.0 ** rng.integers(-20, 0, (rows * blocks, 1))
                                ).view(np.uint8)
    else:
        raw = rng.integers(0, 256, (rows, meta + blocks * size), dtype=np.uint8)
        scale = 2.0 ** rng.integers(-36 if meta == 4 else -20, 8, (rows, 1)) * rng.uniform(1, 2, (rows, 1))
        raw[:, :meta] = scale.astype(np.float32 if meta == 4 else np.float16).view(np.uint8)
    raw = raw.reshape(-1)
    assert np.array_equal(native.ik_to_q8_0(raw, raw_type, rows, n), ik_to_q8_0(raw, raw_type, (n, rows)))


def test_a_file_of_ik_types_opens_with_them_run_as_q8_0():
    f = GGUFFile(FIXTURES / "qwen3moe-ik.gguf")
    assert {name: n for name, (n, _, _) in f.ik_stored.items()} == {
        "IQ4_KS": 2, "IQ5_KS": 2, "IQ3_KS": 1, "IQ2_KS": 1, "IQ2_KL": 1, "IQ4_KSS": 1, "Q6_0": 1}
    t = f.tensor("blk.0.ffn_up_exps.weight")
    assert t.qtype == Q.Q8_0 and t.stored_as == "IQ4_KS" and t.file_bytes == 16 * 256 * (4 + 136)
    assert f.data(t).nbytes == t.nbytes == 16 * 256 * 8 * 34 and f.data(t) is f.data(t)  # rewritten once


def test_routed_experts_of_a_type_ferrys_kernel_reads_stay_as_they_are():
    f = GGUFFile(FIXTURES / "qwen3moe-ik.gguf", ik_in_place=frozenset({144, 152}))
    t = f.tensor("blk.0.ffn_gate_exps.weight")
    assert t.qtype == IkQuant.IQ4_KS and not t.ik_type and t.nbytes == 16 * 256 * (4 + 136)
    assert f.data(t).nbytes == t.nbytes and "IQ4_KS" not in f.ik_stored  # the file's bytes, nothing rewritten
    assert f.tensor("blk.0.ffn_down_exps.weight").qtype == IkQuant.IQ5_KS
    assert f.tensor("blk.0.attn_q.weight").qtype == Q.Q8_0  # IQ5_KS, not a routed expert: rewritten
    # with IQ5_KS not among the kept types (its down rewritten), the layer's IQ4_KS experts are rewritten too
    g = GGUFFile(FIXTURES / "qwen3moe-ik.gguf", ik_in_place=frozenset({144}))
    assert all(g.tensor(f"blk.0.ffn_{m}_exps.weight").qtype == Q.Q8_0 for m in ("up", "gate", "down"))


@pytest.mark.parametrize("in_ik, down, kept", [(("up", "gate", "down"), Q.Q8_0, True),
                                               (("up", "gate"), Q.Q8_0, False), (("up", "gate"), Q.Q6_K, True),
                                               (("up", "down"), Q.Q8_0, False)])
def test_a_layer_keeps_its_experts_in_place_only_where_the_kernel_reads_them_all(tmp_path, in_ik, down, kept):
    """ferry's kernel takes a layer's three expert matrices together (up and gate of one type, each a type it reads:
    IQ4_KS up and gate with a Q6_K down, as ik's recipes give some layers, stay; beside a Q8_0 down, or with up and
    gate apart, the layer's IQ4_KS ones are rewritten)."""
    from ferry.gguf.writer import TensorSpec, write_gguf
    from ferry.quant import row_bytes
    from tests.test_gguf_file import _patch

    rng = np.random.default_rng(0)
    names = [f"blk.0.ffn_{m}_exps.weight" for m in ("up", "gate", "down")]
    types = [Q.Q8_0, Q.Q8_0, down]
    specs = [TensorSpec(n, q, (256, 8, 2), lambda q=q: rng.integers(0, 127, 16 * row_bytes(q, 256), dtype=np.uint8))
             for n, q in zip(names, types)]
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen3moe", {"qwen3moe.block_count": 1}, specs)
    for m in in_ik:  # type field: after the name, 4 bytes of dimension count and 3 x 8 of dimensions
        _patch(path, f"blk.0.ffn_{m}_exps.weight", 4 + 24, "<I", 144)
    f = GGUFFile(path, ik_in_place=frozenset({144}))
    in_place = {n.split("_")[1] for n in names if isinstance(f.tensor(n).qtype, IkQuant)}
    rewritten = {n.split("_")[1] for n in names if f.tensor(n).ik_type}
    assert in_place == (set(in_ik) if kept else set()) and rewritten == (set() if kept else set(in_ik))


@pytest.mark.parametrize("native_kernels", ["1", "0"])
@pytest.mark.parametrize("model, in_place, from_exact", [("qwen3moe-ik", True, 0.001), ("qwen3moe-ik-k", True, 0.003),
                                                         ("qwen3moe-ik-low", True, 0.001), ("qwen3moe-ik-r4", True, 0.001),
                                                         ("qwen3moe-ik-kl", True, 0.001), ("qwen3moe-ik-k2", True, 0.001),
                                                         ("qwen3moe-ik-k2-r4", True, 0.0015), ("qwen3moe-ik-kt", False, 0.001),
                                                         ("qwen3moe-ik-r8", False, 0.0015), ("qwen3moe-ik-iq2", False, 0.0015)])
def test_ferry_ppl_on_ik_llama_cpps_file_is_its_llama_perplexity(native_kernels, model, in_place, from_exact, capsys,
                                                                  monkeypatch):
    """A file with a tensor of each type ferry reads (qwen3moe-ik: IQ4_KS experts with an IQ5_KS down, read in place by
    ferry's kernel, or rewritten with FERRY_NATIVE=0; qwen3moe-ik-k: IQ4_K experts, read in place as well, and the other IQn_K types,
    rewritten; qwen3moe-ik-low: IQ2_KS experts with an IQ3_KS down, in place too; qwen3moe-ik-r4: IQ4_KS_R4, ik's
    interleaved form, de-interleaved at load; qwen3moe-ik-kl: IQ2_KL experts with an IQ4_KSS down, in place;
    qwen3moe-ik-k2: IQ2_K experts with an IQ3_K down, in place; qwen3moe-ik-k2-r4: the same interleaved as
    IQ2_K_R4 / IQ3_K_R4, beside IQ5_KS_R4 and IQ5_K_R4 attention, rewritten; qwen3moe-ik-kt: the trellis types;
    qwen3moe-ik-r8: llama.cpp's types as ik interleaves them, Q4_K_R4 experts, Q6_K_R4 down, Q8_0_R8, Q5_K_R4,
    IQ4_XS_R8 and Q4_0_R8 attention, de-interleaved into those types and run by ggml and ferry's kernels as any file
    of them: within 0.15% of the exact weights' figure, measured 0.10%; qwen3moe-ik-iq2: IQ2_XXS_R4 experts, an
    IQ2_XS_R4 down and IQ2_S_R4 attention, de-interleaved into llama.cpp's IQ2_XXS / IQ2_XS / IQ2_S for ggml). ik's
    llama-perplexity on the first lies 0.21% from its own figure for the file's exact weights (the F32
    dequantization, where ferry and ik agree to every printed digit): its rounding of activations. ferry's lies within
    0.1% of that figure after every chunk, and within 0.5% of ik's; on the IQn_K file, whose attention, embedding and
    output ferry rounds to Q8_0's levels, within 0.3% of it (measured 0.27%; the IQ2_K_R4 file's IQ5_K attention,
    0.15%; on the F32 file of those weights ferry
    gives ik's exact figure). The F16 model lies 0.5-4% away, at least 4 times each bar, so these bars tell the file's
    weights from others."""
    from ferry import config
    from ferry.cli import main

    monkeypatch.setenv("FERRY_NATIVE", native_kernels)
    config.settings.cache_clear()
    ref = json.loads((FIXTURES / f"{model}.json").read_text())
    ik, exact, f16 = (np.array(ref[k]) for k in ("ppl", "ppl_f32", "ppl_f16"))
    assert np.abs(f16[-1] / exact[-1] - 1) > 4 * from_exact
    code = main(["ppl", "-m", str(FIXTURES / f"{model}.gguf"), "-f", str(FIXTURES / "qwen3moe-ik.txt"),
                 "-c", "128", "--chunks", "8", "-t", "2", "-o", "json"])
    config.settings.cache_clear()
    assert code == 0
    out = capsys.readouterr()
    assert ("read in place by ferry's CPU kernel" in out.err) == (in_place and native_kernels == "1")
    mine = np.array(json.loads(out.out)["chunk_ppl"])
    assert mine.shape == ik.shape
    assert np.abs(mine / exact - 1).max() < from_exact and np.abs(mine / ik - 1).max() < 0.005


def test_an_interleaved_tensor_is_its_plain_types_rows_and_needs_whole_groups_of_4():
    """IQ4_KS_R4 (ik's --repack of IQ4_KS) de-interleaved: the fixture's values are ik's own (the reference test
    above); here the bytes: a plain row's scale, scale bytes and nibble bytes 1 and 9 where ik's repack put them, and
    a row count that is no multiple of 4 is refused as corrupt."""
    from ferry.quant import ik_deinterleave

    raw_type, ne, raw = _fixture("IQ4_KS_R4")
    plain = ik_deinterleave(raw, raw_type, ne).reshape(ne[1], -1)
    groups = raw.reshape(ne[1] // 4, -1)
    for k in range(4):  # row k of group 0: its float32 scale, sub-block 3's scale byte, bytes 1 and 9 of its nibbles
        assert np.array_equal(plain[k, :4], groups[0, 4 * k:4 * k + 4])
        assert plain[k, 4 + 3] == groups[0, 16 + 4 * 3 + k]
        a, b = groups[0, 16 + 32 + 64 * 0 + 4 * k + 1], groups[0, 16 + 32 + 64 * 0 + 16 + 4 * k + 1]
        assert plain[k, 4 + 8 + 9] == (a >> 4 & 0xF) | (b & 0xF0) and plain[k, 4 + 8 + 1] == (a & 0xF) | (b & 0xF) << 4
    with pytest.raises(FerryError, match="not a multiple of 4"):
        ik_deinterleave(raw[:3 * len(raw) // ne[1]], raw_type, (ne[0], 3))


def test_ferry_info_says_how_each_ik_tensor_is_held():
    """`ferry info` on an interleaved file: its experts' type as stored and as run, and the layout they get at load."""
    from ferry.tools.info import tensor_groups

    f = GGUFFile(FIXTURES / "qwen3moe-ik-r4.gguf", ik_in_place=frozenset({144}))
    groups = {g["group"]: g for g in tensor_groups(f, 1, 0, [])}
    experts = groups["blk.*.ffn_up_exps.weight"]
    assert experts["type"] == "IQ4_KS_R4 as IQ4_KS" and experts["cpu_layout"] == "de-interleaved"
    assert groups["output.weight"]["type"] == "Q6_0 as Q8_0" and groups["output.weight"]["cpu_layout"] == "rewritten"
    assert any("de-interleaved at load into IQ4_KS's rows" in line for line in f.ik_lines())


def test_a_rewrite_that_does_not_fit_in_ram_is_refused_in_one_line(monkeypatch, capsys):
    """The Q8_0 rewrites and de-interleaved copies are counted against the RAM available before anything is copied."""
    import ferry.runtime.loader as loader
    from ferry.cli import main

    monkeypatch.setattr(loader, "host_memory", lambda: 64 * 1024)
    code = main(["run", "-m", str(FIXTURES / "qwen3moe-ik-r4.gguf"), "-p", "hi", "-n", "1", "-t", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "Traceback" not in err[0]
    assert "IQ4_KS_R4" in err[0] and "are rewritten (as Q8_0, or de-interleaved) at load" in err[0]
    assert "RAM available; run this file with ik_llama.cpp" in err[0]


def test_weights_no_gpu_kernel_reads_are_refused_there_by_hand_and_keep_the_fit_on_the_cpu(capsys):
    """The IQ2 file's IQ2_XXS / IQ2_XS / IQ2_S weights (de-interleaved from ik's _R4 forms) have no GPU kernel in
    ferry: placed on a GPU by hand, the run is refused in one line naming a weight and what to do (exit 2, before any
    GPU is asked for); where the fit placed them, the run goes to the CPU and says why."""
    from ferry.cli import main
    from ferry.models import load_model
    from ferry.runtime.loader import RunConfig, _gpu_types

    path = FIXTURES / "qwen3moe-ik-iq2.gguf"
    assert main(["run", "-m", str(path), "-ngl", "999", "-p", "hi", "-n", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("ferry: error: blk.0.") and "which ferry's GPU kernels do not read yet" in err
    assert "-ngl 0" in err and "Traceback" not in err
    f = GGUFFile(path)
    model = load_model(f, None, 0)
    cfg, fitted = _gpu_types(f, model, RunConfig(str(path), n_gpu_layers=999), "a fit", by_hand=False)
    assert cfg.n_gpu_layers == 0 and not cfg.wants_gpu and fitted is None
    assert "have no GPU kernel in ferry yet: running on the CPU" in capsys.readouterr().err
    cpu = RunConfig(str(path), n_gpu_layers=0)
    assert _gpu_types(f, model, cpu, None, by_hand=True) == (cpu, None)
