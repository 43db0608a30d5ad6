"""Cascade decode against the plain decode kernel: one layer's attention of a decode step whose
sequences share a prompt prefix (CUDA only).

    python -m bench.cascade_decode --output-json bench/results/cascade-decode-h100.json

For llama3-8b's heads (32 over 8 KV heads) and qwen3-0.6b's (16 over 8), batches of 16 to 256
decodes over a shared prefix of 512 to 4,096 tokens, each with a suffix of its own (1 to 384
tokens, seeded): the plain call (each sequence reads the prefix, the engine's split count)
against the cascade (``prefix_*``: the prefix attended once per tile of queries), both checked
against each other; then steps of 64 and 256 decodes taking turns over four 2,048-token
prefixes (four tenants' system prompts: the cascade's groups). Prints microseconds per call
replayed from a CUDA graph (as the engine's decode steps run), the speedup, the eager calls'
times (a mixed step's, the host's launches included), and the bandwidth of the bytes the step
must read at least (each prefix once, every suffix once) against a device copy's.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch
import triton

import kernels.attention.cascade_triton as cascade_kernels
import kernels.attention.paged_attention_triton as attention
from engine.attention.backend import CASCADE_MAX_GROUPS, CascadeArgs, SharedPrefix

NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 128, 32
HEADS = {"llama3-8b": 32, "qwen3-0.6b": 16}
BATCHES = (16, 64, 256)
PREFIXES = (512, 1024, 2048, 4096)
MAX_SUFFIX = 384
# steps whose decodes take turns over several prefixes (tenants' system prompts): (decodes,
# prefix tokens, prefixes), decode i over prefix i mod the count
GROUPED = ((256, 2048, 4), (64, 2048, 4))


def _case(
    num_q_heads: int, batch: int, prefix: int, device: torch.device, seed: int = 0,
    groups: int = 1,
) -> tuple[Any, int]:  # fmt: skip
    """(run(cascade) -> out, the bytes of K/V the step reads at least); decode i over prefix
    i mod ``groups``."""
    gen = torch.Generator().manual_seed(seed)
    suffixes = torch.randint(1, MAX_SUFFIX + 1, (batch,), generator=gen).tolist()
    prefix_pages = prefix // BLOCK_SIZE
    lens = [prefix + n for n in suffixes]
    own = [-(-n // BLOCK_SIZE) - prefix_pages for n in lens]
    num_blocks = groups * prefix_pages + sum(own) + 1
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    v_cache = torch.randn(shape, device=device, dtype=torch.bfloat16)
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    shared = [order[g * prefix_pages : (g + 1) * prefix_pages] for g in range(groups)]
    order = order[groups * prefix_pages :]
    width = prefix_pages + max(own)
    tables = []
    for i, n in enumerate(own):
        tail = order[:n] + [num_blocks - 1] * (width - prefix_pages - n)
        tables.append(shared[i % groups] + tail)
        order = order[n:]
    block_tables = torch.tensor(tables, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_q_heads, HEAD_DIM, device=device, dtype=torch.bfloat16)

    shares = torch.full((batch,), prefix, dtype=torch.int32, device=device)
    # laid out as a captured decode graph holds them: tiles to spare for more groups
    group = num_q_heads // NUM_KV_HEADS
    num_tiles = cascade_kernels.max_prefix_tiles(batch, CASCADE_MAX_GROUPS, group)
    members = [list(range(g, batch, groups)) for g in range(groups)]
    rows, tile_groups = cascade_kernels.prefix_tiles(members, group, num_tiles)
    cascade_args = SharedPrefix(
        lens=shares,
        pages=block_tables[:groups],  # decode g is the first over prefix g
        rows=torch.tensor(rows, dtype=torch.int32, device=device),
        tile_groups=torch.tensor(tile_groups, dtype=torch.int32, device=device),
    )

    def run(cascade: bool) -> torch.Tensor:
        return attention.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, starts, scale=HEAD_DIM**-0.5,
            max_query_len=1, max_seq_len=max(lens),
            **(cascade_args.kwargs() if cascade else CascadeArgs()),
        )  # fmt: skip

    token_bytes = NUM_KV_HEADS * HEAD_DIM * 2 * k_cache.element_size()
    return run, (groups * prefix + sum(suffixes)) * token_bytes


def measure(device: torch.device) -> list[dict[str, Any]]:
    rows = []
    cases = [(b, p, 1) for b in BATCHES for p in PREFIXES] + list(GROUPED)
    for model, num_q_heads in HEADS.items():
        for batch, prefix, groups in cases:
            run, floor_bytes = _case(num_q_heads, batch, prefix, device, groups=groups)
            plain, cascade = run(False), run(True)
            error = (plain.float() - cascade.float()).abs().max().item()
            times = {}
            for name, cascade in (("plain", False), ("cascade", True)):
                # replayed from a CUDA graph, as decode steps run; eager (a mixed step's)
                # includes the host's launches
                call = functools.partial(run, cascade)
                times[f"{name}_us"] = triton.testing.do_bench_cudagraph(call, rep=100) * 1e3
                times[f"eager_{name}_us"] = triton.testing.do_bench(call, warmup=25, rep=200) * 1e3
            rows.append(dict(
                model=model, batch=batch, prefix=prefix, groups=groups, **times,
                speedup=times["plain_us"] / times["cascade_us"], max_abs_diff=error,
                floor_bytes=floor_bytes,
            ))  # fmt: skip
            row = rows[-1]
            print(
                f"{model} B={batch} prefix={prefix}"
                + (f" x {groups} prompts" if groups > 1 else "")
                + f": plain {row['plain_us']:.1f} us, "
                f"cascade {row['cascade_us']:.1f} us ({row['speedup']:.2f}x) in a graph; "
                f"eager {row['eager_plain_us']:.1f} / {row['eager_cascade_us']:.1f} us, "
                f"max diff {error:.1e}",
                flush=True,
            )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--output-json", default="cascade-decode.json")
    args = parser.parse_args(argv)
    from bench.kernels import measure_copy_bandwidth
    from bench.plots import plot_record
    from bench.records import machine_info, write_record

    if not torch.cuda.is_available():
        raise SystemExit("bench.cascade_decode needs a CUDA device")
    device = torch.device("cuda")
    rows = measure(device)
    copy_bytes_per_s = measure_copy_bandwidth(device)
    for row in rows:
        row["cascade_of_copy"] = row["floor_bytes"] / (row["cascade_us"] * 1e-6) / copy_bytes_per_s
    record = {
        "kind": "cascade-decode",
        "machine": machine_info(device),
        "settings": dict(
            model="one layer of " + " and ".join(HEADS),  # the plot's title
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
            max_suffix=MAX_SUFFIX,
            dtype="bfloat16",
        ),
        "copy_bytes_per_s": copy_bytes_per_s,
        "results": rows,
    }
    path = Path(args.output_json)
    write_record(record, path)
    plot_record(record, path.with_suffix(".png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
