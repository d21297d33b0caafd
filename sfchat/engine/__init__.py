"""Speculative decoding, sans I/O: the live speculation tree (``live``) and the head's side of it
(``speculator``: growing it with the draft, frames out, verdicts in), the tail's ``verifier``, the
``draft``, the prompt ``lookup``, ``sampling`` and the ``policy`` that picks frames in flight.
Token ids and tensors in, frames (bytes) out; never touches a link, a clock it does not report,
or a file."""
