"""Speculative decoding: draft tokens cheaply, then verify them all in one target forward.

``proposer`` decides who gets drafts and makes them by prompt lookup (``ngram``);
``draft_model`` makes them with a small model in its own page pool; ``rejection`` keeps the
target's distribution exactly; ``verify`` applies it to a step's logits.
"""
