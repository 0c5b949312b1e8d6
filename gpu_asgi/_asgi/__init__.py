"""The ASGI layer: the middleware, the only code that sends, and how a request's route is found."""
