"""``sfchat --serve``: an OpenAI-compatible HTTP endpoint on the head node.

One role per module: ``protocol`` (the OpenAI wire format: validation, errors, response
objects), ``stops`` (stop strings over streamed text), ``metrics`` (Prometheus series),
``generator`` (the one thread that owns the session and the models, fed through a bounded
queue), ``app`` (the Starlette routes), ``main`` (binding, loading, uvicorn), ``cli`` (the
options from the flags, and ``start_server``: the mode from a notebook's cell). Only the
generation thread touches the runtime (and so torch); the rest is torch-free.
"""
