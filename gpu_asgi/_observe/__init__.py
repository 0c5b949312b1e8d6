"""Observability: OpenTelemetry spans, Prometheus metrics and health."""
