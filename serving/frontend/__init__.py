"""The front end: the server's app and its settings, and one sub-package per protocol it speaks.

- ``app.py`` (``build_app``), ``settings.py`` and its flags (``placement_flags.py``,
  ``scheduler_flags.py``), ``layout.py``, ``cli.py`` (``shardserve serve``), ``api_role.py`` and
  ``api_workers.py`` (``--api-workers``);
- what every protocol shares: ``qa_call.py`` (one QA call) and ``schemas.py`` (the QA server's models);
- ``http/``: the HTTP plumbing under every route; ``rest/``: the native API (/v1, health, admin);
  ``v2/``: the Open Inference Protocol's REST routes and Triton's extensions; ``grpc/``: Triton's
  gRPC service; ``status/``: the status page, its JSON and the offline API docs.
"""
