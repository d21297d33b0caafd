"""``sfchat --serve``: an OpenAI-compatible HTTP endpoint on the head node.

One role per module: ``protocol`` (the OpenAI wire format: validation, errors, response
objects), ``stops`` (stop strings over streamed text), ``metrics`` (Prometheus series), ``gate``
(connections before their requests: a deadline each, caps per client address and in total),
``generator`` (the one thread that owns the session and the models, fed through a bounded
queue), ``app`` (the Starlette routes and the admission of requests), ``main`` (binding, loading,
uvicorn), ``cli`` (the options from the flags, and ``start_server``: the mode from a notebook's
cell). Only the generation thread runs the models. ``protocol``, ``stops``, ``metrics`` and
``gate`` import no torch; ``generator`` imports ``node.worker`` (and with it torch and the
engine), and ``app``, ``main`` and ``cli`` import ``generator``.
"""
