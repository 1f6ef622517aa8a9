"""The streamer's expert staging: experts copied from registered host memory into one compact buffer, spread to the
split layout's slots on their own stream, give the bytes Split.of gives, even when stagings follow one another without
the host waiting; one set of slots serves every layer, each layer's spreading waiting for the release of the one
before."""

import mmap

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from ferry.weight import Weight
from ferry.kernels.cuda.layout import Split
from ferry.backends.streamer import Streamer

N_EXPERT, ROWS, COLS = 64, 768, 2048  # Qwen3-30B-A3B's expert shape: 56 MB per tensor at Q4_0


def _layer(seed: int) -> list[Weight]:
    rng = np.random.default_rng(seed)
    per = ROWS * COLS // 32 * 18
    out = []
    for role in ("gate", "up", "down"):
        data = rng.integers(0, 256, N_EXPERT * per, dtype=np.uint8)
        data.reshape(-1, 18)[:, 1] &= 0x3B  # finite f16 scales
        out.append(Weight(f"blk.{seed}.ffn_{role}_exps.weight", Q.Q4_0, (COLS, ROWS, N_EXPERT), data))
    return out


@pytest.mark.parametrize("hit", [list(range(N_EXPERT)), [0, 3, 4, 5, 17, 40, 63]], ids=["all", "some"])
def test_back_to_back_stagings_fill_their_slots_with_the_file_bytes(hit):
    layers = [_layer(i) for i in range(4)]
    streamer = Streamer(torch.device("cuda"), [w for layer in layers for w in layer])
    assert streamer.pinned, streamer.why
    staged, got = [], None
    stream = torch.cuda.current_stream()
    for i, layer in enumerate(layers):  # as MoE layers run: stage, compute, release; no host wait in between
        staged.append(streamer.stage_experts(layer, hit, ("moe", i % 2)))
        for _, done in staged[-1]:
            stream.wait_event(done)
        if i == 2:  # what layer 2 holds, read on the compute stream before its release lets layer 3 refill the slots
            got = [[s.expert(e).qs.clone() for e in hit] for s, _ in staged[-1]]
        streamer.release(("moe", i % 2))
    torch.cuda.synchronize()
    for s_got, w in zip(got, layers[2]):
        full = Split.of(w.host_tensor().cuda(), w.qtype, w.ne)
        for g, e in zip(s_got, hit):
            assert torch.equal(g, full.expert(e).qs), f"{w.name} expert {e}"
    for (s, _), w in zip(staged[3], layers[3]):
        full = Split.of(w.host_tensor().cuda(), w.qtype, w.ne)
        for e in hit:
            assert torch.equal(s.expert(e).qs, full.expert(e).qs) and torch.equal(
                s.expert(e).d.view(torch.int16), full.expert(e).d.view(torch.int16)), f"{w.name} expert {e}"
    # one set of slots (a layer) and the one buffer copies land in (a tensor), as memory_plan counts them
    tensor = layers[0][0].data.nbytes
    assert streamer.staging_bytes() == 3 * tensor + tensor
    assert all(s is t for (s, _), (t, _) in zip(staged[0], staged[3]))
    streamer.close()


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_0, Q.Q4_0, Q.Q6_K)], ids=["q4_k_m", "mixed"])
def test_compact_stagings_hold_the_hit_experts_blocks_in_order(qtypes):
    """A layer with any expert tensor of a type the split kernels do not read (a Q4_K_M file's) stays as copied
    (streamer.Compact): each tensor's hit experts' GGUF blocks in order, in the staging set's own buffer, and a map
    from expert to place; back to back, slots alternating, as in a run (the two sets' buffers apart)."""
    from ferry.kernels.cuda.layout import Blocks
    from ferry.quant import quantize

    rng = np.random.default_rng(3)
    rows, cols, n_expert = 256, 512, 12

    def layer(seed):
        out = []
        for role, q in zip(("gate", "up", "down"), qtypes):
            shape = (n_expert, cols, rows) if role == "down" else (n_expert, rows, cols)
            data = quantize(rng.standard_normal(shape).astype(np.float32), q).reshape(-1)
            # in pages of their own, as a file's mmap: a heap array's pages, registered, were trimmed and mapped
            # anew under the registration (a later copy into them failed: invalid argument)
            own = np.frombuffer(mmap.mmap(-1, data.nbytes), dtype=np.uint8)
            own[:] = data
            out.append(Weight(f"blk.{seed}.ffn_{role}_exps.weight", q, tuple(reversed(shape)), own))
        return out

    layers = [layer(i) for i in range(3)]
    streamer = Streamer(torch.device("cuda"), [w for ws in layers for w in ws])
    assert streamer.pinned, streamer.why
    hit = [1, 2, 3, 7, 11]
    staged = []
    for i, ws in enumerate(layers):
        staged.append(streamer.stage_experts(ws, hit, ("moe", i % 2), expand=True))
        for _, done in staged[-1]:
            torch.cuda.current_stream().wait_event(done)
        if i >= 1:
            streamer.release(("moe", (i - 1) % 2))
    torch.cuda.synchronize()
    for ws, got in zip(layers[1:], staged[1:]):
        for w, (s, _) in zip(ws, got):
            want = torch.from_numpy(np.asarray(w.data).reshape(n_expert, -1)[hit].reshape(-1).copy())
            assert isinstance(s.w, Blocks) and s.w.qtype == w.qtype and s.w.ne == (*w.ne[:2], len(hit)), w.name
            assert torch.equal(s.w.raw.cpu(), want), w.name
            assert s.slot_of.tolist() == [hit.index(e) if e in hit else -1 for e in range(n_expert)]
    ptrs = [{s.w.raw.data_ptr() for s, _ in got} for got in staged[1:]]
    assert len(ptrs[0] | ptrs[1]) == 6  # a buffer per tensor and set
    streamer.close()
