"""The Mosaic GPU attention ``tiles`` kernel on CPU: Mosaic GPU interpret mode (TMA, barriers,
wgmma simulated) for its walk, masks, page loads and split fold; its CUDA lowering; clear errors.
Whether its bits equal the Triton kernel's is an H200 question (benchmarks/attention_mgpu.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import attention_mgpu, attention_triton
from pallas_kernels.attention import attention
from pallas_kernels.attention_math import EX2_PTX, AttentionSpec, kv_tile
from pallas_kernels.attention_mgpu import heaviest_first, segments, supported, tiles_mgpu
from pallas_kernels.runtime import MOSAIC_GPU_CUSTOM_CALL, cuda_export
from tests.conftest import bits
from tests.pallas_kernels.test_attention import Paged, all_tokens

BF16 = jnp.bfloat16


@pytest.fixture(autouse=True)
def _no_persistent_compile_cache():
    """This file's kernels run in interpret mode - Python callbacks inside the compiled programs -
    and skip JAX's persistent compilation cache, which the test run shares between its workers
    (tests/conftest.py) and an engine test enables in a worker. Why: in CI (session 52) a
    split-size control here twice got the split-64 bits, never in a process here; an
    executable taken from the cache is one suspect, not shown (open: session 53's note)."""
    from jax._src import compilation_cache

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


def _run(paged, tokens, **kw):
    kw = {"split_size": 64, **kw}
    return paged.run(tokens, backend="triton", interpret=True, gpu_kernel="tiles_mgpu", **kw)


@pytest.mark.parametrize(
    "lens,kw,shape",
    [
        ([1, 15, 16, 17, 150], {}, {"d": 64}),  # pages, partial tiles, three splits
        ([3, 70, 130], {"sliding_window": 40}, {"d": 128}),  # window: splits and tiles skipped
        ([20, 100], {}, {"d": 128, "hq": 28, "hkv": 4}),  # group 7, padded to 8 (8 tokens a tile)
        ([5, 129, 300], {"split_size": 256}, {"d": 64, "bs": 128}),  # 128-key tiles, one page each
    ],
)
def test_accuracy_mixed_batch_nan_cache_and_padding(lens, kw, shape):
    """Every token of every sequence, shuffled (tiles hold several sequences), padding among
    them, stale cache rows all NaN: f64 accuracy, no NaN leaks, padding rows exactly zero."""
    paged = Paged(lens, dtype=BF16, **shape)
    tokens = all_tokens(paged)
    np.random.default_rng(1).shuffle(tokens)
    tokens = tokens[:7] + [(0, -1)] * 3 + tokens[7:]
    out = np.asarray(_run(paged, tokens, **kw), np.float64)
    real = [i for i, (_, p) in enumerate(tokens) if p >= 0]
    ref = np.stack([paged.f64(*tokens[i], window=kw.get("sliding_window")) for i in real])
    assert np.isfinite(out).all()
    assert np.all(out[7:10] == 0)
    assert np.abs(out[real] - ref).max() / np.abs(ref).max() <= 2e-2


def test_a_token_keeps_its_bits_alone_in_chunks_and_among_other_sequences():
    """The walk visits a row's own sequence only, in a fixed order: a token's bits do not depend
    on which tile row it lands in or what else the tile holds. Control: another token's bits
    differ, so the comparison can fail."""
    paged = Paged([150, 30, 90], hq=8, hkv=2, d=64, dtype=BF16, seed=2)
    target = (0, 149)
    alone = bits(_run(paged, [target]))[0]
    cases = {
        "chunk of 17": [(0, p) for p in range(133, 150)],
        "chunk of 40 among others": [(1, 29), (2, 80)] + [(0, p) for p in range(110, 150)] + [(2, 89)],
        "decode batch": [(2, 89), (1, 29), target, (1, 5)],
    }
    for name, tokens in cases.items():
        out = bits(_run(paged, tokens))
        np.testing.assert_array_equal(out[tokens.index(target)], alone, err_msg=name)
    # Control: another token's bits differ, so the comparison can fail. (A split size of 128
    # as the control gave the split-64 bits in CI twice - session 52 - and never here, though
    # 31-151 of this token's 512 outputs differ between the two on 30 input draws (session 53):
    # not explained; open.)
    other = bits(_run(paged, [(0, 148)]))[0]
    assert not np.array_equal(other, alone), "another token's bits are the same: the check cannot fail"


def test_nan_in_a_visible_key_propagates():
    paged = Paged([100], hq=4, hkv=2, dtype=BF16)
    paged.k[0] = paged.k[0].at[80].set(jnp.nan)
    paged.fill()
    out = np.asarray(_run(paged, [(0, 99), (0, 50)]), np.float32)
    assert np.isnan(out[0]).all()  # sees key 80
    assert np.isfinite(out[1]).all()  # position 50 does not


def test_segments_are_each_tiles_sequences_ascending():
    rseq = jnp.asarray([[3, 3, 1, 1, 3, 0], [2, 2, 2, 2, 2, 2]], jnp.int32)
    rpos = jnp.asarray([[5, 6, 0, 1, 7, -1], [-1, -1, -1, -1, -1, -1]], jnp.int32)
    seqs, nseg = segments(rseq, rpos)
    assert nseg.tolist() == [2, 0]
    assert seqs[0, :2].tolist() == [1, 3]  # sequence 0 has only a padding row
    # random tiles: each tile's distinct sequences of valid rows, ascending, then 2**30
    rng = np.random.default_rng(0)
    rseq = rng.integers(0, 9, (16, 48)).astype(np.int32)
    rpos = np.where(rng.random((16, 48)) < 0.3, -1, 7).astype(np.int32)
    seqs, nseg = segments(jnp.asarray(rseq), jnp.asarray(rpos))
    for t in range(16):
        want = sorted(set(rseq[t][rpos[t] >= 0].tolist()))
        assert nseg[t] == len(want) and seqs[t].tolist() == want + [2**30] * (48 - len(want))


def test_out_in_fold_keeps_each_consumers_bytes_apart():
    """``out_in_fold``: each consumer's output box lies inside its own fold rows, on a 1 KB
    boundary (the swizzle's pattern), for every query group and head dim it takes - so no
    consumer's output shares a byte with the other's fold (interpret mode's race detector, one
    union a consumer there, cannot see this) - or the layout is refused by name. It is what
    lets ``k_ahead`` fit at 28 / 4 heads, D 128. Control: the boxes one after another, as in a
    staging buffer of their own, fail the same check."""

    def inside(bases, group, d):
        """Whether every consumer's box is 1 KB-aligned and inside its own fold rows."""
        part, token = attention_mgpu.ROWS * d * 4, group * d * 2
        box = attention_mgpu._box_tokens(group, d, 2)
        return all(
            base * token % 1024 == 0 and c * part <= base * token and (base + box) * token <= (c + 1) * part
            for c, base in enumerate(bases)
        )

    fits = 0
    for d in (64, 128):
        for group in range(1, 65):
            try:
                bases, total = attention_mgpu.out_in_fold_layout(group, d, 2)
            except ValueError as e:
                assert "out_in_fold" in str(e) and f"{group} heads" in str(e)
                continue
            fits += 1
            assert inside(bases, group, d), (group, d)
            assert total == bases[-1] + attention_mgpu._box_tokens(group, d, 2)
    assert fits > 40
    for group, d in ((4, 128), (7, 128), (8, 128), (3, 64), (1, 64)):  # bijax's presets' shapes fit
        attention_mgpu.out_in_fold_layout(group, d, 2)
    assert not inside((0, attention_mgpu._box_tokens(7, 128, 2)), 7, 128)  # control
    # 28 / 4 at D 128: k_ahead fits only with the output in the fold
    shape = dict(consumers=2, fold_in_smem=True, out_buffer=True, qo_rows=12 * 7, k_ahead=True)
    with pytest.raises(ValueError, match="shared memory"):
        attention_mgpu._stages(64, 128, 2, 3, **shape)
    assert attention_mgpu._stages(64, 128, 2, 3, **shape, out_in_fold=True) >= 2


@pytest.mark.parametrize(
    "pv,rounding,overlap,launch",
    [
        ("add", "compiler", False, {}),
        ("into", "two", True, {}),
        ("add", "fma", False, {}),
        ("into", "two", False, {"consumers": 2, "stages": 5, "order": "heaviest", "one_drain": True}),
        ("into", "two", True, {"consumers": 2, "stages": 4, "q_from_smem": True}),
        ("into", "two", False, {"fold_in_smem": True, "order": "heaviest", "packing": "dense"}),
        ("into", "two", False, dict(attention_triton.MGPU_PREFILL_LAUNCH)),  # the engine's
        ("into", "two", False, {**dict(attention_triton.MGPU_PREFILL_LAUNCH), "persistent": 5}),
        ("into", "two", True, dict(attention_triton.MGPU_PREFILL_LAUNCH)),  # ... overlapped scores
        ("into", "two", True, {**dict(attention_triton.MGPU_PREFILL_LAUNCH), "pingpong": True}),  # ... turns
        # ... with a K ring a slot longer and the output staged in the fold's SMEM (one
        # ``RefUnion``; interpret mode has a union a consumer: this form only lowers here)
        (
            "into",
            "two",
            True,
            {
                **dict(attention_triton.MGPU_PREFILL_LAUNCH),
                "k_ahead": True,
                "out_in_fold": True,
                "early_reads": True,
            },
        ),
        ("into", "two", False, {**dict(attention_triton.MGPU_PREFILL_LAUNCH), "pingpong": True}),
        (
            "into",
            "two",
            False,
            {**dict(attention_triton.MGPU_PREFILL_LAUNCH), "prefetch_q": False, "direct_io": False},
        ),
        ("into", "two", False, {**dict(attention_triton.MGPU_PREFILL_LAUNCH), "direct_io": False}),
    ],
)
def test_cuda_lowering_is_one_mosaic_gpu_kernel(pv, rounding, overlap, launch):
    import jax

    s = jax.ShapeDtypeStruct
    spec = AttentionSpec.create(128)
    args = (
        s((200, 8, 4, 128), BF16),
        s((64, 16, 8, 128), BF16),
        s((64, 16, 8, 128), BF16),
        (s((2, 32), jnp.int32), s((2,), jnp.int32), s((200,), jnp.int32), s((200,), jnp.int32)),
    )
    text = cuda_export(
        lambda q, k, v, idx: tiles_mgpu(
            q, k, v, idx, spec=spec, pv=pv, rounding=rounding, overlap=overlap, **launch
        ),
        *args,
    )
    assert MOSAIC_GPU_CUSTOM_CALL in text and "bijax_attention_tiles_mgpu" in text
    assert "xla.gpu.triton" not in text
    # q into tiles and the output back: XLA transposes, but with direct_io (the engine's launch)
    assert ("stablehlo.transpose" in text) != bool(launch.get("direct_io")), launch
    # the one exponential of every GPU kernel (the Triton kernels' inline assembly): ex2.approx.ftz,
    # and no math-dialect exp / exp2 (what a missed exp2 hook would lower to)
    assert EX2_PTX in text and "math.exp" not in text
    # every wait for a wgmma waits for all of them (with a group in flight at each wait ptxas
    # serialized every wgmma of the kernel: its note C7514, session 58)
    assert "wgmma.wait_group.sync.aligned 1;" not in text, launch
    if launch.get("pingpong"):  # the turns reach the kernel: another module than without them
        plain = cuda_export(
            lambda q, k, v, idx: tiles_mgpu(
                q,
                k,
                v,
                idx,
                spec=spec,
                pv=pv,
                rounding=rounding,
                overlap=overlap,
                **{**launch, "pingpong": False},
            ),
            *args,
        )
        assert MOSAIC_GPU_CUSTOM_CALL in plain and plain != text
    if not launch:  # control: the timing probe's exact exp has no such instruction
        probe = cuda_export(
            lambda q, k, v, idx: tiles_mgpu(
                q, k, v, idx, spec=spec, pv=pv, rounding=rounding, overlap=overlap, probe_exact_exp=True
            ),
            *args,
        )
        assert MOSAIC_GPU_CUSTOM_CALL in probe and EX2_PTX not in probe and "math.exp" in probe
        # the base-2 logits probe lowers too, to another kernel (the timing step runs it)
        base2 = cuda_export(
            lambda q, k, v, idx: tiles_mgpu(
                q, k, v, idx, spec=spec, pv=pv, rounding=rounding, overlap=overlap, probe_log2_scores=True
            ),
            *args,
        )
        assert MOSAIC_GPU_CUSTOM_CALL in base2 and EX2_PTX in base2 and base2 != text


def test_direct_io_lowers_without_transposes():
    """The engine's launch (``direct_io``) lowers with no XLA transpose of q or the output at 9
    (28 / 4 heads) and 16 (32 / 8) tokens a tile; where a tile's rows pad the query group
    (``packing="pow2"`` at a group of 7) and without ``direct_io`` (control) it keeps them."""
    s = jax.ShapeDtypeStruct
    spec = AttentionSpec.create(128)

    def transposes(hq, hkv, **kw):
        args = (
            s((200, hkv, hq // hkv, 128), BF16),
            s((64, 16, hkv, 128), BF16),
            s((64, 16, hkv, 128), BF16),
            (s((2, 32), jnp.int32), s((2,), jnp.int32), s((200,), jnp.int32), s((200,), jnp.int32)),
        )
        launch = {**dict(attention_triton.MGPU_PREFILL_LAUNCH), **kw}
        text = cuda_export(lambda q, k, v, idx: tiles_mgpu(q, k, v, idx, spec=spec, **launch), *args)
        return text.count("stablehlo.transpose")

    assert dict(attention_triton.MGPU_PREFILL_LAUNCH)["direct_io"] is True
    assert transposes(28, 4) == 0 and transposes(32, 8) == 0
    assert transposes(28, 4, packing="pow2") > 0 and transposes(32, 8, direct_io=False) > 0


def test_unsupported_calls_are_refused_by_name():
    spec = AttentionSpec.create(64)
    assert "dtype float32" in supported(jnp.float32, 64, spec)
    assert "head_dim 96" in supported(BF16, 96, spec)
    assert "logit_softcap" in supported(BF16, 64, AttentionSpec.create(64, logit_softcap=5.0))
    assert supported(BF16, 128, spec) is None
    from jax.experimental.pallas import mosaic_gpu as plgpu

    q, kc = jnp.ones((1, 1, 4, 64), BF16), jnp.ones((4, 16, 1, 64), BF16)
    idx = (np.ones((1, 2), np.int32), np.array([3], np.int32), np.zeros(1, np.int32), np.array([2], np.int32))
    with pytest.raises(ValueError, match="rounding='two' has no interpret mode"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, pv="add", rounding="two", interpret=plgpu.InterpretGPUParams())
    with pytest.raises(ValueError, match='pv="into" has no interpret mode'):
        tiles_mgpu(q, kc, kc, idx, spec=spec, rounding="compiler", interpret=plgpu.InterpretGPUParams())
    with pytest.raises(ValueError, match="rounding must be one of"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, rounding="fast")
    with pytest.raises(ValueError, match="consumers must be one of"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=3)
    with pytest.raises(ValueError, match="order must be one of"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, order="random")
    for bad in (0, 2.0, "yes"):
        with pytest.raises(ValueError, match="persistent takes True or a positive number"):
            tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=2, persistent=bad)
    with pytest.raises(ValueError, match="with consumers=2"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, persistent=True)
    with pytest.raises(ValueError, match="prefetch_q needs persistent programs and fold_in_smem"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=2, persistent=True, prefetch_q=True)
    with pytest.raises(ValueError, match="direct_io needs prefetch_q"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=2, direct_io=True)
    with pytest.raises(ValueError, match="q_from_smem needs consumers=2"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, q_from_smem=True)
    for launch in ({}, {"one_drain": True}, {"consumers": 2, "overlap": True}):
        with pytest.raises(ValueError, match="pingpong needs consumers=2 and one_drain"):
            tiles_mgpu(q, kc, kc, idx, spec=spec, pingpong=True, **launch)
    with pytest.raises(ValueError, match="early_reads needs persistent programs"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=2, early_reads=True)
    with pytest.raises(ValueError, match="out_in_fold needs direct_io"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, consumers=2, out_in_fold=True)
    with pytest.raises(ValueError, match="k_ahead needs consumers=2"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, k_ahead=True)
    with pytest.raises(ValueError, match="wide_sum needs one_drain"):
        tiles_mgpu(q, kc, kc, idx, spec=spec, wide_sum=True)
    for bad in ("/tmp", ("/tmp", "warps"), ["/tmp", "items"]):
        with pytest.raises(ValueError, match="probe_trace takes \\(directory, level\\)"):
            tiles_mgpu(q, kc, kc, idx, spec=spec, probe_trace=bad)
    with pytest.raises(ValueError, match="probe_trace needs a GPU"):
        interp = plgpu.InterpretGPUParams()
        tiles_mgpu(
            q,
            kc,
            kc,
            idx,
            spec=spec,
            pv="add",
            rounding="compiler",
            probe_trace=("/tmp", "items"),
            interpret=interp,
        )
    big = jnp.ones((2, 256, 1, 128), BF16)
    with pytest.raises(ValueError, match="more shared memory than an SM has"):
        tiles_mgpu(q.reshape(1, 1, 4, 64).repeat(2, axis=3), big, big, idx, spec=AttentionSpec.create(128))
    paged = Paged([20], hq=4, hkv=2)  # float32
    with pytest.raises(ValueError, match="dtype float32"):
        attention(
            jnp.ones((1, 4, 64)), paged.kc, paged.vc, paged.bt, np.array([20], np.int32),
            np.array([0], np.int32), np.array([19], np.int32), backend="triton", interpret=True,
            gpu_kernel="tiles_mgpu",
        )  # fmt: skip


_DIRECT = {"consumers": 2, "persistent": 2, "fold_in_smem": True, "prefetch_q": True, "direct_io": True}


def test_launch_choices_keep_the_bits():
    """``overlap`` (the next tile's q @ k.T issued before this tile's softmax), the number of
    stages, warp specialization (two consumer warpgroups walking the union of their tiles'
    walks, a producer warpgroup loading), the heaviest-first order, one wait for a tile's
    p @ ones and p @ v, the split fold's accumulator kept in SMEM and q / the output copied a
    tile at a time straight from / into [T, Hkv, G, D] (``direct_io``) change when or where
    things run, never what: the same bits on a walk through several sequences, splits and a window, tile
    pairs whose sequences differ, stale NaN cache rows - and interpret mode's race detector
    (TMA writes, barrier waits and SMEM reads as happens-before events) finds no race in the
    slot ring. Control: a different split size (part of the numerics) changes the bits."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu

    paged = Paged([70, 150, 9], hq=8, hkv=2, d=64, dtype=BF16, seed=4)
    tokens = [(1, p) for p in range(100, 150)] + [(0, 69), (2, 8), (0, 30)]
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][p] for s, p in tokens]).reshape(len(tokens), 2, 4, 64)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)
    spec = AttentionSpec.create(64, sliding_window=90, split_size=64)
    mode = plgpu.InterpretGPUParams(detect_races=True)

    def run(spec=spec, **launch):
        out = tiles_mgpu(
            q, paged.kc, paged.vc, index, spec=spec, pv="add", rounding="compiler", interpret=mode, **launch
        )
        assert not get_races().races_found, launch
        return bits(out)

    base = run()
    # (each choice in at least one launch, most in several: a run here takes ~7 s of CI time)
    launches = [
        {"overlap": True, "stages": 2},
        {"consumers": 2, "stages": 4, "overlap": True, "order": "heaviest", "one_drain": True},
        # (with the full tiles' selects left out: ``bare_full``; the masked tiles' key mask
        # from each row's key range, no select of p: ``lean_mask``;
        # and the row sums' columns carried apart until the split's fold: ``wide_sum``)
        {
            "fold_in_smem": True,
            "order": "heaviest",
            "one_drain": True,
            "bare_full": True,
            "lean_mask": True,
            "wide_sum": True,
        },
        {"consumers": 2, "q_from_smem": True, "fold_in_smem": True, "order": "heaviest"},
        # persistent programs: one runs every work item (its ring and segment buffers wrap
        # around), three take turns; the next item's q loaded at an item's start, the output
        # staged in its own SMEM buffer
        {"consumers": 2, "persistent": 1},
        {"consumers": 2, "persistent": 1, "fold_in_smem": True, "prefetch_q": True},
        # ... and q and the output copied a tile (16 tokens x 4 rows) at a time, no XLA
        # transposes (TMA reads zeros past the last token and drops writes past it)
        {
            "consumers": 2,
            "persistent": 3,
            "order": "heaviest",
            "fold_in_smem": True,
            "one_drain": True,
            "prefetch_q": True,
            "direct_io": True,
            "lean_mask": True,
            "wide_sum": True,
        },
        # ... and the walk tables from each token's first row (narrower segment tables), with
        # each consumer's next q @ k.T issued before this tile's softmax, from a K ring one
        # slot longer than the V ring (``k_ahead``)
        {**_DIRECT, "persistent": 3, "token_walk": True, "overlap": True, "k_ahead": True},
        # ... and each consumer's output staged in its own fold rows (a ``RefUnion``), one
        # program running every item: the store of an item's output and the next item's fold;
        # each item's order entry and walk length read an item ahead (``early_reads``)
        {**_DIRECT, "persistent": 1, "token_walk": True, "out_in_fold": True, "early_reads": True},
        # ... and the consumers taking turns to issue their dots (FlashAttention-3's ping-pong),
        # with the next tile's scores issued with this tile's p @ v, or in turns of their own
        {**_DIRECT, "persistent": 3, "overlap": True, "one_drain": True, "pingpong": True},
        {**_DIRECT, "persistent": 3, "one_drain": True, "pingpong": True, "k_ahead": True},
    ]
    for launch in launches:
        np.testing.assert_array_equal(run(**launch), base, err_msg=str(launch))
    # a bucket's padding: 8 of one program's 12 items all padding rows (empty walks), the
    # segment buffers reused after them - the same bits for the real tokens, and no race
    pad = 128
    padded = (*index[:2], jnp.pad(seq, (0, pad)), jnp.pad(pos, (0, pad), constant_values=-1))
    out = tiles_mgpu(
        jnp.pad(q, ((0, pad), (0, 0), (0, 0), (0, 0))), paged.kc, paged.vc, padded, spec=spec, pv="add",
        rounding="compiler", interpret=mode,
        **{**_DIRECT, "persistent": 1, "one_drain": True, "early_reads": True},
    )  # fmt: skip
    assert not get_races().races_found
    np.testing.assert_array_equal(bits(out)[: len(tokens)], base)
    # control for the race check: without the wait for an item's output store before the next
    # item's walk writes the fold it lies in, the detector sees the two overlap
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention_mgpu, "_wait_box_stored", lambda: None)
        tiles_mgpu(
            q, paged.kc, paged.vc, index, spec=spec, pv="add", rounding="compiler", interpret=mode,
            **{**_DIRECT, "persistent": 1, "out_in_fold": True},
        )  # fmt: skip
        assert get_races().races_found, "no race without the wait: the race check cannot fail"
    control = run(spec=AttentionSpec.create(64, sliding_window=90, split_size=128), consumers=2)
    assert not np.array_equal(control, base), "split size changed nothing: the check cannot fail"
    # the timing probe that skips the masked tiles' work does change values (it is no launch)
    assert not np.array_equal(run(probe_unmasked=True), base)
    # nor does the base-2 logits probe (log2 e in the scale: other roundings)
    assert not np.array_equal(run(probe_log2_scores=True), base)
    # nor does the probe leaving out the softmax's exponentials and rescale (what they cost)
    assert not np.array_equal(run(probe_skip=("exp", "rescale")), base)


@pytest.mark.parametrize(
    "hq,launch",
    [
        (6, {}),
        (14, {"consumers": 2, "order": "heaviest"}),
        (14, _DIRECT),
        (6, _DIRECT),
    ],
)
def test_dense_row_packing_keeps_the_bits(hq, launch, monkeypatch):
    """``packing="dense"``: 21 tokens of a 3-head group (9 of 7) in a tile's 64 rows instead of 16
    (8) with the group padded to a power of two - fewer tiles, the same bits, no race (interpret
    mode), alone and with a pair launch, also with q and the output copied a tile (9 tokens of 7
    rows, 21 of 3) at a time (``direct_io``); a padding token's rows stay zero. Control: a different split size
    changes the bits."""
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import get_races
    from jax.experimental.pallas import mosaic_gpu as plgpu

    hkv, d = 2, 64
    paged = Paged([70, 150, 9], hq=hq, hkv=hkv, d=d, dtype=BF16, seed=4)
    tokens = [(1, p) for p in range(100, 150)] + [(0, 69), (2, 8), (0, 30), (0, -1)]
    seq = jnp.asarray([s for s, _ in tokens], jnp.int32)
    pos = jnp.asarray([p for _, p in tokens], jnp.int32)
    q = jnp.stack([paged.q[s][max(p, 0)] for s, p in tokens]).reshape(len(tokens), hkv, hq // hkv, d)
    index = (jnp.asarray(paged.bt), jnp.asarray(paged.lens, jnp.int32), seq, pos)
    mode = plgpu.InterpretGPUParams(detect_races=True)

    def run(split_size=64, **kw):
        spec = AttentionSpec.create(d, sliding_window=90, split_size=split_size)
        out = tiles_mgpu(
            q, paged.kc, paged.vc, index, spec=spec, pv="add", rounding="compiler", interpret=mode, **kw
        )
        assert not get_races().races_found, kw
        return bits(out)

    from pallas_kernels import attention_math

    seen = []  # the kernel's tile counts: proof that the packing reached it

    def spy(*args):
        out = attention_math.row_tiles(*args)
        seen.append((args[-1], out[1].shape[0]))
        return out

    monkeypatch.setattr(attention_mgpu, "row_tiles", spy)
    base = run()
    dense = run(packing="dense", **launch)
    np.testing.assert_array_equal(dense, base)
    (p0, n0), (p1, n1) = seen
    assert (p0, p1) == ("pow2", "dense") and n1 < n0, seen
    assert np.all(dense[-1] == 0)
    assert not np.array_equal(run(split_size=128, packing="dense"), base)


def test_heaviest_first_orders_programs_by_the_keys_they_walk():
    lo = jnp.asarray([[0, 0], [64, 0], [0, 5], [10, 0]], jnp.int32)
    hi = jnp.asarray([[63, 0], [127, 0], [3, 200], [20, 0]], jnp.int32)
    nseg = jnp.asarray([1, 1, 2, 0], jnp.int32)  # the last program walks nothing
    assert heaviest_first(lo, hi, nseg, None).tolist() == [2, 1, 0, 3]  # 205, 128, 64, 0 keys
    # a window of 16: keys hi + 1 - max(lo - 15, 0): 64, 79, 4 + 201, 0
    assert heaviest_first(lo, hi, nseg, 16).tolist() == [2, 1, 0, 3]
    same = jnp.full((3, 1), 7, jnp.int32)  # three programs of 8 keys each: ties keep their order
    assert heaviest_first(same * 0, same, jnp.ones(3, jnp.int32), None).tolist() == [0, 1, 2]


def test_the_engines_launch_through_attention_accuracy_and_token_bits(monkeypatch):
    """``attention_triton.MGPU_PREFILL_LAUNCH`` as committed (what the engine's prefill launches:
    since session 42 two consumers, heaviest first, one drain, dense rows, the split fold in SMEM)
    through ``attention()``: f64 accuracy over sequences of several tiles with stale NaN cache
    rows and padding, and a token's bits as under ``tiles_mgpu``'s own defaults (one warpgroup,
    in order, padded rows). Control: a different split size changes the bits."""
    committed = dict(attention_triton.MGPU_PREFILL_LAUNCH)
    assert committed["consumers"] == 2 and committed["fold_in_smem"], committed  # what is tested
    paged = Paged([15, 150, 70], dtype=BF16, d=64, seed=3)
    tokens = all_tokens(paged)
    np.random.default_rng(2).shuffle(tokens)
    tokens = tokens[:9] + [(0, -1)] * 2 + tokens[9:]
    got = _run(paged, tokens)
    monkeypatch.setattr(attention_triton, "MGPU_PREFILL_LAUNCH", ())
    np.testing.assert_array_equal(bits(got), bits(_run(paged, tokens)))
    assert not np.array_equal(bits(_run(paged, tokens, split_size=128)), bits(got))
    out = np.asarray(got, np.float64)
    real = [i for i, (_, p) in enumerate(tokens) if p >= 0]
    ref = np.stack([paged.f64(*tokens[i]) for i in real])
    assert np.all(out[9:11] == 0) and np.isfinite(out).all()
    assert np.abs(out[real] - ref).max() / np.abs(ref).max() <= 2e-2


def test_auto_picks_the_mosaic_kernel_only_where_it_runs(monkeypatch):
    """attention_triton.PREFILL_KERNEL = "tiles_mgpu" (committed) makes "auto" run the Mosaic GPU
    kernel for prefill on a Hopper GPU and for calls it supports; every other call keeps
    Triton's tiles (same bits). Control: PREFILL_KERNEL "tiles" and a non-Hopper device pick
    tiles."""
    from pallas_kernels import attention_triton

    class Device:
        compute_capability = "9.0"

    monkeypatch.setattr(attention_mgpu.jax, "devices", lambda: [Device()])
    spec = AttentionSpec.create(128)
    q, kc = jnp.zeros((64, 8, 4, 128), BF16), jnp.zeros((8, 16, 8, 128), BF16)
    pick = attention_triton._prefill_kernel
    assert attention_triton.PREFILL_KERNEL == "tiles_mgpu"
    assert pick(q, kc, spec) == "tiles_mgpu"
    monkeypatch.setattr(attention_triton, "PREFILL_KERNEL", "tiles")
    assert pick(q, kc, spec) == "tiles"
    monkeypatch.setattr(attention_triton, "PREFILL_KERNEL", "tiles_mgpu")
    assert pick(q.astype(jnp.float32), kc.astype(jnp.float32), spec) == "tiles"
    assert pick(q, kc, AttentionSpec.create(128, logit_softcap=30.0)) == "tiles"
    assert pick(q, jnp.zeros((2, 256, 8, 128), BF16), spec) == "tiles"  # pages too big for SMEM
    assert pick(q, jnp.zeros((8, 4, 8, 128), BF16), spec) == "tiles"  # 4-token pages
    assert pick(jnp.zeros((64, 1, 71, 128), BF16), jnp.zeros((8, 16, 1, 128), BF16), spec) == "tiles"
    # 128-token pages at D 128: the committed pair launch's two folds leave no room for their
    # KV tiles, so Triton's tiles run them (before the check asked the launch, "auto" raised);
    # the one-warpgroup launch fits them (the control: the answer follows the launch)
    pages128 = jnp.zeros((2, 128, 8, 128), BF16)
    assert pick(q, pages128, spec) == "tiles"
    can = lambda launch: attention_mgpu.can_run(BF16, 128, spec, block_size=128, group=4, launch=launch)  # noqa: E731
    assert not can(attention_triton.MGPU_PREFILL_LAUNCH) and can(())
    launch = dict(attention_triton.MGPU_PREFILL_LAUNCH)
    for bs in (16, 32, 64, 128):  # can_run says yes exactly where the launch's ring fits
        for d in (64, 128):
            try:
                attention_mgpu._stages(
                    kv_tile(bs), d, 2, 2, launch["consumers"], launch["fold_in_smem"], launch["prefetch_q"]
                )
                fits = True
            except ValueError:
                fits = False
            sd = AttentionSpec.create(d)
            assert attention_mgpu.can_run(BF16, d, sd, block_size=bs, group=4, launch=launch) == fits, (bs, d)
    Device.compute_capability = "8.0"
    assert pick(q, kc, spec) == "tiles"


def test_the_engines_launch_does_not_fit_128_token_pages_at_head_dim_128():
    """What ``can_run`` (and so "auto") must know: the committed pair launch with its two folds
    in shared memory has no room for 128-key tiles at D 128 - lowering it raises (before
    ``can_run`` asked the launch, "auto" picked it and raised)."""
    from pallas_kernels import attention_triton

    spec = AttentionSpec.create(128)
    launch = dict(attention_triton.MGPU_PREFILL_LAUNCH)
    s = jax.ShapeDtypeStruct
    i32 = lambda *shape: s(shape, jnp.int32)  # noqa: E731
    with pytest.raises(ValueError, match="more shared memory than an SM has"):
        cuda_export(
            lambda q, k, v, idx: tiles_mgpu(q, k, v, idx, spec=spec, **launch),
            s((64, 2, 4, 128), BF16),
            s((4, 128, 2, 128), BF16),
            s((4, 128, 2, 128), BF16),
            (i32(2, 2), i32(2), i32(64), i32(64)),
        )


def test_walk_tables_from_each_tokens_first_row_equal_the_rows_tables():
    """``walk_tables(token_rows=...)`` (the engine's: each token's first row stands for its
    rows) gives the tables of every row - segments, their number, the padded rows and the
    launch order - for groups of 1, 3, 4, 7 and 8 in both packings, one and two tiles a program,
    a window, padding tokens, tokens out of order and sequences that recur in a tile. Control:
    the first row of each *tile* alone gives other tables."""
    from pallas_kernels import attention_mgpu
    from pallas_kernels.attention_math import row_tiles, tile_tokens

    rng = np.random.default_rng(0)
    lens = jnp.asarray([300, 90, 1000, 5], jnp.int32)
    differed = 0
    for group, packing, consumers, order, window in [
        (1, "pow2", 1, "ascending", None),
        (3, "dense", 2, "heaviest", None),
        (3, "pow2", 2, "heaviest", 64),
        (4, "dense", 2, "heaviest", None),
        (7, "dense", 2, "heaviest", 100),
        (7, "pow2", 1, "heaviest", None),
        (8, "pow2", 2, "ascending", None),
    ]:
        t = 157
        seq = rng.integers(0, 4, t).astype(np.int32)
        seq[40:90] = 2  # a run of one sequence across tiles
        pos = rng.integers(-1, 300, t).astype(np.int32)  # (-1: padding tokens)
        qg = jnp.zeros((t, 1, group, 8), BF16)
        _, rpos, rseq, _ = row_tiles(qg, jnp.asarray(seq), jnp.asarray(pos), attention_mgpu.ROWS, packing)
        kw = dict(consumers=consumers, order=order, window=window)
        rows = attention_mgpu.walk_tables(rpos, rseq, lens, 4, **kw)
        tokens = attention_mgpu.walk_tables(
            rpos, rseq, lens, 4, token_rows=tile_tokens(group, attention_mgpu.ROWS, packing), **kw
        )
        for a, b in zip(rows[:2] + rows[3:], tokens[:2] + tokens[3:], strict=True):
            assert (a is None and b is None) or np.array_equal(a, b), (group, packing)
        n = int(tokens[3].max())  # the segments themselves; past nseg: padding of either width
        np.testing.assert_array_equal(rows[2][:, :, :n], tokens[2][:, :, :n], err_msg=str((group, packing)))
        assert np.all(np.asarray(tokens[3]) <= tokens[2].shape[2])
        control = attention_mgpu.walk_tables(rpos, rseq, lens, 4, token_rows=(1, attention_mgpu.ROWS), **kw)
        differed += not np.array_equal(control[3], rows[3])
    assert differed >= 5, differed


def test_the_interpreters_matmul_gives_a_row_the_same_bits_anywhere():
    """conftest's ``ascending_k_matmul`` (the interpreter's wgmma in these tests): a row's bits
    are the same alone and at any place in a larger operand, its values NumPy's to float32
    rounding, and it refuses what it does not do. It is what the interpreter runs here."""
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    from tests.pallas_kernels.conftest import ascending_k_matmul

    assert gpu_callbacks.np.matmul is ascending_k_matmul
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 64)).astype(jnp.bfloat16)
    b = rng.standard_normal((64, 128)).astype(jnp.bfloat16)
    whole = ascending_k_matmul(a, b, dtype=np.float32)
    for r in (0, 21, 33, 63):
        alone = ascending_k_matmul(a[r : r + 1], b, dtype=np.float32)
        np.testing.assert_array_equal(alone.view(np.uint32), whole[r : r + 1].view(np.uint32))
    ref = np.matmul(a, b, dtype=np.float32)
    assert np.abs(whole - ref).max() <= 1e-5 * np.abs(ref).max()
    with pytest.raises(TypeError, match="float32 only"):
        ascending_k_matmul(a, b, dtype=np.float16)
