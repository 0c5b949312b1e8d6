"""What finding a request's tenant costs: ``find_tenant`` + ``tenant_label`` per key kind.

    python -m tests.benchmarks.bench_tenant_keys [--calls 200000]
"""

from __future__ import annotations

import argparse
import timeit

from gpu_asgi import TenantKey
from gpu_asgi._admission.tenant_keys import find_tenant
from gpu_asgi._observe.labels import tenant_label

from ._report import table

#: The headers of a typical JSON request with an API key and a tenant header.
SCOPE = {
    "headers": [
        (b"host", b"api.example"), (b"content-type", b"application/json"), (b"content-length", b"40"),
        (b"x-tenant-id", b"acme"), (b"authorization", b"Bearer sk-0123456789abcdef0123456789"),
    ]
}
BODY = {"prompt": "hi", "user": "bob"}
KEYS = (TenantKey.header("x-tenant-id"), TenantKey.body_field("user"), TenantKey.api_key(), TenantKey.api_key(secret=b"s"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    named = {"acme"}
    rows = []
    for key in KEYS:
        keys = (key,)
        seconds = timeit.timeit(lambda keys=keys: tenant_label(find_tenant(keys, SCOPE, BODY), named), number=args.calls)
        rows.append([repr(key), seconds / args.calls * 1e6])
    print(table(rows, ["tenant key", "µs per request"]))


if __name__ == "__main__":
    main()
