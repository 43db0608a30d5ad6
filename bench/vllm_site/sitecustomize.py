"""Run at the start of every Python process of the vLLM peer (this folder is first on its
``PYTHONPATH``, see ``bench.vllm_peer``): with ``--tensor-parallel-size`` above 1 vLLM starts
worker processes of its own, and each finds its platform through NVML, which fails on some VMs
whose CUDA works. Here each process is told it runs on CUDA before vLLM asks.

Only where ``PAGESTREAM_VLLM_FORCE_CUDA=1`` (the peer sets it), and only once vLLM is
importable: any other Python started with this path is left alone.
"""

import importlib.util
import os
import sys

if os.environ.get("PAGESTREAM_VLLM_FORCE_CUDA") == "1" and importlib.util.find_spec("vllm"):
    try:  # the project's root follows this folder on the path
        from bench.vllm_peer import force_cuda_platform

        force_cuda_platform()
    except Exception as _exc:  # a broken vLLM fails later with its own message
        print(f"pagestream sitecustomize: vLLM platform patch failed: {_exc!r}", file=sys.stderr)
