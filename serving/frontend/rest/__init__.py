"""The native REST API: QA (/v1/qa, /v1/qa/batch, /v1/models), health (/healthz, /readyz, /metrics),
admin (/admin/...): ``routes.py``; its request and response models are ``serving/frontend/schemas.py``.
"""
