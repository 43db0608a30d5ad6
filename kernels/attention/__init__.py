"""Paged attention over the page pool and the KV write into it.

``paged_attention.py`` is the reference (and the CPU path): the pool's layout, fp8 pages, the
mixed batch. Its Triton kernels: the decode kernel with its split-KV path and the dispatcher
(``paged_attention_triton.py``), the prefill kernel (``paged_attention_prefill_triton.py``)
with its launch shapes (``prefill_tuning.py``, measured into ``prefill_configs.json``),
the pieces they share (``paged_attention_common.py``), and the KV write (``kv_write_triton.py``).
"""
