"""The GPU runner: a step's forward recorded once per shape as a CUDA graph and replayed (llama.cpp does the same): a
decode step from its first run, prompt u-batches from their shape's second, cut where work depends on the cache length
or must run on the host (ops on weights in RAM); a host step that reads only host memory runs while the graph waits
at it (Handshakes) instead of cutting it."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferry.kernels.cuda.driver import Handshakes
from ferry.layers.rope import Rope
from ferry.config import Settings, settings as current_settings
from ferry.runtime.batch import Batch
from ferry.runtime.runners.cuda import DECODE_MAX, CudaOps, LatentForms


PROMPT_GRAPHS_KEPT = 8  # prompt shapes recorded at once


PROMPT_RECORDED_AT = 2  # the run of a prompt shape that records it as CUDA graphs (the first runs eagerly)


def _is_prompt(key: tuple) -> bool:
    """Whether a recorded step's key is a prompt's (a u-batch of more than DECODE_MAX tokens, or a logical batch
    taken layer first, key[4] its u-batches' sizes): those count against PROMPT_GRAPHS_KEPT."""
    return key[2] > DECODE_MAX or key[4] is not None


class _Recorder:
    """Records a step as CUDA graphs cut wherever the backend must run host code (ops on weights in RAM, in the
    hybrid runtime): the backend calls defer(fn, shape) and gets a tensor into which fn's result is copied at
    replay, between the graph before and the graph after. With `handshakes`, a host step that reads only host
    memory (the backend passes it as `host`) does not cut the graph: the graph waits at it (Handshakes)."""

    def __init__(self, pool, handshakes: Handshakes | None = None):
        self.pool = pool
        self.steps: list = []  # graph launches and host steps, in order
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.host_tokens: dict[int, torch.Tensor] = {}  # a host-side embedding's tokens, by its GPU input's address
        self.handshakes = handshakes
        self.n_handshakes = 0
        self._waiting: list[tuple[int, Callable]] = []  # the current graph's handshakes: (k, host step)
        self._graph: torch.cuda.CUDAGraph | None = None
        self._buffers: dict[tuple, torch.Tensor] = {}  # staged inputs and results of shared defers

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        # thread-local: what other threads do (ggml's pool, torch's host allocator) cannot break this capture
        self._graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        with warnings.catch_warnings():  # a cut right at the start leaves an empty graph: harmless
            warnings.simplefilter("ignore", UserWarning)
            self._graph.capture_end()
        self.graphs.append(self._graph)
        self.steps.append(_launcher(self._graph))
        if self._waiting:
            self.steps.append(self._server(self._waiting))
            self._waiting = []
        self._graph = None

    def _server(self, waiting: list[tuple[int, Callable]]) -> Callable[[], None]:
        """The host's side of one launched graph's handshakes, in order; if one fails, the graph is let past the
        rest before the error goes on."""
        hs = self.handshakes

        def serve() -> None:
            for i, (k, step) in enumerate(waiting):
                try:
                    hs.serve(k, step)
                except BaseException:
                    hs.release([j for j, _ in waiting[i:]])
                    raise
        return serve

    def defer(self, fn, shape: tuple[int, ...], device, inputs: tuple[torch.Tensor, ...] = (),
              shared: str | None = None, host: tuple[Callable[[], torch.Tensor], torch.Tensor] | None = None
              ) -> torch.Tensor:
        """A tensor of `shape` that holds fn(*inputs) at replay. The inputs are copied at the end of the graph
        before the cut into buffers of this recording (so that the capture may reuse the originals' memory).
        Defers of one `shared` name use the same buffers: each one's result must be consumed before the next
        such step runs, as a layer's attention is before the next layer's. `host`: the same step as a function
        of host memory only that writes its result into the page-locked tensor given with it (of `shape`, float32):
        with handshakes it runs while the graph waits, without a cut."""
        if host is not None and self.handshakes is not None and self.n_handshakes < Handshakes.CAPACITY:
            step, result = host
            out = torch.empty(shape, dtype=torch.float32, device=device)  # the graph's pool: a fixed address
            self.handshakes.record(self.n_handshakes, out, result)
            self._waiting.append((self.n_handshakes, step))
            self.n_handshakes += 1
            return out
        staged = []
        for i, t in enumerate(inputs):
            key = (shared, i, tuple(t.shape), t.dtype)
            buf = self._buffers.get(key) if shared else None
            if buf is None:
                buf = torch.empty(t.shape, dtype=t.dtype, device=t.device)  # pool memory this recording keeps
                if shared:
                    self._buffers[key] = buf
            buf.copy_(t)
            staged.append(buf)
        self.end()
        out = self._buffers.get((shared, "out", shape)) if shared else None
        if out is None:
            out = torch.empty(shape, dtype=torch.float32, device=device)  # outside any capture: a fixed address
            if shared:
                self._buffers[shared, "out", shape] = out
        self.steps.append(lambda: out.copy_(fn(*staged), non_blocking=True))
        self.begin()
        return out

    def tokens_on_host(self, tokens: torch.Tensor) -> torch.Tensor:
        """The replayed step's tokens whose GPU copy is the recording's input `tokens`, as the host holds them."""
        return self.host_tokens[tokens.data_ptr()]

    def replay(self) -> None:
        for step in self.steps:
            step()


def _launcher(graph: torch.cuda.CUDAGraph):
    """graph.replay() without torch's prologue, which launches two fill kernels per replay to reseed its random
    number generator (these graphs draw no random numbers; a hybrid decode step replays one graph per layer): one
    cudaGraphLaunch through ctypes. torch's replay where the runtime or the instantiated graph is not at hand."""
    import ctypes

    from ferry.kernels.cuda.driver import cudart_library

    lib = cudart_library()
    try:
        handle = ctypes.c_void_p(graph.raw_cuda_graph_exec())
    except (RuntimeError, AttributeError):
        handle = None
    if lib is None or handle is None or not handle.value:
        return graph.replay

    def launch() -> None:
        rc = lib.cudaGraphLaunch(handle, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream))
        if rc != 0:
            raise RuntimeError(f"cudaGraphLaunch failed with error {rc}")
    return launch


@dataclass
class _Input:
    """One recorded forward's static inputs (its tokens, positions and cache cells on the GPU) and the op set that
    reads them; a replay copies the next batch's into them."""

    tokens: torch.Tensor
    pos: torch.Tensor
    cells: torch.Tensor
    ring_cells: torch.Tensor  # Batch.ring_cells
    ops: CudaOps | None = None  # made once the inputs are on the GPU

    def load(self, tokens: torch.Tensor, batch: Batch, graph) -> None:
        self.tokens.copy_(tokens)  # straight from the host into the graph's inputs
        self.pos.copy_(batch.positions)
        self.cells.copy_(batch.cells)
        self.ring_cells.copy_(batch.ring_cells)
        self.ops.rebind(batch)
        if isinstance(graph, _Recorder):
            graph.host_tokens[self.tokens.data_ptr()] = tokens.cpu()


@dataclass
class _Captured:
    """A step of one shape as a CUDA graph (or, with host steps, graphs and host steps in turn): its forwards'
    static inputs, filled before each replay (one forward; or a logical batch's u-batches, then their joined rows,
    taken layer first); the logits of each u-batch; the routing the replay writes."""

    inputs: list[_Input]
    logits: list[torch.Tensor]
    expert_ids: list[torch.Tensor]
    graph: torch.cuda.CUDAGraph | _Recorder
    decided: str | None = None  # the backend's decided way for this step's size when it was recorded


class CudaGraphRunner:
    """Runs a model's forward on the GPU backend as CUDA graphs, captured per shape and replayed (Settings.cuda_graphs
    False, or graphs=False, runs it eagerly): a decode step of up to DECODE_MAX tokens from its first run, a prompt
    u-batch of up to Settings.prompt_graph_max tokens from the second run of its shape on (prompt tails of
    every length are run once and not kept; at most PROMPT_GRAPHS_KEPT shapes at once), with attention over the
    cache between graphs; likewise a logical batch taken layer first, whose shape is its u-batches' sizes. A step
    recorded with cuts is recorded again once the backend's auto has decided its size's way (its host steps may then
    become handshakes)."""

    layer_first = True

    def __init__(self, backend, graphs: bool | None = None, settings: Settings | None = None):
        self.backend = backend
        self.device = backend.device
        self.settings = settings or current_settings()
        self.latent_forms = LatentForms()  # -mla 3's measured prompt forms, kept for this runner's runs
        self.graphs = self.settings.cuda_graphs if graphs is None else graphs
        self._tables: dict[tuple[int, int], dict[Rope, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._captured: dict[tuple, _Captured] = {}
        self._prompt_runs: dict[tuple, int] = {}
        self._pool = None
        self._handshakes: Handshakes | None | bool = False  # made at the first recording with host steps

    def _rope_tables(self, model, n_ctx: int) -> dict:
        """cos/sin of every cache position for each rope the model uses (the CPU path's angles), once per model
        and cache length."""
        key = (id(model), n_ctx)
        if key not in self._tables:
            ropes = model.ropes()
            self._tables[key] = {r: tuple(t.to(self.device) for t in r.angles(torch.arange(n_ctx))) for r in ropes}
        return self._tables[key]

    def _ops(self, model, batch: Batch, tokens, pos, cells, ring_cells) -> CudaOps:
        return CudaOps(self.backend, batch, tokens, pos, cells, self._rope_tables(model, batch.kv.n_ctx),
                       self.latent_forms, ring_cells)

    def placed_ops(self, model, batch: Batch, tokens: torch.Tensor) -> CudaOps:
        """The op set of an eager step: its tokens, positions and cache cells moved to this GPU."""
        return self._ops(model, batch, *(t.to(self.device) for t in (tokens, batch.positions, batch.cells,
                                                                      batch.ring_cells)))

    def report(self) -> list[str]:
        """-mla 3's prompt forms timed and kept so far (LatentForms.report)."""
        return self.latent_forms.report()

    def will_record(self) -> bool:
        """Whether a prompt shape has run but is not recorded yet, and will record its CUDA graphs when it runs
        again: a one-time cost a benchmark's warm-up should take (as llama-bench's takes llama.cpp's)."""
        return any(runs < PROMPT_RECORDED_AT and key not in self._captured for key, runs in self._prompt_runs.items())

    def _recorded(self, key: tuple, n_tokens: int, prompt: bool = False) -> bool:
        """Whether this step runs as graphs: decode steps always, prompt u-batches (and logical batches of
        u-batches of up to `n_tokens`, `prompt`) from their shape's second run. At most PROMPT_GRAPHS_KEPT prompt
        shapes stay recorded (a server meets many prompt tails): recording another drops the least recently
        replayed one, which must then run twice again to come back."""
        recordable = self.backend.graph_safe or self.backend.host_steps
        if not self.graphs or not recordable or n_tokens > self.settings.prompt_graph_max:
            return False
        if n_tokens <= DECODE_MAX and not prompt:
            return True
        if key in self._captured:
            self._captured[key] = self._captured.pop(key)  # the most recently replayed last
            return True
        self._prompt_runs[key] = self._prompt_runs.get(key, 0) + 1
        if self._prompt_runs[key] < PROMPT_RECORDED_AT:
            return False
        prompts = [k for k in self._captured if _is_prompt(k)]
        if len(prompts) >= PROMPT_GRAPHS_KEPT:
            del self._captured[prompts[0]]
            self._prompt_runs.pop(prompts[0], None)
        return True

    def forward(self, model, tokens: torch.Tensor, batch: Batch) -> torch.Tensor:
        # key[2]: the u-batch size; key[5]: the sequence of a recurrent model's batch (one sequence's tokens), whose
        # recorded step reads and writes that sequence's state
        seq = int(batch.seq[0]) if batch.seq is not None and batch.kv.recurrent else None
        key = (id(model), id(batch.kv), batch.n_tokens, batch.logit_rows, None, seq)
        if not self._recorded(key, batch.n_tokens):
            return model.forward(self.placed_ops(model, batch, tokens))
        c = self._captured.get(key)
        decided = self.backend.decided(batch.n_tokens) if c is not None else None
        if c is not None and c.decided != decided and (decided is None or (isinstance(c.graph, _Recorder)
                                                                           and len(c.graph.graphs) > 1)):
            # cut before auto decided its way, or auto measures it again: recorded again, the old step dropped only
            # after the capture
            c = None
        if c is None:
            c = self._captured[key] = self._capture(model, [(tokens, batch)], batch,
                                                    lambda opss: [model.forward(opss[0])])
        else:
            c.inputs[0].load(tokens, batch, c.graph)
            c.graph.replay()
        batch.expert_ids = list(c.expert_ids)
        return c.logits[0].clone()

    def forward_layer_first(self, model, tokens: list[torch.Tensor], batches: list[Batch],
                            joined: Batch) -> list[torch.Tensor]:
        """The u-batches of one logical batch, layer by layer (Model.forward_layer_first): each one's logits.
        `joined`: Batch.join(batches). Recorded as a prompt u-batch is, its shape being the u-batches' sizes: each
        u-batch's attention over the cache and the joined rows' experts in RAM run between graphs. Eagerly, the
        u-batches' launches bound the run at small u-batches (docs/performance.md, 2026-11-23 and 2026-11-24)."""
        sizes = tuple(b.n_tokens for b in batches)
        key = (id(model), id(joined.kv), joined.n_tokens, joined.logit_rows, sizes, None)
        if not self._recorded(key, max(sizes), prompt=True):
            return model.forward_layer_first([self.placed_ops(model, b, t) for t, b in zip(tokens, batches)],
                                             self.placed_ops(model, joined, torch.cat(tokens)))
        forwards = [*zip(tokens, batches), (torch.cat(tokens), joined)]  # the u-batches, then their rows joined
        c = self._captured.get(key)
        if c is None:
            c = self._captured[key] = self._capture(
                model, forwards, joined, lambda opss: model.forward_layer_first(opss[:-1], opss[-1]))
        else:
            for i, (t, b) in zip(c.inputs, forwards):
                i.load(t, b, c.graph)
            c.graph.replay()
        joined.expert_ids = list(c.expert_ids)
        return [x.clone() for x in c.logits]

    def _capture(self, model, forwards: list[tuple[torch.Tensor, Batch]], routed: Batch, run) -> _Captured:
        """Run the step once eagerly on a side stream (compiles kernels, sizes scratch buffers), then record it: as
        one graph, or as graphs cut at host steps (a prompt's attention over the cache, the hybrid runtime's ops on
        weights in RAM), and replay it for this step's result. `forwards`: each op set's tokens and batch;
        `run(op sets)`: the step's logits, one tensor per u-batch; `routed`: the batch whose MoE layers record their
        routing."""
        inputs = [_Input(*(t.to(self.device) for t in (tokens, b.positions, b.cells, b.ring_cells)))
                  for tokens, b in forwards]

        def op_sets() -> list[CudaOps]:
            return [self._ops(model, b, i.tokens, i.pos, i.cells, i.ring_cells) for i, (_, b) in zip(inputs, forwards)]

        n_tokens = max(b.n_tokens for _, b in forwards)
        # a prompt's buffers cached by one stream serve no other stream nor the graph's pool: the eager run before,
        # the warm-up and the recording would each hold a u-batch's worth at once, past what the fit left (gpt-oss-20b
        # at 8 GiB ran out of memory recording), so each gives its cache back before the next begins
        prompt = n_tokens > DECODE_MAX
        if prompt:
            torch.cuda.empty_cache()
        kv = forwards[0][1].kv
        state = kv.copy_state() if kv.recurrent else None  # the eager run advances recurrent states: undone after it
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run(op_sets())
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if state is not None:
            kv.put_state(state)
        if prompt:
            torch.cuda.empty_cache()
        routed.expert_ids = []
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        opss = op_sets()
        for i, ops in zip(inputs, opss):
            i.ops = ops
        decided = self.backend.decided(n_tokens)
        if self.backend.graph_safe and n_tokens <= DECODE_MAX and len(forwards) == 1 and model.position_free(kv):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = run(opss)
        else:
            if self._handshakes is False:
                self._handshakes = Handshakes.of(self.device, self.settings.handshakes)
            graph = _Recorder(self._pool, self._handshakes)
            for i, (tokens, _) in zip(inputs, forwards):
                graph.host_tokens[i.tokens.data_ptr()] = tokens.cpu()
            torch.cuda.synchronize(self.device)
            gc.collect()  # as torch.cuda.graph does: no collection (freeing events, pinned buffers) mid-capture
            gc.disable()
            with torch.cuda.stream(stream):
                self.backend.recorder = graph
                graph.begin()
                try:
                    logits = run(opss)
                    graph.end()
                finally:
                    self.backend.recorder = None
                    gc.enable()
            torch.cuda.current_stream(self.device).wait_stream(stream)
        graph.replay()
        if prompt:  # what the recording's host steps ran eagerly
            torch.cuda.empty_cache()
        return _Captured(inputs, logits, list(routed.expert_ids), graph, decided)
