"""Speculative decoding: draft tokens cheaply, then verify them all in one target forward.

``ngram`` drafts by prompt lookup; ``rejection`` keeps the target's distribution exactly;
``verify`` applies it to a step's logits.
"""
