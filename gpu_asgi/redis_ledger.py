"""``from gpu_asgi.redis_ledger import RedisLedger`` keeps working; ``gpu_asgi.RedisLedger`` is the
same class (and the name to prefer). Importing this module imports ``redis`` (the redis extra)."""

from . import RedisLedger  # the package's lazy export, which names it gpu_asgi.RedisLedger

__all__ = ["RedisLedger"]
