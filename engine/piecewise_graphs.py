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
or the KV pages, and their outputs are ignored.

The pieces pass activations through static buffers sized for the largest bucket, one set for
every layer. The qkv projection writes its ``[N, (Hq + 2 * Hkv) * D]`` rows straight into the
``qkv`` buffer (``DecoderLayer.pre_attention``'s ``qkv_out``), and q, k and v are views of its
columns, strided across rows as in the eager forward: no copy between the projection and
attention (a linear whose path cannot write into a given tensor copies its whole row block
once, ``linear_into``). Copying q, k and v out of the projection cost a bucket's pieces
(H100, qwen3-0.6b in bf16, no attention) 2.00 ms against 1.75 at 512 tokens, 1.70 against
1.55 at 256. Attention writes its output into the ``attn`` buffer. The fused
add + RMSNorm adds into the residual buffer in place (so does the tensor-parallel
``PartialSum``'s, which sums the ranks' shares in the same kernel); a piece copies the
residual in only where it comes back as a new tensor (piece 0's embeddings, a norm that
rounds to int8, the torch ops). Piece ``L`` copies the final norm's output into ``hidden``.
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
    qkv: torch.Tensor  # [N, (Hq + 2 * Hkv) * D]: the qkv projection writes here
    q: torch.Tensor  # [N, Hq, D] view of qkv, rotated in place by the eager attention call
    k: torch.Tensor  # [N, Hkv, D] view of qkv, never rotated: the rotated keys go to the pages
    v: torch.Tensor  # [N, Hkv, D] view of qkv
    attn: torch.Tensor  # [N, Hq, D]: attention's output, written by the eager calls
    residual: torch.Tensor  # [N, hidden]
    hidden: torch.Tensor  # [N, hidden]: the final norm's output

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, size: int, device: torch.device) -> _Activations:
        arch, dtype = model.arch, model.embed_tokens.weight.dtype

        def zeros(*shape: int, dtype: torch.dtype = dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        heads, kv_heads, head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        q_size, kv_size = heads * head_dim, kv_heads * head_dim  # as Attention.project splits
        qkv = zeros(size, q_size + 2 * kv_size)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return cls(
            input_ids=zeros(size, dtype=torch.int64),
            qkv=qkv,
            q=q.view(size, heads, head_dim),
            k=k.view(size, kv_heads, head_dim),
            v=v.view(size, kv_heads, head_dim),
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
        # q, k and v come back as views of act.qkv, where the projection wrote them
        *_, residual = self.layers[piece].pre_attention(x, residual, qkv_out=act.qkv[rows])
        store(act.residual[rows], residual)


def store(buffer: torch.Tensor, value: torch.Tensor) -> None:
    """``buffer.copy_(value)``, skipped where ``value`` is ``buffer`` already (a norm that added
    into the residual buffer in place hands it back): no kernel, none captured."""
    same = (
        value.data_ptr() == buffer.data_ptr()
        and value.shape == buffer.shape
        and value.stride() == buffer.stride()
        and value.dtype == buffer.dtype
    )
    if not same:
        buffer.copy_(value)
