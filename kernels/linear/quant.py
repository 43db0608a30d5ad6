"""Quantized weight formats: their planes, a torch dequantizing reference, and quantizers.

A weight ``[N, K]`` of a block format is held as a few *planes*, each ``[N, ...]``: the fields
of ggml's block struct, split into one contiguous array per field (the same bits as the GGUF
file, struct-of-arrays, so that a kernel loads the quants with wide aligned loads):

    q8_0  d f16 [N, K/32]  qs i8 [N, K]             w = d * q
    q4_0  d f16 [N, K/32]  qs u8 [N, K/2]           w = d * (q - 8)
    q4_1  d f16, m f16 [N, K/32]  qs u8 [N, K/2]    w = d * q + m
    q4_k  d, dmin f16 [N, K/256]  scales u8 [N, 12 K/256]  qs u8 [N, K/2]
    q6_k  d f16 [N, K/256]  scales i8 [N, K/16]  ql u8 [N, K/2]  qh u8 [N, K/4]
    fp8   w e4m3 [N, K]  scale f32 [N, 1] (per output channel)

4-bit quants keep ggml's order inside a block: in a 32-block byte ``j`` holds element ``j``
(low nibble) and ``j + 16`` (high nibble); the k-quants' orders are spelled out in
:func:`dequantize`. Rows are independent, so fused projections concatenate planes by rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QK = 32  # elements of a q8_0/q4_0/q4_1 block
QK_K = 256  # elements of a k-quant super-block
FP8_MAX = 448.0  # largest finite float8 e4m3fn


@dataclass(frozen=True)
class Plane:
    """One field of a block: ``per_block`` items of ``dtype`` for each block of a row (in a
    format's ``row_planes``: for each row)."""

    name: str
    dtype: torch.dtype
    per_block: int


@dataclass(frozen=True)
class QuantFormat:
    """A weight format: its block size (elements), its planes, and its id in the kernels;
    ``row_planes`` are fields of a whole row (fp8's scale), after the block planes in the
    kernels' order."""

    name: str
    block_size: int
    planes: tuple[Plane, ...]
    kernel_id: int
    row_planes: tuple[Plane, ...] = ()

    @property
    def all_planes(self) -> tuple[Plane, ...]:
        """Block planes, then row planes: the order the kernels take them in."""
        return self.planes + self.row_planes

    def plane_shapes(self, num_rows: int, size_k: int) -> dict[str, tuple[int, int]]:
        """Shape of each plane of an ``[num_rows, size_k]`` weight."""
        num_blocks = size_k // self.block_size
        shapes = {p.name: (num_rows, num_blocks * p.per_block) for p in self.planes}
        return shapes | {p.name: (num_rows, p.per_block) for p in self.row_planes}

    def bits_per_weight(self) -> float:
        bits = sum(p.per_block * _dtype_bits(p.dtype) for p in self.planes)
        return bits / self.block_size


F16, U8, I8 = torch.float16, torch.uint8, torch.int8
_Q4_K_PLANES = (Plane("d", F16, 1), Plane("dmin", F16, 1), Plane("scales", U8, 12),
                Plane("qs", U8, QK_K // 2))  # fmt: skip
_Q6_K_PLANES = (Plane("d", F16, 1), Plane("scales", I8, QK_K // 16), Plane("ql", U8, QK_K // 2),
                Plane("qh", U8, QK_K // 4))  # fmt: skip
# the planes' order is the order in which the kernels take them
FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        QuantFormat("q8_0", QK, (Plane("d", F16, 1), Plane("qs", I8, QK)), 0),
        QuantFormat("q4_0", QK, (Plane("d", F16, 1), Plane("qs", U8, QK // 2)), 1),
        QuantFormat("q4_1", QK, (Plane("d", F16, 1), Plane("qs", U8, QK // 2), Plane("m", F16, 1)), 2),
        QuantFormat("q4_k", QK_K, _Q4_K_PLANES, 3),
        QuantFormat("q6_k", QK_K, _Q6_K_PLANES, 4),
        # per output channel: w [N, K] and a float32 scale per row
        QuantFormat("fp8", 1, (Plane("w", torch.float8_e4m3fn, 1),), 5,
                    row_planes=(Plane("scale", torch.float32, 1),)),
    )
}  # fmt: skip
# ggml's block struct of each format: (field, bytes) in file order
GGML_BLOCK_FIELDS: dict[str, tuple[tuple[str, int], ...]] = {
    "q8_0": (("d", 2), ("qs", 32)),
    "q4_0": (("d", 2), ("qs", 16)),
    "q4_1": (("d", 2), ("m", 2), ("qs", 16)),
    "q4_k": (("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)),
    "q6_k": (("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)),
}
IN_SITU_FORMATS = ("q8_0", "q4_0", "q4_1", "fp8")  # those quantize() makes from float weights


def _dtype_bits(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size() * 8


def plane_bytes(planes: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in planes.values())


# -- from GGUF blocks ---------------------------------------------------------------------------


def planes_from_ggml(raw: np.ndarray, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Split ggml blocks ``uint8 [N, K / block * block_bytes]`` into the format's planes."""
    fields = GGML_BLOCK_FIELDS[fmt.name]
    block_bytes = sum(size for _, size in fields)
    num_rows = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(num_rows, -1, block_bytes)
    dtypes = {p.name: p.dtype for p in fmt.planes}
    planes, offset = {}, 0
    for name, size in fields:
        field = np.ascontiguousarray(blocks[:, :, offset : offset + size]).reshape(num_rows, -1)
        planes[name] = torch.from_numpy(field).view(dtypes[name])
        offset += size
    return planes


# -- reference dequantization ---------------------------------------------------------------


def dequantize(fmt: QuantFormat, planes: dict[str, torch.Tensor]) -> torch.Tensor:
    """The float32 weight ``[N, K]`` that ``planes`` encode (a torch reference, any device)."""
    if fmt.name == "fp8":
        return planes["w"].float() * planes["scale"]
    num_rows = next(iter(planes.values())).shape[0]
    if fmt.name == "q8_0":
        qs = planes["qs"].float().view(num_rows, -1, QK)
        return (qs * planes["d"].float()[..., None]).view(num_rows, -1)
    if fmt.name in ("q4_0", "q4_1"):
        qs = _nibbles(planes["qs"].view(num_rows, -1, QK // 2)).float()  # [N, blocks, 32]
        if fmt.name == "q4_0":
            return ((qs - 8) * planes["d"].float()[..., None]).view(num_rows, -1)
        weights = qs * planes["d"].float()[..., None] + planes["m"].float()[..., None]
        return weights.view(num_rows, -1)
    if fmt.name == "q4_k":
        return _dequantize_q4_k(planes, num_rows)
    return _dequantize_q6_k(planes, num_rows)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., B] bytes -> [..., 2B]: the B low nibbles, then the B high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def q4_k_scales_mins(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes per super-block -> 8 six-bit scales and 8 six-bit mins, [..., 8]."""
    s = scales.view(*scales.shape[:-1], 3, 4).int()
    low, high, extra = s[..., 0, :], s[..., 1, :], s[..., 2, :]
    sc = torch.cat([low & 63, (extra & 0x0F) | ((low >> 6) << 4)], dim=-1)
    mn = torch.cat([high & 63, (extra >> 4) | ((high >> 6) << 4)], dim=-1)
    return sc, mn


def _dequantize_q4_k(planes: dict[str, torch.Tensor], num_rows: int) -> torch.Tensor:
    scales = planes["scales"].view(num_rows, -1, 12)
    sc, mn = q4_k_scales_mins(scales)  # [N, S, 8]
    d = planes["d"].float()[..., None] * sc.float()
    dmin = planes["dmin"].float()[..., None] * mn.float()
    # each 64 elements: 32 bytes, low nibbles first (sub-block 2c), then high (2c + 1)
    qs = _nibbles(planes["qs"].view(num_rows, -1, 4, 32)).float().view(num_rows, -1, 8, 32)
    return (d[..., None] * qs - dmin[..., None]).view(num_rows, -1)


def _dequantize_q6_k(planes: dict[str, torch.Tensor], num_rows: int) -> torch.Tensor:
    # element e = 128 h + 32 s + u of a super-block: low 4 bits in ql[64 h + 32 (s % 2) + u]
    # (nibble s // 2), high 2 bits in qh[32 h + u] (bits 2 s); scale scales[e // 16]
    ql = planes["ql"].view(num_rows, -1, 2, 64)
    qh = planes["qh"].view(num_rows, -1, 2, 1, 32).int()
    low = _nibbles(ql).int().view(num_rows, -1, 2, 4, 32)
    shifts = torch.arange(0, 8, 2, dtype=torch.int32, device=qh.device).view(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low | (high << 4)) - 32
    scale = planes["d"].float()[..., None] * planes["scales"].float().view(num_rows, -1, 16)
    q = q.float().view(num_rows, -1, 16, 16)
    return (scale[..., None] * q).view(num_rows, -1)


# -- quantization from float weights (ggml's reference rounding) -----------------------------


def quantize(weight: torch.Tensor, fmt: QuantFormat) -> dict[str, torch.Tensor]:
    """Planes of ``weight [N, K]`` in ``fmt`` (one of IN_SITU_FORMATS), on its device.

    Rounds as ggml's reference quantizers do (the ``gguf`` package's ``quantize``), so a
    float checkpoint quantized here serves the bits llama.cpp's tools would have written.
    """
    if fmt.name not in IN_SITU_FORMATS:
        raise ValueError(f"{fmt.name} weights come only from GGUF files, not from float weights")
    if fmt.name == "fp8":
        return _quantize_fp8(weight.float())
    num_rows, size_k = weight.shape
    if size_k % QK:
        raise ValueError(f"{fmt.name}: rows of {size_k} are not whole blocks of {QK}")
    blocks = weight.float().reshape(num_rows, -1, QK)
    if fmt.name == "q8_0":
        return _quantize_q8_0(blocks, num_rows)
    return _quantize_q4(blocks, num_rows, with_min=fmt.name == "q4_1")


def _safe_inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / torch.where(d == 0, 1, d))


def _quantize_q8_0(blocks: torch.Tensor, num_rows: int) -> dict[str, torch.Tensor]:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    scaled = blocks * _safe_inverse(d)
    qs = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)  # round half away from zero
    return {"d": d.view(num_rows, -1).half(), "qs": qs.to(torch.int8).view(num_rows, -1)}


def _quantize_q4(blocks: torch.Tensor, num_rows: int, with_min: bool) -> dict[str, torch.Tensor]:
    if with_min:
        low = blocks.amin(dim=-1, keepdim=True)
        d = (blocks.amax(dim=-1, keepdim=True) - low) / 15
        q = torch.trunc((blocks - low) * _safe_inverse(d) + 0.5)
    else:  # q4_0: the signed value of largest magnitude maps to -8
        largest = blocks.gather(-1, blocks.abs().argmax(dim=-1, keepdim=True))
        d = largest / -8
        q = torch.trunc(blocks * _safe_inverse(d) + 8.5)
    q = q.clamp(0, 15).to(torch.uint8)
    qs = q[..., : QK // 2] | (q[..., QK // 2 :] << 4)
    planes = {"d": d.view(num_rows, -1).half(), "qs": qs.reshape(num_rows, -1)}
    if with_min:
        planes["m"] = low.view(num_rows, -1).half()
    return planes


def _quantize_fp8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    amax = weight.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax == 0, torch.ones_like(amax), amax / FP8_MAX)
    w = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"w": w, "scale": scale}


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [M, K] as e4m3 with a float32 scale per row (dynamic, per token) [M, 1].
    The scale is ``amax`` times fp32 ``1/448`` (what torch's CUDA division by a number
    computes; the CPU's would divide), so that every device and the Triton kernel agree."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax == 0, torch.ones_like(amax), amax * (1.0 / FP8_MAX))
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def empty_planes(
    fmt: QuantFormat, num_rows: int, size_k: int, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """Uninitialised planes of an ``[num_rows, size_k]`` weight, its row planes included."""
    dtypes = {p.name: p.dtype for p in fmt.all_planes}
    shapes = fmt.plane_shapes(num_rows, size_k)
    return {name: torch.empty(shapes[name], dtype=dtypes[name], device=device) for name in shapes}
