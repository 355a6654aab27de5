"""Where offloaded activations live: `host` (RAM; pinned for CUDA sources) and `nvme`
(slab files written by the C++ engine). Each tier stores and loads flat byte payloads
(base.py); the hook layer (offload/hooks.py) handles dtypes, shapes and views."""
