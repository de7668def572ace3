"""Envelope release and restore (``cadence_fx/envelopes.py``), asserted exactly: which stock
methods the guard wraps (the model's own public ones, on the modules that own an envelope, a
mixin's included, nn.Module's and an instance's own attributes left alone), the error a guarded
method raises, a declared priming method lending the envelope and copying its result out, storage
shared with another buffer kept, and the byte counters of release, restore and close.

Written against mutants of the envelope code that the stream tests let through
(``bench/mutation.py``, ``bench/results/2026-11-30-mutation.md``)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import cadence_fx
from cadence_fx.envelopes import Envelopes
from cadence_fx.counters import Counters
from cadence_fx.models.toy import PROMPT_RETAINED_ADAPTER, PromptRetainedToy
from helpers import same

ENVELOPE_BYTES = 2 * 1 * 4 * 128 * 32 * 4   # the toy's (2, 1, 4, 128, 32) float32 att_cache_buffer


class Peeking:
    """A mixin after nn.Module in the MRO: its public methods are the model's own too."""

    def peek_mixin(self):
        return self.att_cache_buffer.sum()


class PrimingToy(PromptRetainedToy, Peeking):
    def peek(self):
        return self.att_cache_buffer.sum()

    def _peek(self):                 # private: never wrapped (reading a released buffer
        return self.att_cache_buffer.sum()   # here would read freed storage)

    def prime(self, x):
        """Stock priming: a cache-free pass whose state is a view of the envelope."""
        h, state = self.forward(x, None)
        return h, state, x


class Outer(torch.nn.Module):
    """The envelope lives in a submodule, as Token2Wav's lives in ``flow``."""

    def __init__(self):
        super().__init__()
        self.toy = PrimingToy()

    def forward(self, x, cache=None):
        return self.toy(x, cache)

    def describe(self):              # public, but this module owns no envelope
        return "outer"


ADAPTER = dataclasses.replace(PROMPT_RETAINED_ADAPTER, priming=("toy.prime",))


def _chunks(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 8, 64, generator=g) for _ in range(n)]


def _prompt(model_cls=PromptRetainedToy):
    with torch.no_grad():
        _, state = model_cls()(torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(1)),
                               None)
    return {"att": state["att"].clone()}


def _run(step, prompt, xs):
    state, outs = prompt, []
    for x in xs:
        with torch.no_grad():
            y, state = step(x, state)
        outs.append((y.clone(), state["att"].clone()))
    return outs


def _compiled(model, adapter=ADAPTER):
    c = cadence_fx.compile(model, adapter, release_envelopes=True)
    assert same(_run(c, _prompt(), _chunks(1)), _run(PromptRetainedToy(), _prompt(), _chunks(1)))
    assert (c.counters.compiled_calls, c.counters.fallbacks) == (1, 0)
    assert c.counters.released_bytes == ENVELOPE_BYTES
    (envelope,) = [b for n, b in model.named_buffers() if n.endswith("att_cache_buffer")]
    assert envelope.untyped_storage().nbytes() == 0
    return c


def _wrapped(module):
    return {n for n, v in vars(module).items() if callable(v) and not isinstance(v, torch.nn.Module)}


def test_the_guard_wraps_exactly_the_models_own_public_methods():
    outer = Outer()
    _compiled(outer)
    # the envelope owner's own methods, the mixin's (after nn.Module in the MRO), the priming one
    assert _wrapped(outer.toy) == {"forward", "peek", "peek_mixin", "prime"}
    assert _wrapped(outer) == set() and _wrapped(outer.toy.inp) == set()
    # nn.Module's own methods are left as they are and still work after the release
    assert len(list(outer.toy.parameters())) == 10 and not outer.toy.state_dict().keys() & {
        "att_cache_buffer"}


def test_a_guarded_method_raises_the_fix_and_a_private_one_is_not_guarded():
    outer = Outer()
    _compiled(outer)
    model = outer.toy
    want = ("PrimingToy.peek reads the stock envelope(s) ['toy.att_cache_buffer'], whose storage this "
            "compiled step released (release_envelopes=True). Prime through the compiled step "
            "(call it with the state None), declare the stock priming method in the adapter's "
            "`priming` (adapter 'toy-prompt-retained' declares ['toy.prime']), call compiled.close() "
            "first, or compile without release_envelopes")
    with pytest.raises(cadence_fx.ContractError) as e:
        model.peek()
    assert str(e.value) == want
    with pytest.raises(cadence_fx.ContractError, match=r"^PrimingToy\.peek_mixin reads"):
        model.peek_mixin()
    assert "_peek" not in vars(model)      # private methods are not wrapped


def test_an_envelope_on_the_root_module_is_named_without_a_path():
    model = PrimingToy()
    adapter = dataclasses.replace(PROMPT_RETAINED_ADAPTER, priming=())
    _compiled(model, adapter)
    assert _wrapped(model) == {"forward", "peek", "peek_mixin", "prime"}
    with pytest.raises(cadence_fx.ContractError, match=r"^PrimingToy\.peek reads the stock "
                                                       r"envelope\(s\) \['att_cache_buffer'\], .* "
                                                       r"declares \[\]\)"):
        model.peek()


def test_an_instance_attribute_is_left_alone_and_the_rest_still_wrapped():
    outer = Outer()
    model = outer.toy
    model.forward = model.forward        # an instance attribute shadowing the first method
    _compiled(outer)
    assert vars(model)["forward"].__func__ is PromptRetainedToy.forward   # bound, unwrapped
    assert _wrapped(model) == {"forward", "peek", "peek_mixin", "prime"}
    with pytest.raises(cadence_fx.ContractError):
        model.peek()                      # methods after it in the class are still guarded


def test_a_declared_priming_method_borrows_the_envelope_and_copies_its_result_out():
    outer, stock = Outer(), PrimingToy()
    c = _compiled(outer)
    model = outer.toy
    x = torch.randn(1, 24, 64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        h, state, same_x = model.prime(x)
        h_ref, state_ref, _ = stock.prime(x)
    assert torch.equal(h, h_ref) and torch.equal(state["att"], state_ref["att"])
    assert same_x is x                            # a result outside the envelope: as it was
    assert state["att"].untyped_storage().data_ptr() != \
        model.att_cache_buffer.untyped_storage().data_ptr()   # copied out of the envelope
    assert c.counters.primes_lent == 1
    assert c.counters.released_bytes == ENVELOPE_BYTES and c.counters.restored_bytes == 0
    assert model.att_cache_buffer.untyped_storage().nbytes() == 0   # released again
    # the primed state streams on the compiled path, bit-exact
    ours, ref = _run(c, state, _chunks(1, 7)), _run(stock, state_ref, _chunks(1, 7))
    assert same(ours, ref) and c.counters.fallbacks == 0


def test_priming_without_a_release_calls_straight_through():
    outer = Outer()
    model = outer.toy
    c = cadence_fx.compile(outer, ADAPTER, release_envelopes=True)
    x = torch.randn(1, 24, 64)
    with torch.no_grad():
        _, state, _ = model.prime(x)   # nothing released yet: the stock method, unchanged
    assert c.counters.primes_lent == 0
    assert state["att"].untyped_storage().data_ptr() == \
        model.att_cache_buffer.untyped_storage().data_ptr()


def test_close_restores_zero_filled_without_counting_restored_bytes():
    outer = Outer()
    c = _compiled(outer)
    model = outer.toy
    c.close()
    k = c.counters
    assert (k.released_bytes, k.restored_bytes) == (0, 0)
    buf = model.att_cache_buffer
    assert buf.untyped_storage().nbytes() == ENVELOPE_BYTES and not buf.any()
    assert model.peek().item() == 0.0    # the guard lets stock code through again


def test_a_fallback_restores_for_good_and_counts_the_bytes():
    outer = Outer()
    c = _compiled(outer)
    model = outer.toy
    with torch.no_grad():
        c(torch.randn(1, 13, 64), _prompt())   # 13 frames: no admitted call width
    k = c.counters
    assert (k.fallbacks, k.released_bytes, k.restored_bytes) == (1, 0, ENVELOPE_BYTES)
    assert model.att_cache_buffer.untyped_storage().nbytes() == ENVELOPE_BYTES


def _envelopes(buffers):
    return Envelopes({}, buffers, Counters())


def test_release_keeps_shared_or_partial_storage_and_frees_the_rest():
    base = torch.zeros(4, 8)
    whole, other = torch.ones(3, 5), torch.ones(2, 2)
    env = _envelopes({"view": base[1:], "base": base, "whole": whole, "head": other[:1],
                      "other": other})
    env.release(["view", "base", "whole", "head"])
    assert env.released == {"whole": 60}            # 15 float32: the only unshared, whole one
    assert env._counters.released_bytes == 60
    assert base.untyped_storage().nbytes() == 128 and other.untyped_storage().nbytes() == 16
    assert whole.untyped_storage().nbytes() == 0 and whole.shape == (3, 5)
    env.release(["whole"])                          # again: nothing more, counted once
    assert env.released == {"whole": 60} and env._counters.released_bytes == 60
    env.restore(keep=True)
    assert whole.untyped_storage().nbytes() == 60 and torch.equal(whole, torch.zeros(3, 5))
    assert (env.released, env._counters.released_bytes, env._counters.restored_bytes) == ({}, 0, 60)


def test_release_of_a_buffer_sharing_a_parameters_storage_is_refused():
    p = torch.zeros(6)
    env = Envelopes({"p": p}, {"b": p.view(2, 3)}, Counters())
    env.release(["b"])
    assert env.released == {} and p.untyped_storage().nbytes() == 24


def test_held_back_restores_for_the_compile_and_releases_the_old_and_the_new():
    a, b = torch.ones(4), torch.ones(2)
    env = _envelopes({"a": a, "b": b})
    env.release(["a"])
    with env.held_back() as replaced:
        assert env.released == {} and torch.equal(a, torch.zeros(4))   # back, zero-filled
        assert env._counters.released_bytes == 0
        replaced.add("b")
    assert env.released == {"a": 16, "b": 8} and env._counters.released_bytes == 24
    assert env._counters.restored_bytes == 0


def test_lent_restores_for_one_call_and_releases_the_same_names():
    a, b = torch.ones(4), torch.ones(2)
    env = _envelopes({"a": a, "b": b})
    env.release(["a"])
    with env.lent():
        assert env.released == {} and a.untyped_storage().nbytes() == 16
    assert env.released == {"a": 16} and b.untyped_storage().nbytes() == 8
    assert env._counters.restored_bytes == 0


def test_release_logs_each_envelope_by_name_kept_or_freed(caplog):
    base = torch.zeros(4, 8)
    env = _envelopes({"view": base[1:], "base": base, "whole": torch.ones(3, 5)})
    with caplog.at_level(logging.DEBUG, logger="cadence_fx.envelopes"):
        env.release(["view", "whole"])
    assert [(r.levelname, r.getMessage()) for r in caplog.records
            if r.name == "cadence_fx.envelopes"] == [
        ("INFO", "stock envelope view shares its storage; it is kept"),
        ("DEBUG", "released stock envelope whole (60 bytes)")]
    assert env.released == {"whole": 60}


def test_releasing_an_envelope_again_changes_nothing_and_logs_nothing(caplog):
    """A second release of an envelope already released (its storage is empty) is a no-op: it
    is not reported as sharing its storage, and its bytes are counted once."""
    env = _envelopes({"whole": torch.ones(3, 5), "other": torch.ones(2)})
    env.release(["whole"])
    with caplog.at_level(logging.DEBUG, logger="cadence_fx.envelopes"):
        env.release(["whole"])
    assert [r.getMessage() for r in caplog.records if r.name == "cadence_fx.envelopes"] == []
    assert env.released == {"whole": 60} and env._counters.released_bytes == 60
    env.release(["whole", "other"])   # the names after it are still released
    assert env.released == {"whole": 60, "other": 8} and env._counters.released_bytes == 68


def test_restoring_for_good_adds_every_envelopes_bytes():
    a, b = torch.ones(4), torch.ones(2)
    env = _envelopes({"a": a, "b": b})
    env.release(["a", "b"])
    env.restore(keep=True)
    assert (env._counters.restored_bytes, env._counters.released_bytes) == (24, 0)
    env.release(["a"])
    env.restore(keep=True)                  # a second fallback adds to the count
    assert env._counters.restored_bytes == 40
    assert torch.equal(a, torch.zeros(4)) and torch.equal(b, torch.zeros(2))
