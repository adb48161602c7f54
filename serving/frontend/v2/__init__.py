"""The Open Inference Protocol (KServe v2) over REST, with Triton's extensions.

- ``routes.py``: the v2 routes (health, metadata, inference) and their error object;
- ``tensors.py``: what a v2 inference request means and how answers become output tensors (REST and gRPC);
- ``binary.py``: the binary tensor data extension (Triton's clients' default);
- ``model_config.py``, ``statistics.py``, ``repository.py``: Triton's model configuration,
  statistics and model repository extensions.
"""
