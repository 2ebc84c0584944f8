"""Static padding buckets: the sizes a step's metadata is padded to so that jit compiles once per bucket.

Policy (modelled on tpu-inference's token paddings):
- tokens: powers of two from `min_tokens` up to `token_gap`, then multiples of `token_gap`
  (16, 32, ..., 512, 1024, 1536, ... with the defaults);
- requests: powers of two from `min_reqs`;
- block-table width: powers of two from `min_blocks`.
A step with `n` tokens, `r` requests and `w` blocks per request compiles for the smallest
bucket of each that fits; every step inside the same three buckets reuses the compiled code.
Padding tokens get slot -1; padding requests get query length 0, sequence length 0 and block
table rows of -1.
"""

from __future__ import annotations

import dataclasses

__all__ = ["BucketPolicy", "DEFAULT_BUCKETS"]


def _next_pow2(n: int, lo: int) -> int:
    p = lo
    while p < n:
        p *= 2
    return p


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    min_tokens: int = 16
    token_gap: int = 512
    min_reqs: int = 8
    min_blocks: int = 4

    def __post_init__(self):
        for name in ("min_tokens", "token_gap", "min_reqs", "min_blocks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"BucketPolicy.{name} must be a positive int, got {v!r}")
        if self.min_tokens > self.token_gap:
            raise ValueError(f"BucketPolicy.min_tokens ({self.min_tokens}) must be <= token_gap ({self.token_gap})")

    def tokens(self, n: int) -> int:
        """Padded token count for `n` tokens."""
        _check_count("num_tokens", n)
        if n <= self.token_gap:
            return min(_next_pow2(n, self.min_tokens), self.token_gap) if n > self.min_tokens else self.min_tokens
        return -(-n // self.token_gap) * self.token_gap

    def reqs(self, n: int) -> int:
        """Padded request count for `n` requests."""
        _check_count("num_reqs", n)
        return _next_pow2(n, self.min_reqs)

    def blocks(self, n: int) -> int:
        """Padded block-table width for `n` blocks per request."""
        _check_count("num_blocks", n)
        return _next_pow2(n, self.min_blocks)

    def token_buckets(self, max_tokens: int) -> list[int]:
        """Every token bucket up to the one holding `max_tokens` (for precompiling)."""
        out, n = [], 1
        last = self.tokens(max_tokens)
        while True:
            b = self.tokens(n)
            if not out or b != out[-1]:
                out.append(b)
            if b >= last:
                return out
            n = b + 1


def _check_count(name: str, n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"{name} must be an int, got {type(n).__name__}")
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")


DEFAULT_BUCKETS = BucketPolicy()
