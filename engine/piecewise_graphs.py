"""Mixed steps (prefill chunks beside decodes) replayed from piecewise CUDA graphs.

A decode-only step is one full graph (``cuda_graphs.py``), but a step with a prefill chunk
cannot be: attention's grid and work follow the chunk lengths, which change every step. All
else in the forward (norms, projections, MLP) works row by row, so it depends only on the
step's token count. The forward is cut at each attention call into ``L + 1`` pieces:

    piece 0:      embed -> layer 0 pre-attention (norm, qkv, q/k norm)
    piece i:      layer i-1 post-attention (o_proj, add+norm, MLP) -> layer i pre-attention
    piece L:      layer L-1 post-attention -> final norm

and each piece is captured once per token-count bucket. A step of ``T`` tokens replays the
pieces of the smallest bucket ``>= T`` and runs the ``L`` attention calls eagerly on the
first ``T`` rows in between. Each attention call also rotates q and k, in the kernel that
writes the KV pages (one launch for both), so rotary is eager and the pieces never see
positions. Rows past ``T`` are padding: their input is token 0, they never reach attention
or the KV pages, and their outputs are ignored. The pieces pass activations through static
buffers (q, k, v, attention output, residual) sized for the largest bucket; a piece copies
its results into them, so one set serves every layer.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import cast

import torch

from engine.attention import AttentionMetadata, LayerCache
from engine.cuda_graphs import capture_mode
from engine.distributed.group import PartialSum
from engine.models.layers import DecoderLayer
from engine.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

MIN_BUCKET = 16
# Buckets grow by an eighth of their size (at least MIN_BUCKET): at most ~12% padding work.
BUCKET_GROWTH_DIVISOR = 8


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, ..., 256 (steps of 16), 288, ..., 512 (of 32), 576, ... up to and including
    ``max_tokens``: eight buckets per doubling above 128."""
    buckets, size = [], MIN_BUCKET
    while size < max_tokens:
        buckets.append(size)
        size += max(MIN_BUCKET, (1 << (size.bit_length() - 1)) // BUCKET_GROWTH_DIVISOR)
    return [*buckets, max_tokens]


@dataclass
class _Activations:
    """The tensors that cross a cut between two pieces; sized for the largest bucket."""

    input_ids: torch.Tensor  # [N] int64
    q: torch.Tensor  # [N, Hq, D], rotated in place by the eager attention call
    k: torch.Tensor  # [N, Hkv, D], never rotated: the rotated keys go to the pages
    v: torch.Tensor  # [N, Hkv, D]
    attn: torch.Tensor  # [N, Hq, D]: attention's output, written by the eager calls
    residual: torch.Tensor  # [N, hidden]
    hidden: torch.Tensor  # [N, hidden]: the final norm's output

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, size: int, device: torch.device) -> _Activations:
        arch, dtype = model.arch, model.embed_tokens.weight.dtype

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        return cls(
            input_ids=zeros(size, dtype=torch.int64),
            q=zeros(size, heads, head_dim),
            k=zeros(size, kv_heads, head_dim),
            v=zeros(size, kv_heads, head_dim),
            attn=zeros(size, heads, head_dim),
            residual=zeros(size, arch.hidden_size),
            hidden=zeros(size, arch.hidden_size),
        )


def activation_buffer_bytes(model: LlamaForCausalLM, max_tokens: int) -> int:
    """Bytes of the static buffers that the pieces of steps up to ``max_tokens`` share."""
    arch = model.arch
    row = 2 * arch.num_heads * arch.head_dim + 2 * arch.num_kv_heads * arch.head_dim
    row += 2 * arch.hidden_size
    element = model.embed_tokens.weight.element_size()
    return max_tokens * (row * element + 8)  # + input ids (int64)


class PiecewiseGraphs:
    """The forward of any step of up to ``max_tokens`` tokens, pieces replayed from graphs.

    With ``capture=False`` (CPU, or for tests) the same pieces run eagerly through the same
    static buffers and padding, which is how the cut itself is tested against the model.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_layers: list[LayerCache],
        max_tokens: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layers = cast(list[DecoderLayer], list(model.layers))
        self.kv_layers = kv_layers
        self.buckets = token_buckets(max_tokens)
        self.act = _Activations.allocate(model, self.buckets[-1], device)
        self.num_pieces = len(model.layers) + 1
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.capture_s = 0.0

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every piece of every bucket, largest bucket first, all in one memory pool:
        a piece's temporaries are freed when it ends, so the next piece reuses them."""
        start_s = time.perf_counter()
        pool = None
        for bucket in reversed(self.buckets):
            for piece in range(self.num_pieces):  # compiles kernels, settles autotuning
                self._run_piece(piece, bucket)
            torch.cuda.synchronize()
            graphs = []
            for piece in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    graph, pool=pool, capture_error_mode=capture_mode(self.model)
                ):
                    self._run_piece(piece, bucket)
                pool = graph.pool()
                graphs.append(graph)
            self.graphs[bucket] = graphs
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start_s
        logger.info(
            "captured %d piecewise CUDA graphs (%d pieces x %d token buckets %d..%d) in %.1fs",
            len(self.buckets) * self.num_pieces, self.num_pieces, len(self.buckets),
            self.buckets[0], self.buckets[-1], self.capture_s,
        )  # fmt: skip

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest bucket that holds ``num_tokens`` rows, if any."""
        for bucket in self.buckets:
            if bucket >= num_tokens:
                return bucket
        return None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: a view of a static buffer, valid until the next step
        num_tokens = input_ids.shape[0]
        bucket = self.bucket_for(num_tokens)
        assert bucket is not None, f"no piecewise graph holds {num_tokens} tokens"
        act = self.act
        act.input_ids[:num_tokens].copy_(input_ids)
        act.input_ids[num_tokens:bucket].zero_()  # padding rows: token 0
        graphs = self.graphs.get(bucket)
        layers = self.layers
        rope = self.model.rope_inputs(positions)  # read by the eager calls only
        for index in range(len(layers)):
            self._replay_or_run(graphs, index, bucket)
            layers[index].self_attn.attend(
                act.q[:num_tokens],
                act.k[:num_tokens],
                act.v[:num_tokens],
                rope,
                self.kv_layers[index],
                meta,
                out=act.attn[:num_tokens],
            )
        self._replay_or_run(graphs, len(layers), bucket)
        return act.hidden[:num_tokens]

    def _replay_or_run(
        self, graphs: list[torch.cuda.CUDAGraph] | None, piece: int, bucket: int
    ) -> None:
        if graphs is None:
            self._run_piece(piece, bucket)
        else:
            graphs[piece].replay()

    def _run_piece(self, piece: int, bucket: int) -> None:
        """Piece ``piece`` on the first ``bucket`` rows of the static buffers."""
        act, model, rows = self.act, self.model, slice(0, bucket)
        x: torch.Tensor | PartialSum  # the norm after it may sum it (peer_norm)
        residual: torch.Tensor | None = None
        if piece == 0:
            x = model.embed_tokens(act.input_ids[rows])
        else:
            previous = self.layers[piece - 1]
            x, residual = previous.post_attention(act.attn[rows].flatten(1), act.residual[rows])
        if piece == len(self.layers):
            assert residual is not None
            hidden, _ = model.norm.add_and_norm(x, residual)
            act.hidden[rows].copy_(hidden)
            return
        q, k, v, residual = self.layers[piece].pre_attention(x, residual)
        act.q[rows].copy_(q)
        act.k[rows].copy_(k)
        act.v[rows].copy_(v)
        act.residual[rows].copy_(residual)
