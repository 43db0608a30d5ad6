"""Benchmarks of the engine and the service, and their records (``bench/results/``).

Workloads (``workloads``), the offline engine's throughput and latency (``throughput``,
``latency``, ``sweep``), kernels (``kernels``), KV-cache quality (``kv_quality``), the service
through Redis or the OpenAI gateway (``serve``, ``gateway``), peers measured in the same run
(``peers``: transformers; ``vllm_peer``: vLLM in a subprocess; ``compare``), and the JSON
records and their plots (``records``, ``plots``). The engine never imports this package; the
``pagestream bench`` commands (``commands/``) call into it.
"""
