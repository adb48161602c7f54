"""The status page and the browser pages, served by the package itself (no CDN, works offline).

- ``pages.py``: ``/`` (the status page + QA playground), the ``/ui`` app and ``/docs`` / ``/redoc``;
- ``board.py``: the numbers of ``GET /ui/status``, read from the metrics registry and the engine;
- ``schemas.py``: the response models of ``GET /ui/status``;
- ``ui/``: the page's static files (``index.html``, ``app.js``, ``app.css``; package data).
"""
