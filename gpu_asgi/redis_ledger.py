"""``from gpu_asgi.redis_ledger import RedisLedger`` keeps working; ``gpu_asgi.RedisLedger`` is the
same class (and the name to prefer). Importing this module imports ``redis`` (the redis extra)."""

from ._ledger.redis.ledger import RedisLedger

RedisLedger.__module__ = "gpu_asgi"

__all__ = ["RedisLedger"]
