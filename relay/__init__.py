"""sfchat-relay: pairs one head and one tail per session and forwards their frames verbatim.

Deployed alone on a small public host: it depends on ``websockets`` only, never imports
torch or the ``sfchat`` package, and never parses the frames it forwards.
See ``relay.server`` for the handshake and the options.
"""
