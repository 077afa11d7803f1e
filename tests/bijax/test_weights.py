"""LLM.update_weights (no recompilation, clear errors, old buffers released) and the orbax round
trip of a trainer's model state back into an LLM."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import bijax
from bijax import SamplingParams as SP
from bijax.model_runner import num_compiled_steps
from models import save_orbax
from models.configs import preset
from models.llama import Llama, param_state
from tests.conftest import bits

ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=160, seed=1)
PROMPTS = [[5, 17, 42, 99, 123, 7, 8], list(range(30, 70))]
SAMPLING = SP(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)


def _fresh(seed=0):
    """A tiny float32 model with the shapes of test_engine's (the compiled steps are shared)."""
    return Llama(preset("tiny"), dtype=jnp.float32, seed=seed)


def _train_step(model):
    """One optax step on the trainer-side logprobs of a fixed sequence: new weights, same tree."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tokens = jnp.asarray([list(range(3, 40))], jnp.int32)
    opt = optax.adam(1e-2)

    def loss(p):
        return -bijax.logprobs(nnx.merge(graphdef, p, rest), tokens, temperature=1.0).sum()

    grads = jax.grad(loss)(params)
    updates, _ = opt.update(grads, opt.init(params), params)
    return nnx.merge(graphdef, optax.apply_updates(params, updates), rest)


def _same(a, b):
    return all(
        x.token_ids == y.token_ids and np.array_equal(bits(x.logprobs), bits(y.logprobs))
        for x, y in zip(a, b, strict=True)
    )


def test_update_weights_changes_outputs_without_recompiling():
    llm = bijax.LLM(_fresh(), **ENGINE)
    before = llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    trained = _train_step(_fresh())
    expect = bijax.LLM(trained, **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    compiles = num_compiled_steps()
    llm.update_weights(param_state(trained))
    after = llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert num_compiled_steps() == compiles  # no new compilation
    assert _same(after, expect)  # exactly the weights given
    assert not _same(after, before)  # negative control: the weights did change the output
    # A pure dict and a whole Llama are accepted too; back to the first weights, first bits
    # (the prompts' cached KV prefixes from the other weights must not be reused).
    llm.update_weights(nnx.to_pure_dict(param_state(_fresh())))
    assert _same(llm.generate(PROMPTS, SAMPLING, use_tqdm=False), before)
    llm.update_weights(trained)
    assert _same(llm.generate(PROMPTS, SAMPLING, use_tqdm=False), expect)
    assert num_compiled_steps() == compiles


def test_an_in_place_change_of_the_model_reaches_generate_and_score():
    """An optimizer step applied to ``llm.model`` in place (``nnx.update``, as ``nnx.Optimizer``
    does), without ``update_weights``: the next generate takes the new weights as
    update_weights would (its prefix cache emptied: the second prompt's cached KV came from the
    old weights) - its logprobs equal ``score``'s and the trainer-side logprobs of
    ``llm.model``, bit for bit. Control: they differ from the outputs before the step."""
    llm = bijax.LLM(_fresh(), **ENGINE)
    before = llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert not llm.engine.changed_in_place(llm.model)  # (no change: nothing is taken again)
    nnx.update(llm.model, nnx.state(_train_step(_fresh())))
    assert llm.engine.changed_in_place(llm.model)
    after = llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert not llm.engine.changed_in_place(llm.model) and not _same(after, before)
    for prompt, out in zip(PROMPTS, after, strict=True):
        tokens, plen = [prompt + out.token_ids], len(prompt)
        (scored,) = llm.score(tokens, [plen], temperature=0.8)
        trainer = bijax.logprobs(llm.model, jnp.asarray(tokens, jnp.int32), temperature=0.8)
        assert np.array_equal(bits(scored), bits(out.logprobs))
        assert np.array_equal(bits(np.asarray(trainer)[0, plen:]), bits(out.logprobs))


def test_update_weights_moves_every_open_llm_on_the_same_model():
    """``LLM(llm.model)`` shares the model object, which update_weights changes in place: the
    other LLM must run the new weights too (its generate and score equal a fresh LLM's on them,
    and the trainer-side logprobs of its .model), not keep the old ones. A closed one is left
    alone; a busy one makes update_weights refuse before anything changes."""
    a = bijax.LLM(_fresh(), **ENGINE)
    b = bijax.LLM(a.model, **ENGINE)
    before = b.generate(PROMPTS, SAMPLING, use_tqdm=False)
    trained = _train_step(_fresh())
    expect = bijax.LLM(trained, **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    a.update_weights(param_state(trained))
    got = b.generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(got, expect) and not _same(got, before)  # (control: the weights changed)
    tokens, plen = [PROMPTS[1] + got[1].token_ids], len(PROMPTS[1])
    trainer = np.asarray(bijax.logprobs(b.model, jnp.asarray(tokens, jnp.int32), temperature=0.8))[0]
    (scored,) = b.score(tokens, [plen], temperature=0.8)
    assert np.array_equal(bits(scored), bits(got[1].logprobs))
    assert np.array_equal(bits(trainer[plen:]), bits(got[1].logprobs))
    b.engine.add_request("busy", [5, 6, 7], SAMPLING)
    with pytest.raises(RuntimeError, match="another one is generating"):
        a.update_weights(param_state(_fresh()))
    b.engine.release(["busy"])
    b.close()
    a.update_weights(param_state(_fresh()))  # (b is closed: not moved, no error)
    assert _same(a.generate(PROMPTS, SAMPLING, use_tqdm=False), before)


def test_update_weights_releases_the_old_buffers():
    llm = bijax.LLM(_fresh(), **ENGINE)
    old = weakref.ref(param_state(llm.model)["embed"][...])
    llm.update_weights(param_state(_fresh(seed=3)))
    gc.collect()
    assert old() is None


def test_update_weights_rejects_a_different_tree():
    llm = bijax.LLM(_fresh(), **ENGINE)
    good = nnx.to_pure_dict(param_state(_fresh()))
    missing = dict(good)
    del missing["final_norm"]
    with pytest.raises(ValueError, match="structure.*final_norm"):
        llm.update_weights(missing)
    wrong_shape = dict(good, final_norm=jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"\['final_norm'\] has shape \(3,\)"):
        llm.update_weights(wrong_shape)
    wrong_dtype = dict(good, final_norm=good["final_norm"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="dtype bfloat16"):
        llm.update_weights(wrong_dtype)
    with pytest.raises(TypeError, match="weights must be"):
        llm.update_weights([1, 2, 3])
    bad_leaf = dict(good, final_norm="ones")
    with pytest.raises(TypeError, match="must be an array"):
        llm.update_weights(bad_leaf)
    abstract = dict(good, final_norm=jax.ShapeDtypeStruct(good["final_norm"].shape, jnp.float32))
    with pytest.raises(TypeError, match=r"\['final_norm'\] must be an array, got ShapeDtypeStruct"):
        llm.update_weights(abstract)
    with pytest.raises(
        TypeError, match=r"weights\['embed'\] is a traced value: update the weights outside jax.jit"
    ):
        jax.jit(llm.update_weights)(good)
    nan = dict(good, final_norm=good["final_norm"].at[2].set(jnp.nan))  # a diverged train step
    with pytest.raises(ValueError, match=r"\['final_norm'\] holds NaN.*keeps its current weights"):
        llm.update_weights(nan)
    # Nothing was half-applied: the engine still generates with its own weights.
    ref = bijax.LLM(_fresh(), **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(llm.generate(PROMPTS, SAMPLING, use_tqdm=False), ref)


def test_a_llama_of_another_config_or_k_shards_is_refused():
    """update_weights takes a Llama's parameters only: one built with another config (same
    shapes) or k_shards would run under this model's and give other bits than its own LLM's."""
    llm = bijax.LLM(_fresh(), **ENGINE)
    other = Llama(dataclasses.replace(preset("tiny"), rope_theta=5e5), dtype=jnp.float32, seed=0)
    with pytest.raises(ValueError, match=r"rope_theta=500000.0 \(this LLM's model: 10000.0\)"):
        llm.update_weights(other)
    with pytest.raises(ValueError, match=r"k_shards=8 \(this LLM's model: 1\)"):
        llm.update_weights(Llama(preset("tiny"), dtype=jnp.float32, seed=0, k_shards=8))
    llm.update_weights(param_state(other))  # its parameters alone: taken


def test_numpy_weights_are_copied_not_kept_by_reference():
    """numpy leaves are copied onto the device: changing the caller's arrays in place afterwards
    does not change the engine's outputs (same bits as a fresh LLM on those weights)."""
    llm = bijax.LLM(_fresh(), **ENGINE)
    host = jax.tree_util.tree_map(np.array, nnx.to_pure_dict(param_state(_fresh(seed=2))))
    llm.update_weights(host)
    host["final_norm"][...] = 0.0
    want = bijax.LLM(_fresh(seed=2), **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(llm.generate(PROMPTS, SAMPLING, use_tqdm=False), want)


def test_weights_on_another_device_are_moved_to_the_models():
    """A trainer's arrays on another device (or sharded its own way) are taken where the
    engine's compiled steps want them (they failed in generate with XLA's sharding error)."""
    llm = bijax.LLM(_fresh(), **ENGINE)
    assert jax.device_count() > 1
    elsewhere = jax.device_put(nnx.to_pure_dict(param_state(_fresh(seed=2))), jax.devices()[3])
    llm.update_weights(elsewhere)
    want = bijax.LLM(_fresh(seed=2), **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(llm.generate(PROMPTS, SAMPLING, use_tqdm=False), want)


def test_a_draft_that_is_the_model_itself_follows_update_weights():
    """Self-speculation (the draft is the target's model object): the draft runs the new
    weights too - every draft accepted, the bits of plain decoding on them - and a train step
    that donates the old arrays leaves nothing behind that needs them."""
    model = _fresh()
    spec = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    llm = bijax.LLM(model, **ENGINE, speculative_config=spec)
    old = jax.tree_util.tree_leaves(nnx.to_pure_dict(param_state(model)))
    llm.update_weights(param_state(_fresh(seed=2)))
    for a in old:  # the train step donated the weights it was given
        a.delete()
    got = llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    want = bijax.LLM(_fresh(seed=2), **ENGINE).generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(got, want)
    m = [o.metrics for o in got]
    assert all(x.num_draft_tokens > 0 and x.num_accepted_tokens == x.num_draft_tokens for x in m), m


def test_donated_weights_give_a_clear_error():
    llm = bijax.LLM(_fresh(), **ENGINE)
    new = param_state(_fresh(seed=2))
    llm.update_weights(new)
    jax.tree_util.tree_map(lambda a: a.delete(), jax.tree_util.tree_leaves(nnx.to_pure_dict(new)))
    with pytest.raises(RuntimeError, match="update_weights"):
        llm.generate(PROMPTS, SAMPLING, use_tqdm=False)
    with pytest.raises(ValueError, match="deleted"):
        llm.update_weights(new)
    llm.update_weights(param_state(_fresh(seed=2)))
    assert llm.generate(PROMPTS, SAMPLING, use_tqdm=False)[0].token_ids


def test_orbax_round_trip_of_trainer_state_into_llm(tmp_path):
    trained = _train_step(_fresh())
    save_orbax(trained, tmp_path / "ckpt")
    restored = bijax.LLM(str(tmp_path / "ckpt"), **ENGINE)
    direct = bijax.LLM(_fresh(), **ENGINE)
    direct.update_weights(trained)
    a = restored.generate(PROMPTS, SAMPLING, use_tqdm=False)
    b = direct.generate(PROMPTS, SAMPLING, use_tqdm=False)
    assert _same(a, b)
    # The trainer-side logprobs of what the restored engine sampled are its bits too.
    seq = jnp.asarray([PROMPTS[1] + a[1].token_ids], jnp.int32)
    lp = np.asarray(bijax.logprobs(restored.model, seq, temperature=SAMPLING.temperature))[0]
    assert np.array_equal(bits(lp[len(PROMPTS[1]) :]), bits(a[1].logprobs))
