"""Tensor parallelism: one process per device, each holding a Megatron-style shard.

``shard.py`` says which slice of every weight a rank holds; ``group.py`` wraps the
collectives the model runs (all-reduce, vocab all-gather) and the step broadcast;
``peer_allreduce.py`` sums small messages over peer-mapped buffers, and ``peer_norm.py`` a sum
together with the residual add and RMSNorm after it;
``ranks.py`` starts the other ranks and runs their step loop.
"""
