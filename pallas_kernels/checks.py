"""Input checks shared by the ops: clear errors before anything is traced."""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def is_int(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_positive_int(what: str, value, *, numpy: bool = True, why: str = "") -> None:
    """ValueError "``what`` must be a positive int[ ``why``], got ..." unless ``value`` is an
    integer >= 1 (``numpy=False``: a Python int only - for values that end up in configs and
    records as JSON). The one rule for every positive-int argument and setting."""
    ok = is_int(value) if numpy else isinstance(value, int) and not isinstance(value, bool)
    if not ok or value < 1:
        numpy_int = not numpy and is_int(value) and not isinstance(value, int)
        kind = "a positive Python int (int(...) of it)" if numpy_int else "a positive int"
        raise ValueError(f"{what} must be {kind}{' ' + why if why else ''}, got {value!r}")


def _dtype(op: str, name: str, a):
    dtype = getattr(a, "dtype", None)
    if dtype is None:
        raise TypeError(f"{op}: {name} must be an array, got {type(a).__name__}")
    return jnp.dtype(dtype)


def check_float_dtype(op: str, **arrays) -> None:
    for name, a in arrays.items():
        dtype = _dtype(op, name, a)
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} has dtype {dtype}; supported: bfloat16, float16, float32")


def check_out_dtype(op: str, out_dtype):
    """``out_dtype`` as a dtype the kernels write (bfloat16, float16, float32), else TypeError."""
    try:
        dtype = jnp.dtype(out_dtype)
    except TypeError:
        raise TypeError(f"{op}: out_dtype must be a dtype, got {out_dtype!r}") from None
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: out_dtype must be bfloat16, float16 or float32, got {dtype}")
    return dtype


def check_same_dtype(op: str, **arrays) -> None:
    dtypes = {name: _dtype(op, name, a) for name, a in arrays.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{n}={d}" for n, d in dtypes.items())
        raise TypeError(f"{op}: mixed dtypes ({listed}); cast them to one dtype first")


def check_rank(op: str, name: str, a, rank: int) -> None:
    shape = getattr(a, "shape", None)
    if shape is None or len(shape) != rank:
        raise ValueError(f"{op}: {name} must be {rank}-D, got shape {shape}")


def check_rows(op: str, name: str, a) -> None:
    if a.shape[0] == 0:
        raise ValueError(f"{op}: {name} has no rows")
    if a.shape[-1] == 0:
        raise ValueError(f"{op}: {name} has no columns")


def check_eps(op: str, eps) -> float:
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: eps must be a real number, got {type(eps).__name__}")
    eps = float(eps)
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"{op}: eps must be finite and >= 0, got {eps}")
    return float(eps)


def short_repr(value, limit: int = 200) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (an error never quotes a
    whole multi-megabyte input)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
