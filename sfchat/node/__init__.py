"""The processes around the engine: the round driver (the engine over a link), the head a front
end opens and asks, the in-process link of local mode, the ``sfchat --tail`` process and the
thread that owns CUDA."""
