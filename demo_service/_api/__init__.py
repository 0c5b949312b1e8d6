"""The HTTP API: routes, request and response schemas, and error answers."""
