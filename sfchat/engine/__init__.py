"""Speculative decoding, sans I/O: the head's round, the tail's verifier, the draft, token trees,
sampling and the policy that picks a round's shape. Token ids and tensors in, frames (bytes)
out; never touches a link, a clock it does not report, or a file."""
