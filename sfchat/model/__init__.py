"""Models as sfchat holds them: checkpoint sources, slices of decoder layers with their static KV
cache, NF4 and int8 weights (``quant``), CUDA graphs over the slices' plain forwards, devices and the memory
estimate. Knows nothing of rounds, drafts or links."""
