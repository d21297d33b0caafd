"""Models as sfchat holds them: checkpoint sources, slices of decoder layers with their static KV
cache, 4-bit weights, CUDA graphs over the slices' plain forwards, devices and the memory
estimate. Knows nothing of rounds, drafts or links."""
