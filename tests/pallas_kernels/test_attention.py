"""Paged attention: accuracy vs float64, bitwise invariance across batching/chunking/block
placement, negative control, write_kv, bad input, and the CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.attention import attention, attention_reference, write_kv
from pallas_kernels.attention_math import EX2_PTX
from pallas_kernels.runtime import TRITON_CUSTOM_CALL, cuda_export
from tests.conftest import bits, rand

# (backend, interpret, gpu_kernel): the CPU formulation, and each GPU kernel in interpret mode
# (each compared with itself: interpret mode's CPU dot bits depend on the row count, so the
# two GPU kernels agree bit for bit only on the GPU - benchmarks/attention.py checks that).
BACKENDS = [("jnp", False, "auto"), ("triton", True, "tokens"), ("triton", True, "tiles")]


class Paged:
    """Sequences of given lengths with random K/V, stored in randomly placed cache blocks."""

    def __init__(self, lens, *, hq=8, hkv=2, d=64, bs=16, max_blocks=None, dtype=jnp.float32, seed=0):
        rng = np.random.default_rng(seed)
        self.lens, self.hq, self.hkv, self.d, self.bs, self.dtype = list(lens), hq, hkv, d, bs, dtype
        per = [-(-n // bs) for n in lens]
        self.max_blocks = max_blocks or max(per)
        self.num_blocks = sum(per) + 1 + 3  # block 0 is the null block; a few spare
        order = 1 + rng.permutation(self.num_blocks - 1)
        self.bt = np.zeros((len(lens), self.max_blocks), np.int32)
        c = 0
        for s, n in enumerate(per):
            self.bt[s, :n] = order[c : c + n]
            c += n
        self.k = [rand((n, hkv, d), dtype) for n in lens]  # per-sequence dense K/V
        self.v = [rand((n, hkv, d), dtype) for n in lens]
        self.q = [rand((n, hq, d), dtype) for n in lens]  # one query per position
        self.fill()

    def slots(self, s, positions):
        positions = np.asarray(positions)
        return self.bt[s, positions // self.bs] * self.bs + positions % self.bs

    def fill(self):
        shape = (self.num_blocks, self.bs, self.hkv, self.d)
        # stale garbage everywhere (NaN too), so masking must not rely on a clean cache
        kc = jnp.full(shape, jnp.nan, self.dtype)
        vc = jnp.full(shape, jnp.nan, self.dtype)
        slots = np.concatenate([self.slots(s, np.arange(n)) for s, n in enumerate(self.lens)])
        self.kc, self.vc = write_kv(
            kc, vc, jnp.concatenate(self.k), jnp.concatenate(self.v), jnp.asarray(slots, jnp.int32)
        )

    def run(self, tokens, *, backend="jnp", interpret=False, gpu_kernel="auto", **kw):
        """tokens: list of (seq, pos); pos -1 = padding. Returns [T, Hq, D]."""
        seq = np.array([s for s, _ in tokens], np.int32)
        pos = np.array([p for _, p in tokens], np.int32)
        if not hasattr(self, "_qpad"):  # one gather instead of T slices
            self._qpad = jnp.concatenate(
                [jnp.concatenate(self.q), jnp.zeros((1, self.hq, self.d), self.dtype)]
            )
            self._start = np.concatenate([[0], np.cumsum(self.lens)])
        rows = np.array([self._start[s] + p if p >= 0 else len(self._qpad) - 1 for s, p in tokens])
        q = self._qpad[rows]
        args = (q, self.kc, self.vc, self.bt, np.array(self.lens, np.int32), seq, pos)
        return attention(*args, backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, **kw)

    def f64(self, s, p, *, window=None, softcap=None):
        if not hasattr(self, "_np"):
            self._np = [[np.asarray(a, np.float64) for a in arrs] for arrs in (self.q, self.k, self.v)]
        q, k, v = self._np[0][s][p], self._np[1][s][: p + 1], self._np[2][s][: p + 1]
        g = self.hq // self.hkv
        out = np.zeros((self.hq, self.d))
        for h in range(self.hq):
            sc = k[:, h // g] @ q[h] / np.sqrt(self.d)
            if softcap is not None:
                sc = softcap * np.tanh(sc / softcap)
            if window is not None:
                sc[: max(0, p + 1 - window)] = -np.inf
            e = np.exp(sc - sc.max())
            out[h] = (e / e.sum()) @ v[:, h // g]
        return out


def all_tokens(paged):
    return [(s, p) for s, n in enumerate(paged.lens) for p in range(n)]


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
@pytest.mark.parametrize("d", [64, 128])
def test_accuracy(dtype, tol, backend, interpret, gpu_kernel, d):
    # lengths 1, bs - 1, bs, bs + 1 and several 64-token splits
    paged = Paged([1, 15, 16, 17, 150], d=d, dtype=dtype)
    tokens = all_tokens(paged)
    out = np.asarray(
        paged.run(tokens, backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, split_size=64),
        np.float64,
    )
    ref = np.stack([paged.f64(s, p) for s, p in tokens])
    assert np.abs(out - ref).max() / np.abs(ref).max() <= tol


@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
def test_sliding_window_and_softcap(backend, interpret, gpu_kernel):
    paged = Paged([130, 40], hq=4, hkv=4)
    tokens = all_tokens(paged)
    out = np.asarray(
        paged.run(
            tokens,
            backend=backend,
            interpret=interpret,
            gpu_kernel=gpu_kernel,
            split_size=64,
            sliding_window=37,
            logit_softcap=5.0,
        )
    )
    ref = np.stack([paged.f64(s, p, window=37, softcap=5.0) for s, p in tokens])
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5


@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
def test_padding_tokens_give_zeros_and_touch_nothing(backend, interpret, gpu_kernel):
    paged = Paged([20, 5])
    real = paged.run([(0, 19), (1, 4)], backend=backend, interpret=interpret, gpu_kernel=gpu_kernel)
    padded = paged.run(
        [(0, -1), (0, 19), (0, -1), (1, 4), (0, -1)],
        backend=backend,
        interpret=interpret,
        gpu_kernel=gpu_kernel,
    )
    assert np.all(np.asarray(padded)[[0, 2, 4]] == 0)
    np.testing.assert_array_equal(bits(padded[np.array([1, 3])]), bits(real))


def _chunked_rows(paged, s, p, chunk, backend, interpret, others, gpu_kernel="auto"):
    """Token (s, p) inside a prefill chunk of `chunk` tokens ending at p, among other tokens."""
    chunk_tokens = [(s, q) for q in range(p - chunk + 1, p + 1)]
    tokens = others[:2] + chunk_tokens + others[2:]
    out = paged.run(tokens, backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, split_size=64)
    return bits(out[2 + chunk - 1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_invariance_decode_vs_prefill_chunks_cpu(dtype):
    paged = Paged([600, 70, 9, 300], dtype=dtype)
    others = [(1, 69), (3, 200), (2, 8), (3, 299)]
    for p in (599, 520, 64, 0):
        decode = bits(paged.run([(0, p)], split_size=64))[0]
        for chunk in (1, 3, 17, 512):
            if chunk > p + 1:
                continue
            got = _chunked_rows(paged, 0, p, chunk, "jnp", False, others)
            np.testing.assert_array_equal(got, decode, err_msg=f"p={p} chunk={chunk}")


@pytest.mark.parametrize("gpu_kernel, d", [("tokens", 64), ("tiles", 64), ("tiles", 128)])
def test_invariance_decode_vs_prefill_chunks_pallas_interpret(gpu_kernel, d):
    """Each GPU kernel in interpret mode: a token alone == inside chunks among other tokens
    (for ``tiles``: at any row of a tile, with other sequences' rows in the same tile). At
    head_dim 128 the logit scale is no power of two: a tile the token's chunk sees only in part
    (masked) is a full tile for the token alone (``attention_math.rounded_product``)."""
    paged = Paged([150, 30], hq=4, hkv=2, d=d)
    others = [(1, 29), (1, 3)]
    for p in (149, 70):
        decode = bits(
            paged.run([(0, p)], backend="triton", interpret=True, gpu_kernel=gpu_kernel, split_size=64)
        )[0]
        for chunk in (1, 3, 17, 40):
            got = _chunked_rows(paged, 0, p, chunk, "triton", True, others, gpu_kernel)
            np.testing.assert_array_equal(got, decode, err_msg=f"p={p} chunk={chunk}")


def test_interpret_mode_rounds_the_logit_scaling_in_full_and_masked_tiles_alike():
    """Why the GPU kernels' interpret mode scales logits by ``rounded_product``: XLA's CPU code
    fuses ``s * scale - m`` into one fused multiply-add in a full tile (its ``ok`` is one scalar,
    hoisted out of the loop) but not in a masked tile. At head_dim 128 (a scale that is no power
    of two) that gave a row other bits in a full tile than in a masked one that hides no key
    (the control below); with ``rounded_product`` both round twice, as on the GPU."""
    from pallas_kernels.attention_math import AttentionSpec, kv_tile_step, rounded_product

    spec, rows, n, d = AttentionSpec.create(128), 16, 64, 128
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(x), jnp.float32) for x in ((rows, d), (n, d), (n, d)))
    state = (
        jnp.full((rows,), 0.5, jnp.float32),
        jnp.ones((rows,), jnp.float32),
        jnp.zeros((rows, d), jnp.float32),
    )

    def tiles(scale_mul):  # (the operands are arguments: constants would be folded at compile time)
        def step(ok, state, q, k, v):
            return kv_tile_step(state, q, k, v, ok, spec, jnp.exp2, scale_mul)

        masked = jax.jit(lambda lim, *a: step(jnp.arange(n)[None, :] <= lim[:, None], *a))
        full = jax.jit(lambda flag, *a: step(jnp.broadcast_to(flag, (1, n)), *a))
        args = (state, q, k, v)
        return [bits(x) for x in masked(jnp.full((rows,), n), *args)], [bits(x) for x in full(True, *args)]

    masked, full = tiles(rounded_product)
    assert all(np.array_equal(a, b) for a, b in zip(masked, full, strict=True))
    masked, full = tiles(None)  # control: the plain product, contracted in the full tile only
    assert not all(np.array_equal(a, b) for a, b in zip(masked, full, strict=True))


@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
def test_invariance_batch_composition_and_slots(backend, interpret, gpu_kernel):
    paged = Paged([90, 33, 64, 7, 120], seed=3)
    rng = np.random.default_rng(1)
    target = (0, 89)
    alone = bits(
        paged.run([target], backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, split_size=64)
    )[0]
    pool = all_tokens(paged)
    for trial in range(3):
        picks = [pool[i] for i in rng.choice(len(pool), size=int(rng.integers(1, 12)), replace=False)]
        slot = int(rng.integers(0, len(picks) + 1))
        tokens = picks[:slot] + [target] + picks[slot:]
        out = bits(
            paged.run(tokens, backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, split_size=64)
        )
        np.testing.assert_array_equal(out[slot], alone, err_msg=f"trial {trial}")


@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
def test_invariance_kv_in_other_physical_blocks(backend, interpret, gpu_kernel):
    """Prefix caching and preemption move a sequence's KV: its results must not change."""
    a = Paged([100, 50], seed=5)
    ref = bits(
        a.run(
            [(0, 99), (0, 40), (1, 49)],
            backend=backend,
            interpret=interpret,
            gpu_kernel=gpu_kernel,
            split_size=64,
        )
    )
    b = Paged([100, 50], seed=5)  # same data ...
    b.k, b.v, b.q = a.k, a.v, a.q
    b.num_blocks = a.num_blocks + 10  # ... in other physical blocks
    remap = 1 + np.random.default_rng(9).permutation(b.num_blocks - 1)
    b.bt = np.where(np.arange(a.bt.shape[1]) < np.array([[7], [4]]), remap[a.bt], 0).astype(np.int32)
    b.fill()
    assert not np.array_equal(a.bt[0], b.bt[0])
    got = bits(
        b.run(
            [(0, 99), (0, 40), (1, 49)],
            backend=backend,
            interpret=interpret,
            gpu_kernel=gpu_kernel,
            split_size=64,
        )
    )
    np.testing.assert_array_equal(got, ref)


def test_cpu_bits_do_not_depend_on_the_block_table_width():
    """The block-table width sets the split count S (the engine's max_model_len, the trainer's
    row length). The CPU fold over splits was a Python loop, and XLA fused it differently per
    S: a token past its first split got other bits at another width (1,402 of 8,192 values
    at 1,300 tokens, widths of 4 and 16 splits). It is a scan now (NUMERICS_VERSION 7)."""
    tokens = [(0, 299), (0, 200), (0, 70), (0, 10)]
    a = Paged([300], max_blocks=64, seed=11)
    full, runs = a.bt, {}
    for width in (19, 24, 40, 64):  # 5, 6, 10 and 16 splits of 64 keys (19 blocks in use)
        a.bt = full[:, :width]
        runs[width] = bits(a.run(tokens, split_size=64))
    for width in (24, 40, 64):
        np.testing.assert_array_equal(runs[width], runs[19])
    # the control: the comparison sees every split - one value in split 4 (keys 256-319) moved
    v = np.array(a.v[0])
    v[260, 0, 0] += 1.0
    a.v = [jnp.asarray(v)]
    a.fill()
    moved = bits(a.run(tokens, split_size=64))
    assert not np.array_equal(moved[0], runs[19][0]) and np.array_equal(moved[1:], runs[19][1:])


def test_cpu_program_does_not_grow_with_the_context():
    """The CPU formulation walks a tile's splits in a loop: its program holds one split's dots
    whatever the block table's width (a Python loop held one copy a split - 64 at 32k tokens -
    and compiled in 8 s instead of 1.5). Control: the dots are counted (two a split)."""

    def dots(width):
        args = (
            jax.ShapeDtypeStruct((8, 8, 64), jnp.float32),
            jax.ShapeDtypeStruct((width + 1, 16, 2, 64), jnp.float32),
            jax.ShapeDtypeStruct((width + 1, 16, 2, 64), jnp.float32),
            jax.ShapeDtypeStruct((2, width), jnp.int32),
            *(jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((2,), (8,), (8,))),
        )
        return jax.jit(attention).lower(*args).as_text().count("dot_general")

    one, many = dots(8), dots(512)  # 1 split of 512 keys, 16 splits
    assert one == many == 2, (one, many)


def test_negative_control_xla_reference_is_not_invariant():
    """The invariant=False path (XLA, dense over the batch's longest context) changes the same row."""
    paged = Paged([100, 640, 50], seed=7)
    diffs = 0
    for p in (99, 37):
        args = lambda tokens: (
            jnp.stack([paged.q[s][q] for s, q in tokens]),
            paged.kc,
            paged.vc,
            jnp.asarray(paged.bt),
            jnp.asarray(paged.lens, jnp.int32),
            jnp.asarray([s for s, _ in tokens], jnp.int32),
            jnp.asarray([q for _, q in tokens], jnp.int32),
        )
        alone_lens = jnp.asarray([100, 1, 1], jnp.int32)
        a = args([(0, p)])
        alone = attention_reference(*a[:4], alone_lens, *a[5:])
        batched = attention_reference(*args([(0, p), (1, 639), (2, 49)]))
        diffs += int(np.sum(bits(alone)[0] != bits(batched)[0]))
    assert diffs > 0, "XLA's attention gave the same bits alone and batched: the control cannot fail"


def test_write_kv_places_rows_and_sends_padding_to_the_null_block():
    kc = jnp.zeros((4, 8, 2, 64), jnp.float32)
    vc = jnp.zeros((4, 8, 2, 64), jnp.float32)
    k, v = rand((3, 2, 64)), rand((3, 2, 64))
    kc, vc = write_kv(kc, vc, k, v, jnp.asarray([13, -1, 30], jnp.int32))
    np.testing.assert_array_equal(bits(kc[1, 5]), bits(k[0]))
    np.testing.assert_array_equal(bits(vc[3, 6]), bits(v[2]))
    np.testing.assert_array_equal(bits(kc[0, 1]), bits(k[1]))  # padding -> null block 0
    assert float(jnp.abs(kc[2]).max()) == 0.0


@pytest.mark.parametrize("backend,interpret,gpu_kernel", BACKENDS)
def test_nan_in_a_visible_key_propagates(backend, interpret, gpu_kernel):
    """Bad data must show, not be dropped: a NaN key the token can see makes its output NaN."""
    paged = Paged([100], hq=4, hkv=2)
    paged.k[0] = paged.k[0].at[80].set(jnp.nan)
    paged.fill()
    out = np.asarray(
        paged.run(
            [(0, 99), (0, 50)], backend=backend, interpret=interpret, gpu_kernel=gpu_kernel, split_size=64
        )
    )
    assert np.isnan(out[0]).all()  # sees key 80
    assert np.isfinite(out[1]).all()  # position 50 does not


def test_sliding_window_accepts_numpy_ints():
    paged = Paged([70], hq=4, hkv=2)
    a = paged.run([(0, 69)], sliding_window=np.int64(8))
    np.testing.assert_array_equal(bits(a), bits(paged.run([(0, 69)], sliding_window=8)))


def test_write_kv_rejects_bad_slots():
    kc = jnp.zeros((4, 8, 1, 64), jnp.float32)
    k = jnp.ones((2, 1, 64), jnp.float32)
    with pytest.raises(ValueError, match="outside the cache"):
        write_kv(kc, jnp.zeros_like(kc), k, k, jnp.asarray([5, 35], jnp.int32))
    with pytest.raises(TypeError, match="integer"):
        write_kv(jnp.zeros_like(kc), jnp.zeros_like(kc), k, k, np.array([5.7, 9.2], np.float32))
    with pytest.raises(ValueError, match="same cache slot"):
        write_kv(jnp.zeros_like(kc), jnp.zeros_like(kc), k, k, jnp.asarray([5, 5], jnp.int32))


def _base_args(**over):
    a = dict(
        q=jnp.ones((3, 8, 64), jnp.float32),
        k=jnp.ones((5, 16, 2, 64), jnp.float32),
        v=jnp.ones((5, 16, 2, 64), jnp.float32),
        bt=np.ones((2, 2), np.int32),
        cl=np.array([20, 3], np.int32),
        seq=np.array([0, 0, 1], np.int32),
        pos=np.array([18, 19, 2], np.int32),
    )
    a.update(over)
    return a


@pytest.mark.parametrize(
    "over,kw,exc,match",
    [
        ({"q": jnp.ones((3, 7, 64), jnp.float32)}, {}, ValueError, "not a multiple"),
        ({"cl": np.array([40, 3], np.int32)}, {}, ValueError, "block table"),
        (
            {"cl": np.array([-1, 3], np.int32), "pos": np.array([-1, -1, 2], np.int32)},
            {},
            ValueError,
            "negative",
        ),
        ({"q": jnp.ones((3, 8, 64), jnp.bfloat16)}, {}, TypeError, "dtype mismatch"),
        ({"q": jnp.ones((3, 8, 32), jnp.float32)}, {}, ValueError, "head dim"),
        ({"pos": np.array([18, 20, 2], np.int32)}, {}, ValueError, "position"),
        ({"bt": np.array([[1, 9], [1, 1]], np.int32)}, {}, ValueError, "block_tables entries"),
        ({"seq": np.array([0, 0, 1, 1], np.int32)}, {}, ValueError, "token_seq"),
        ({"pos": np.array([1.0, 2.0, 2.0], np.float32)}, {}, TypeError, "token_pos"),
        ({}, {"sliding_window": 0}, ValueError, "sliding_window"),
        ({}, {"logit_softcap": -1.0}, ValueError, "logit_softcap"),
        ({}, {"split_size": 100}, ValueError, "split_size"),
        ({}, {"split_size": 0}, ValueError, "split_size"),
        ({}, {"sliding_window": True}, ValueError, "sliding_window"),
        ({}, {"logit_softcap": float("inf")}, ValueError, "logit_softcap"),
        ({}, {"scale": float("nan")}, ValueError, "scale"),
        (
            {
                "q": jnp.ones((0, 8, 64), jnp.float32),
                "seq": np.zeros(0, np.int32),
                "pos": np.zeros(0, np.int32),
            },
            {},
            ValueError,
            "no tokens",
        ),
    ],
)
def test_bad_input(over, kw, exc, match):
    a = _base_args(**over)
    with pytest.raises(exc, match=match):
        attention(a["q"], a["k"], a["v"], a["bt"], a["cl"], a["seq"], a["pos"], **kw)


def test_cuda_lowering_has_the_kernel_and_cpu_does_not():
    S, i32 = jax.ShapeDtypeStruct, jnp.int32
    shapes = (
        S((64, 32, 128), jnp.bfloat16),
        S((4097, 16, 8, 128), jnp.bfloat16),
        S((4097, 16, 8, 128), jnp.bfloat16),
        S((64, 256), i32),
        S((64,), i32),
        S((64,), i32),
        S((64,), i32),
    )
    text = cuda_export(attention, *shapes)
    assert 'name = "bijax_attention"' in text
    # the one exponential of every GPU kernel, as inline assembly: no libdevice exp of any kind
    # (a kernel that missed the exp2 hook would call __nv_exp2f)
    assert EX2_PTX in text and "__nv_exp" not in text
    cpu = jax.jit(attention).lower(*shapes).as_text()
    assert TRITON_CUSTOM_CALL not in cpu and "bijax_attention" not in cpu


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 100}])
def test_decode_combine_reads_only_the_splits_a_token_uses(kw, monkeypatch):
    """The ``tokens`` kernel stores only the splits a token uses and the combine folds only
    those: the same bits as storing and folding every split (the switch's other side), at
    positions on split boundaries and window edges too. And no unused split's state reaches
    the output (NaN there leaves the bits as they are; a sanity check - the fold masks them
    either way). Control: NaN in a used split reaches the output."""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec, split_used, used_splits

    paged = Paged([300, 70], hq=4, hkv=2, max_blocks=24)  # room for 6 splits of 64 keys
    # split boundaries (0, 64, 128), a window edge on one (291 - 100 + 1 = 192), the last one: padding
    tokens = [(0, 299), (0, 130), (0, 128), (0, 291), (0, 64), (1, 69), (1, 3), (1, 0), (0, -1)]
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][max(p, 0)] for s, p in tokens]).reshape(len(tokens), 2, 2, paged.d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)
    spec = AttentionSpec.create(paged.d, split_size=64, **kw)
    m, l, acc = attention_triton.token_states(q, paged.kc, paged.vc, index, spec=spec, interpret=True)
    splits = m.shape[2]
    used = np.array([[bool(split_used(x, p, spec)) for x in range(splits)] for _, p in tokens])
    assert used.any(axis=1)[:-1].all() and not used.all() and not used[-1].any()
    for p in range(-1, 400):  # the range form is split_used, at every position (and past the table)
        first, last = (int(x) for x in used_splits(jnp.int32(p), spec, splits))
        assert list(range(first, last)) == [x for x in range(splits) if split_used(x, p, spec)], p

    def out(keep):
        k = jnp.asarray(keep)[:, None, :, None]
        nan = lambda a: jnp.where(k.reshape(k.shape + (1,) * (a.ndim - 4)), a, jnp.nan)  # noqa: E731
        o = attention_triton.combine(nan(m), nan(l), nan(acc), pos, spec=spec, interpret=True, dtype=q.dtype)
        return bits(o[:-1])  # (the padding token's output is not used)

    full = out(np.ones_like(used))
    np.testing.assert_array_equal(out(used), full)
    poisoned = used.copy()
    poisoned[0, np.flatnonzero(used[0])[-1]] = False  # control: a used split's state is NaN
    assert not np.array_equal(out(poisoned), full)
    # the A/B switch's other side (every split stored and folded, as before): the same bits
    monkeypatch.setattr(attention_triton, "STORE_USED_SPLITS_ONLY", False)
    states = attention_triton.token_states(q, paged.kc, paged.vc, index, spec=spec, interpret=True)
    o = attention_triton.combine(*states, pos, spec=spec, interpret=True, dtype=q.dtype)
    np.testing.assert_array_equal(bits(o[:-1]), full)


def _kernel_stores(fn, *args):
    """(primitive name, whether it has a mask) of every ref store inside the Pallas kernels
    that ``fn(*args)`` calls (Pallas's stores are "masked_swap", the mask None or not)."""
    found = []

    def walk(jaxpr, inside):
        for e in jaxpr.eqns:
            if inside and e.primitive.name == "masked_swap":
                *_, mask = e.params["args_tree"].unflatten(e.invars)
                found.append((e.primitive.name, mask is not None))
            elif inside and e.primitive.name == "swap":
                found.append((e.primitive.name, False))
            for p in e.params.values():
                for sub in p if isinstance(p, (tuple, list)) else (p,):
                    sub = getattr(sub, "jaxpr", sub)
                    if hasattr(sub, "eqns"):
                        walk(sub, inside or e.primitive.name == "pallas_call")

    walk(jax.make_jaxpr(lambda *a: fn(*a))(*args).jaxpr, False)  # (a new function: traced anew)
    return found


@pytest.mark.parametrize("window", [None, 5])
def test_key_range_is_key_mask(window):
    """``key_range`` (each row's first / last visible key: the Mosaic kernel's ``lean_mask``) is
    ``key_mask & mine`` at every key, position, context and ownership - padding positions (-1),
    keys past the context, window edges. Control: a range one key short differs."""
    from pallas_kernels.attention_math import key_mask, key_range

    j = np.arange(0, 24)[None, :]
    pos, ctx = np.meshgrid(np.arange(-1, 20), np.arange(1, 22), indexing="ij")
    pos, ctx = pos.reshape(-1, 1), ctx.reshape(-1, 1)
    for mine in (np.ones_like(pos, bool), (pos % 3 != 0)):
        want = np.asarray(key_mask(j, pos, ctx, window) & mine)
        first, last = key_range(pos, ctx, window, mine)
        got = j <= np.asarray(last)
        if window is not None:
            got &= j >= np.asarray(first)
        np.testing.assert_array_equal(got, want)
        assert not np.array_equal(got & (j < np.asarray(last)), want)  # control: one key short


def test_decode_rows_in_registers_store_only_the_groups_rows(monkeypatch):
    """With ``DECODE_ROWS_IN_REGISTERS`` every store of the decode kernel and its combine is
    masked to the group's rows (a 3-head group in a 16-row dot): an unmasked store of the padded
    rows would write past the group's block - into the next split's or head's state on the GPU,
    which the interpreter (it pads every block) cannot show. Control: the HBM-padded side's
    stores are plain."""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec

    np.testing.assert_array_equal(attention_triton._row_mask(16, 3, 1), np.arange(16) < 3)
    assert attention_triton._row_mask(16, 3, 2).shape == (16, 1)
    t, hkv, group, d = 3, 2, 3, 64
    spec = AttentionSpec.create(d, split_size=64)
    index = (
        jnp.zeros((2, 8), jnp.int32),
        jnp.ones(2, jnp.int32),
        jnp.zeros(t, jnp.int32),
        jnp.zeros(t, jnp.int32),
    )
    cache = jnp.zeros((9, 16, hkv, d))

    def run(q):
        return attention_triton.attend(q, cache, cache, index, spec=spec, interpret=False, kernel="tokens")

    q = jnp.zeros((t, hkv, group, d))
    for store_used_only in (True, False):
        monkeypatch.setattr(attention_triton, "STORE_USED_SPLITS_ONLY", store_used_only)
        monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", True)
        stores = _kernel_stores(run, q)
        assert len(stores) == 4  # m, l, acc in the kernel, the output in the combine
        assert stores == [("masked_swap", True)] * 4, stores
        monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", False)
        plain = _kernel_stores(run, q)  # control: no mask there
        assert len(plain) == 4 and not any(masked for _, masked in plain), plain


@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 2), (7, 1), (1, 1), (16, 1)])  # groups of 2, 3, 7, 1, 16
def test_decode_rows_padded_in_registers_keep_the_bits(hq, hkv, monkeypatch):
    """The ``tokens`` kernel pads the query-head group to the dot's 16 rows in registers and
    stores, combines and returns only the group's rows: the same bits as padding q in HBM and
    slicing the output (the switch's other side), for groups that are not powers of two too.
    Control: the comparison sees a change of one query head (doubled) of one token."""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec

    paged = Paged([150, 40], hq=hq, hkv=hkv, max_blocks=12)
    tokens = [(0, 149), (0, 64), (1, 39), (1, 0), (0, -1)]
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][max(p, 0)] for s, p in tokens]).reshape(len(tokens), hkv, hq // hkv, paged.d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)
    spec = AttentionSpec.create(paged.d, split_size=64)

    def run(q):
        return attention_triton.attend(
            q, paged.kc, paged.vc, index, spec=spec, interpret=True, kernel="tokens"
        )

    monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", True)
    m, _, acc = attention_triton.token_states(q, paged.kc, paged.vc, index, spec=spec, interpret=True)
    assert m.shape[3] == acc.shape[3] == hq // hkv  # only the group's rows are stored
    new = bits(run(q))
    monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", False)
    old = run(q)
    assert old.shape == q.shape
    np.testing.assert_array_equal(new, bits(old))
    one_head = q.at[0, 0, -1].multiply(2.0)
    assert not np.array_equal(bits(run(one_head)), new)
    if hq == 7:  # the Triton lowering takes a group that is no power of two (masked 16-row loads)
        monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", True)
        gpu = lambda q, k, v: attention_triton.attend(
            q, k, v, index, spec=spec, interpret=False, kernel="tokens"
        )  # noqa: E731
        text = cuda_export(
            gpu, q.astype(jnp.bfloat16), paged.kc.astype(jnp.bfloat16), paged.vc.astype(jnp.bfloat16)
        )
        assert text.count('name = "bijax_attention') == 2  # the kernel and its combine


@pytest.mark.parametrize("kw", [{}, {"sliding_window": 100}])
def test_decode_lanes_walking_their_splits_keep_the_bits(kw, monkeypatch):
    """``DECODE_PROGRAMS``: a decode grid of (token, KV head, lane) programs, each walking its
    used splits one after another, stores the states a program per split stores - so the
    output bits are the same, with either store rule and row padding. Control: the lane count
    is below the split count (each lane walks several splits), and a doubled query head of one
    token changes the bits."""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec

    paged = Paged([300, 70], hq=4, hkv=2, max_blocks=24)  # 6 splits of 64 keys
    tokens = [(0, 299), (0, 130), (0, 291), (1, 69), (1, 3), (0, -1)]
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][max(p, 0)] for s, p in tokens]).reshape(len(tokens), 2, 2, paged.d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)
    spec = AttentionSpec.create(paged.d, split_size=64, **kw)
    programs = 2 * len(tokens) * 2  # 2 lanes a (token, KV head)
    assert attention_triton.decode_lanes(len(tokens), 2, spec.num_splits(24 * 16), programs) == 2
    assert attention_triton.decode_lanes(len(tokens), 2, 6, None) == 6

    def run(q):
        return bits(
            attention_triton.attend(q, paged.kc, paged.vc, index, spec=spec, interpret=True, kernel="tokens")
        )

    ref = run(q)
    for used_only in (True, False):
        for in_registers in (False, True):
            monkeypatch.setattr(attention_triton, "STORE_USED_SPLITS_ONLY", used_only)
            monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", in_registers)
            monkeypatch.setattr(attention_triton, "DECODE_PROGRAMS", programs)
            np.testing.assert_array_equal(run(q), ref)
            monkeypatch.setattr(attention_triton, "DECODE_PROGRAMS", None)
    monkeypatch.setattr(attention_triton, "DECODE_PROGRAMS", programs)
    assert not np.array_equal(run(q.at[0, 1, 0].multiply(2.0)), ref)
    if not kw:  # the Triton lowering takes the lanes' loop and its stores at a split index
        bf = lambda a: a.astype(jnp.bfloat16)  # noqa: E731
        gpu = lambda q, k, v: attention_triton.attend(  # noqa: E731
            q, k, v, index, spec=spec, interpret=False, kernel="tokens"
        )
        for in_registers in (False, True):
            monkeypatch.setattr(attention_triton, "DECODE_ROWS_IN_REGISTERS", in_registers)
            assert cuda_export(gpu, bf(q), bf(paged.kc), bf(paged.vc)).count('name = "bijax_attention') == 2


def test_decode_stages_follow_the_launchs_token_count(monkeypatch):
    """The decode kernel takes ``DECODE_FEW_STAGES`` pipeline stages up to ``DECODE_FEW_TOKENS``
    tokens (the engine's smallest decode bucket) over a 2-byte cache, and 2 otherwise; an
    explicit ``num_stages`` wins.
    Control: with the rule off (0 tokens) every launch takes 2. (A launch choice: the H200
    checked 5 stages give the 2-stage launch's bits, RESULTS.md session 39.)"""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec

    seen = []

    class Stop(Exception):
        pass

    def spy(*args, num_stages, **kw):
        seen.append(num_stages)
        raise Stop

    monkeypatch.setattr(attention_triton, "token_states", spy)
    spec = AttentionSpec.create(64)

    def stages(t, hkv=8, dtype=jnp.bfloat16, **kw):
        q = jnp.zeros((t, hkv, 2, 64), dtype)
        kc = jnp.zeros((4, 16, hkv, 64), dtype)
        i32 = jnp.zeros((t,), jnp.int32)
        index = (jnp.zeros((t, 4), jnp.int32), jnp.ones((t,), jnp.int32), i32, i32)
        with pytest.raises(Stop):
            attention_triton.attend(q, kc, kc, index, spec=spec, interpret=True, kernel="tokens", **kw)
        return seen.pop()

    few = attention_triton.DECODE_FEW_STAGES
    assert few > 2 and attention_triton.DECODE_FEW_TOKENS == 16
    assert [stages(16), stages(17), stages(1), stages(16, hkv=2), stages(32, hkv=4)] == [few, 2, few, few, 2]
    assert stages(1, num_stages=3) == 3
    assert stages(1, dtype=jnp.float32) == 2  # a float32 cache's stages are twice the memory
    monkeypatch.setattr(attention_triton, "DECODE_FEW_TOKENS", 0)
    assert [stages(16), stages(1)] == [2, 2]


@pytest.mark.parametrize("gpu_kernel", ["tokens", "tiles"])
@pytest.mark.parametrize("kw", [{}, {"sliding_window": 100}])
def test_unmasked_full_tiles_and_row_loads_keep_the_bits(gpu_kernel, kw):
    """Walking the KV tiles every row sees without building their mask (``bulk``), and loading
    a tile's keys row by row (``row_loads``), give the bits of masking every tile and loading
    whole pages (interpret mode; the H200 check is benchmarks/attention.py).
    Control: a different split size changes them, so the comparison can fail. (Not with a
    softcap here: in interpret mode the kernel body is XLA CPU code, whose simplifier folds
    ``s * scale / cap`` into ``s * (scale / cap)`` in some programs and not in others, so the
    softcap's bits follow XLA's fusion; the Triton lowering emits the ops as written, and the
    H200 check covers the softcap.)"""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec

    paged = Paged([300, 70, 9], hq=4, hkv=2)
    tokens = [(0, p) for p in range(180, 230)] + [(1, 69), (2, 8), (0, 299)]
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][p] for s, p in tokens]).reshape(len(tokens), 2, 2, paged.d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)

    def run(bulk, split_size=128, row_loads=False):
        spec = AttentionSpec.create(paged.d, split_size=split_size, **kw)
        return bits(
            attention_triton.attend(
                q, paged.kc, paged.vc, index, spec=spec, interpret=True, kernel=gpu_kernel, bulk=bulk,
                row_loads=row_loads,
            )
        )  # fmt: skip

    masked = run(False)
    np.testing.assert_array_equal(run(True), masked)
    np.testing.assert_array_equal(run(True, row_loads=True), masked)
    assert not np.array_equal(run(True, split_size=64), masked)


@pytest.mark.parametrize("hq,hkv", [(6, 2), (14, 2)])  # groups of 3 and 7: not powers of two
def test_dense_row_packing_keeps_the_bits(hq, hkv, monkeypatch):
    """``row_tiles``' "dense" packing puts ``64 // G`` tokens of a G-head group in a tile's rows
    (21 of 3, 9 of 7) where "pow2" pads the group to 4 (8): fewer tiles, the same rows. The Triton
    ``tiles`` kernel gives the same bits either way (interpret mode; the H200 check is
    benchmarks/attention_mgpu.py's launches). Control: a different split size changes them."""
    from pallas_kernels import attention_triton
    from pallas_kernels.attention_math import AttentionSpec, row_tiles

    g = hq // hkv
    paged = Paged([150, 70, 9], hq=hq, hkv=hkv, dtype=jnp.bfloat16, seed=4)
    tokens = [(0, p) for p in range(100, 150)] + [(1, 69), (2, 8), (1, 30), (0, -1)]
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][max(p, 0)] for s, p in tokens]).reshape(len(tokens), hkv, g, paged.d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)

    tiles = {}
    for packing in ("pow2", "dense"):
        qt, rpos, rseq, unpack = row_tiles(q, seq, pos, 64, packing)
        np.testing.assert_array_equal(bits(unpack(qt)), bits(q))
        assert qt.shape[2] == 64
        tiles[packing] = rpos.shape[0]
        real_rows = int((np.asarray(rpos) >= 0).sum())
        assert real_rows == g * int((pos >= 0).sum())  # every real (token, head) once, padding -1
    per_tile = 1 << (g - 1).bit_length()
    assert tiles == {"pow2": -(-len(tokens) // (64 // per_tile)), "dense": -(-len(tokens) // (64 // g))}

    seen = []  # the kernel's tile counts: proof that the packing reached it

    def spy(*args):
        out = row_tiles(*args)
        seen.append((args[-1], out[1].shape[0]))
        return out

    monkeypatch.setattr(attention_triton, "row_tiles", spy)

    def run(packing, split_size=64):
        spec = AttentionSpec.create(paged.d, split_size=split_size, sliding_window=90)
        out = attention_triton.attend(
            q, paged.kc, paged.vc, index, spec=spec, interpret=True, kernel="tiles", packing=packing
        )
        return bits(out)

    base = run("pow2")
    np.testing.assert_array_equal(run("dense"), base)
    assert seen == [("pow2", tiles["pow2"]), ("dense", tiles["dense"])] and tiles["dense"] < tiles["pow2"]
    assert not np.array_equal(run("dense", split_size=128), base)
    with pytest.raises(ValueError, match="packing must be one of"):
        row_tiles(q, seq, pos, 64, "tight")
    with pytest.raises(ValueError, match="launch choice of the Triton tiles kernel only"):
        attention_triton.attend(
            q, paged.kc, paged.vc, index, spec=AttentionSpec.create(paged.d), interpret=True, kernel="tokens",
            packing="dense",
        )  # fmt: skip


def test_write_kv_and_scale_arguments_are_named():
    paged = Paged([20], hq=4, hkv=2)
    k = jnp.zeros((2, 2, 64), jnp.float32)
    with pytest.raises(TypeError, match=r"slot_mapping must be an int array of shape \(2,\), got a list"):
        write_kv(paged.kc, paged.vc, k, k, [16, 17])
    with pytest.raises(TypeError, match="scale must be a finite positive number, got 'x'"):
        paged.run([(0, 5)], scale="x")
