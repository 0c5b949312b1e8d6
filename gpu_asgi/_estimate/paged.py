"""Paged KV caches (vLLM, SGLang, TGI): memory is handed out in whole blocks, never in tokens.

A server with a paged KV cache gives each sequence ``ceil(tokens / block_size)`` blocks of
``block_size`` tokens: a sequence of 129 tokens with 128-token blocks holds two full blocks. An
estimate in tokens (``LinearEstimator``) is short by up to a block per sequence, and at a full
cache that one block lets in a request too many: the server then preempts. ``PagedKVEstimator``
counts what the server allocates; ``paged_kv_budget`` is the budget those blocks come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from .contract import check_counts

#: Blocks vLLM keeps out of every cache: block 0 is its null block (a placeholder for padding and
#: skipped positions), so a cache of N blocks serves N - 1 (``BlockPool``: ``num_gpu_blocks - 1``).
VLLM_RESERVED_BLOCKS = 1


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks one sequence of ``tokens`` tokens holds: ``ceil(tokens / block_size)``."""
    return -(-tokens // block_size)


@dataclass(frozen=True, slots=True)
class PagedKVEstimator:
    """``batch * (fixed_bytes + ceil((prompt + max_new) / block_size) * block_size * bytes_per_token)``.

    The KV cache a sequence holds at its longest, in the whole blocks a paged server allocates;
    ``bytes_per_token`` is the KV cache's bytes per token (all layers, keys and values:
    ``2 * layers * kv_heads * head_dim * dtype bytes``). Each of ``batch`` sequences gets its own
    blocks, as vLLM gives each of a request's ``n`` samples its own. Prefix caching can share a
    prompt's full blocks between sequences, so the estimate is an upper bound there.
    ``fixed_bytes`` is per sequence and not rounded (0 for a server whose only per-request memory
    is the cache). ``max_sequence_tokens`` caps a sequence's tokens where the server stops every
    sequence (vLLM's ``max_model_len``): a request that leaves ``max_tokens`` unset, which vLLM
    reads as "up to the model's length", then reserves exactly that.
    """

    bytes_per_token: int
    block_size: int
    fixed_bytes: int = 0
    max_sequence_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.bytes_per_token < 0 or self.fixed_bytes < 0:
            raise ValueError(f"bytes_per_token and fixed_bytes must be >= 0, got {self!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1 token, got {self.block_size}")
        if self.max_sequence_tokens is not None and self.max_sequence_tokens < 1:
            raise ValueError(f"max_sequence_tokens must be >= 1 (or None), got {self.max_sequence_tokens}")

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Blocks one sequence of this request holds at its longest."""
        check_counts(prompt_tokens, max_new_tokens, 1)
        return blocks_for(self._tokens(prompt_tokens, max_new_tokens), self.block_size)

    def _tokens(self, prompt_tokens: int, max_new_tokens: int) -> int:
        tokens = prompt_tokens + max_new_tokens
        cap = self.max_sequence_tokens
        return tokens if cap is None or tokens <= cap else cap

    def estimate(
        self, prompt_tokens: int, max_new_tokens: int, batch: int = 1, *, sampling: bool | None = None
    ) -> int:
        check_counts(prompt_tokens, max_new_tokens, batch)  # greedy or sampling: the same blocks
        return batch * (self.fixed_bytes + self.blocks(prompt_tokens, max_new_tokens) * self.bytes_per_block)


def paged_kv_budget(
    num_blocks: int, block_size: int, bytes_per_token: int, *, reserved_blocks: int = VLLM_RESERVED_BLOCKS
) -> int:
    """Bytes of the blocks a paged cache of ``num_blocks`` can give to sequences:
    ``(num_blocks - reserved_blocks) * block_size * bytes_per_token`` (vLLM keeps one, its null block).

    With ``PagedKVEstimator`` of the same ``block_size`` and ``bytes_per_token``, every admitted set
    of requests fits in the cache at its longest, so the server never has to preempt one.
    """
    if block_size < 1 or bytes_per_token < 1:
        raise ValueError(f"block_size and bytes_per_token must be >= 1, got {block_size} and {bytes_per_token}")
    if reserved_blocks < 0:
        raise ValueError(f"reserved_blocks must be >= 0, got {reserved_blocks}")
    usable = num_blocks - reserved_blocks
    if usable < 1:
        raise ValueError(f"a cache of {num_blocks} blocks leaves none for sequences ({reserved_blocks} reserved)")
    return usable * block_size * bytes_per_token
