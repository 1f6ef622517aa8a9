"""The streamer's expert staging: experts copied from registered host memory into alternating slot sets, spread to
the split layout on their own stream, give the bytes Split.of gives, even when stagings follow one another without
the host waiting (they share the compact buffers the copies land in)."""

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from ferry.ops import Weight
from ferry.ops.cuda.kernels import Split
from ferry.runtime.streamer import Streamer

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
    staged = []
    for i, layer in enumerate(layers):  # slots alternate, as MoE layers do; no host wait in between
        slot = ("moe", i % 2)
        staged.append(streamer.stage_experts(layer, hit, slot))
        stream = torch.cuda.current_stream()
        for _, done in staged[-1]:
            stream.wait_event(done)
        if i >= 1:  # the compute stream has read the layer before: its slots may be refilled
            streamer.release(("moe", (i - 1) % 2))
        if i == 2:  # what layer 2 holds, read before layer 3's staging refills the buffers copies land in
            got = [[s.expert(e).qs.clone() for e in hit] for s, _ in staged[-1]]
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
    streamer.close()
