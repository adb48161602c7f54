"""The HTTP plumbing under every route, whichever protocol: connections, bodies, identity, the document.

- ``protocol.py``: uvicorn's HTTP/1.1 protocol with a request-header deadline, and the draining server;
- ``content_encoding.py``: gzip / deflate request bodies, inflated within ``max_body_bytes``;
- ``json_body.py``: the base route class of routes with a JSON body (decode errors as the route's own);
- ``access.py``: request ids, the access log, request metrics, the API key;
- ``openapi.py``: the OpenAPI document, kept equal to what the routes answer.
"""
