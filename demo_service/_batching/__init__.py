"""Dynamic batching: which requests run together, the device run, and each request's sequences."""
