"""tests/vllm runs in its own venv (``bash tests/vllm/run.sh``): vLLM pins versions the main suite's
venv does not have. Where vLLM is not installed (the main suite), its tests are not collected."""

import importlib.util

collect_ignore_glob = [] if importlib.util.find_spec("vllm") else ["test_*.py"]
