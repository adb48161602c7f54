"""Triton's ``inference.GRPCInferenceService`` (KServe v2 gRPC) on ``--grpc-port``, on the REST code paths.

- ``server.py``: the ``grpc.aio`` server beside uvicorn, on the app's event loop;
- ``service.py``: the RPCs, each doing what its REST route does;
- ``call.py``: the envelope of one RPC (request id, keys, errors as status codes, access log, metrics);
- ``forward.py``: the service of an API process (``--api-workers``), its cold RPCs sent to the core.
"""
