"""What the attention paths share: the static settings, and every formula a token's bits
depend on outside the dots (logit scaling, the key mask, the split fold).

The GPU kernel (``attention_triton``), the CPU formulation (``attention_cpu``) and the entry
points (``attention``) all take these from here, so the paths cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax.numpy as jnp
import numpy as np

SPLIT_SIZE = 512
HEAD_DIMS = (64, 128)
MIN_KV_TILE = 64


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static settings of one attention call (hashable: a jit static argument).

    scale: logit scale; softcap: ``c * tanh(s / c)`` on the scaled logits (None: off);
    window: a token at p sees keys p - window < j <= p (None: all earlier keys);
    split_size: keys are reduced in splits of this many tokens starting at absolute
    multiples of it - part of the numerics: a token's bits depend on it, never on the batch.
    """

    scale: float
    softcap: float | None = None
    window: int | None = None
    split_size: int = SPLIT_SIZE

    @classmethod
    def create(
        cls, head_dim: int, *, scale=None, sliding_window=None, logit_softcap=None, split_size=SPLIT_SIZE
    ):
        """Validated settings from the public arguments (clear errors naming the argument)."""
        if not _is_int(split_size) or split_size < 1:
            raise ValueError(f"attention: split_size must be a positive int, got {split_size!r}")
        scale = float(head_dim**-0.5 if scale is None else scale)
        if not (np.isfinite(scale) and scale > 0):
            raise ValueError(f"attention: scale must be a finite positive number, got {scale!r}")
        if sliding_window is not None and (not _is_int(sliding_window) or sliding_window < 1):
            raise ValueError(f"attention: sliding_window must be a positive int, got {sliding_window!r}")
        if logit_softcap is not None:
            ok = isinstance(logit_softcap, numbers.Real) and not isinstance(logit_softcap, bool)
            if not ok or not (np.isfinite(logit_softcap) and logit_softcap > 0):
                raise ValueError(
                    f"attention: logit_softcap must be a finite positive number, got {logit_softcap!r}"
                )
        return cls(
            scale=scale,
            softcap=None if logit_softcap is None else float(logit_softcap),
            window=None if sliding_window is None else int(sliding_window),
            split_size=int(split_size),
        )

    def num_splits(self, max_context: int) -> int:
        """Splits covering ``max_context`` keys (a block table's capacity)."""
        return -(-max_context // self.split_size)


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def kv_tile(block_size: int) -> int:
    """GPU: keys are read in tiles of this many tokens, starting at absolute multiples."""
    return max(MIN_KV_TILE, block_size)


def scores(s, spec: AttentionSpec):
    """Scaled (and soft-capped) logits from the raw q.k dots."""
    s = s * spec.scale
    if spec.softcap is not None:
        s = spec.softcap * jnp.tanh(s / spec.softcap)
    return s


def key_mask(j, pos, ctx, window: int | None):
    """Key j is visible to a token at ``pos`` of a sequence with ``ctx`` cached tokens."""
    ok = (j <= pos) & (j < ctx)
    if window is not None:
        ok &= j > pos - window
    return ok


def split_used(split: int, pos, spec: AttentionSpec):
    """Whether a token at ``pos`` has any visible key in ``split`` (False for padding)."""
    used = (pos >= 0) & (split * spec.split_size <= pos)
    if spec.window is not None:
        used &= (split + 1) * spec.split_size > pos - spec.window + 1
    return used


def fold_splits(m, l, acc, pos, spec: AttentionSpec):
    """Left fold of the per-split fp32 states m, l [T, Hkv, S, R], acc [T, Hkv, S, R, D] in
    split order, over the splits each token uses.

    Which splits are used follows from the position alone (not from the values, so a NaN
    in the data propagates instead of being dropped); the first used split starts the fold
    as it is. Returns the normalised output [T, Hkv, R, D] (zeros for padding tokens).
    """
    started = jnp.zeros(pos.shape, bool)
    fm, fl, facc = m[:, :, 0], l[:, :, 0], acc[:, :, 0]
    for s in range(m.shape[2]):
        sm, sl, sacc = m[:, :, s], l[:, :, s], acc[:, :, s]
        if s:
            mx = jnp.maximum(fm, sm)
            mx_safe = jnp.where(mx == -jnp.inf, 0.0, mx)
            a, b = jnp.exp(fm - mx_safe), jnp.exp(sm - mx_safe)
            st = started[:, None, None]
            sm = jnp.where(st, mx, sm)
            sl = jnp.where(st, fl * a + sl * b, sl)
            sacc = jnp.where(st[..., None], facc * a[..., None] + sacc * b[..., None], sacc)
        use = split_used(s, pos, spec)
        u = use[:, None, None]
        fm, fl, facc = jnp.where(u, sm, fm), jnp.where(u, sl, fl), jnp.where(u[..., None], sacc, facc)
        started |= use
    st = started[:, None, None]
    return jnp.where(st[..., None], facc / jnp.where(st, fl, 1.0)[..., None], 0.0)
