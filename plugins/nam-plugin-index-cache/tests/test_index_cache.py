"""index-cache: reuse, fail-closed misses, recompute, bit parity with `full`, the config check, the CLI.

Unit cases call ``IndexCache.select`` on DSA blocks of nam56r-tiny built directly (rows of 16 tokens);
model cases run nam56r-tiny at ``seq_len`` 32, where top-k 16 keeps half the keys.
"""

import dataclasses
import json
import statistics
import types

import pytest
import torch

import nam_plugin_index_cache.plugin as plugin
from nam56r.blocks.dsa import DSA
from nam56r.blocks.indexer import FullIndexer, causal_topk
from nam56r.model import Backends, build_model
from nam56r.recipes import get_recipe
from nam56r.reference.attention import ReferenceAttention
from nam56r.state import ForwardState
from nam56r.testing import prepare_corpus
from nam_cli.main import run
from nam_core.checks import config_rows
from nam_core.device import DeviceInfo
from nam_core.engine.metrics import read_metrics
from nam_core.errors import ConfigError, NamError, PluginActivationError
from nam_core.run import StepContext
from nam56r.run import spec_for
from nam_core.host import PluginHost
from nam_core.requirements import FAIL, PASS, SKIP
from nam_plugin_index_cache.cache import CACHE_KEY, IndexCache, default_pattern, saved_fraction, source_rank

CPU = DeviceInfo.profile("cpu")
TINY = get_recipe("nam56r-tiny").model
CFG = TINY.replace(seq_len=32)
PLUGINS = ["reference", "index-cache"]


def dsa_stack(strategy, n=9, is_mtp=False):
    torch.manual_seed(0)
    return [DSA(TINY, ReferenceAttention(), strategy, dsa_rank=r, is_mtp=is_mtp) for r in range(n)]


def inputs(b=2, s=16, seed=1):
    """Detached block input x [b, s, hidden] and query latent qr [b, s, q_lora], as DSA hands them over."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, TINY.hidden, generator=g), torch.randn(b, s, TINY.q_lora_rank, generator=g)


def own_topk(layer, x, qr):
    return causal_topk(layer.indexer(x, qr), TINY.index_topk)


def state_for(x, micro_batch=0, **kw):
    return ForwardState(micro_batch=micro_batch, seq_layout=tuple(x.shape[:2]), **kw)


# --- the pattern ----------------------------------------------------------------------------------
def test_default_pattern_and_saved_fraction():
    assert default_pattern(9) == "FSSFSSFSS"
    assert saved_fraction("FSSFSSFSS") == 6 / 9  # 67% of indexer work at 3 Full + 6 Shared
    assert saved_fraction("F" * 9) == 0.0
    assert [source_rank("FSSFSSFSS", r) for r in range(9)] == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert source_rank("SFS", 0) is None


# --- select: hits and fail-closed misses ------------------------------------------------------------
def test_shared_layers_reuse_the_nearest_earlier_full_layers_exact_tensor():
    strategy = IndexCache()  # default rule: FSSFSSFSS
    layers = dsa_stack(strategy)
    x, qr = inputs()
    state = state_for(x)
    picked = [strategy.select(layer, x, qr, state) for layer in layers]
    for rank, (indices, scores) in enumerate(picked):
        src = rank - rank % 3
        assert indices is picked[src][0], rank  # the very tensor the Full layer returned
        assert (scores is None) == (rank != src), rank  # Shared layers add no indexer loss
    assert torch.equal(picked[3][0], own_topk(layers[3], x, qr))  # causal-masked, as `full` would pick
    assert not torch.equal(picked[3][0], picked[0][0])
    assert state.log == [] and strategy.notes == []


def test_another_micro_batch_computes_its_own_and_logs_once():
    strategy = IndexCache()
    layers = dsa_stack(strategy, n=3)
    x, qr = inputs()
    state = state_for(x, micro_batch=0)
    strategy.select(layers[0], x, qr, state)
    state.micro_batch = 1  # a state reused for the next micro-batch, Full entry left from micro-batch 0
    for layer in layers[1:]:
        indices, scores = strategy.select(layer, x, qr, state)
        assert torch.equal(indices, own_topk(layer, x, qr)) and scores is not None
    assert len(state.log) == 1 and "micro-batch 0" in state.log[0] and "micro-batch 1" in state.log[0]
    assert strategy.notes == state.log


@pytest.mark.parametrize("how", ["seq_layout", "shape"])
def test_a_layout_or_shape_change_computes_its_own(how):
    strategy = IndexCache()
    layers = dsa_stack(strategy, n=2)
    x, qr = inputs(s=16)
    state = state_for(x)
    strategy.select(layers[0], x, qr, state)
    x8, qr8 = inputs(s=8, seed=2)
    if how == "seq_layout":
        state.seq_layout = (2, 8)  # the engine announces the new layout
    indices, scores = strategy.select(layers[1], x8, qr8, state)  # "shape": the layout claim is stale
    assert indices.shape == (2, 8, 8) and torch.equal(indices, own_topk(layers[1], x8, qr8))
    assert scores is not None and len(state.log) == 1 and "layout" in state.log[0]


def test_no_earlier_full_layer_computes_its_own():
    # A pattern starting with S (the config check refuses it) and a stage starting at a Shared rank.
    strategy = IndexCache("SFSSFSSFS")
    layers = dsa_stack(strategy)
    x, qr = inputs()
    state = state_for(x)
    indices, scores = strategy.select(layers[0], x, qr, state)
    assert torch.equal(indices, own_topk(layers[0], x, qr)) and scores is not None
    fresh = state_for(x)
    indices, scores = strategy.select(layers[2], x, qr, fresh)  # rank 2 reads rank 1: not in this state
    assert torch.equal(indices, own_topk(layers[2], x, qr)) and scores is not None
    assert len(state.log) == 1 and "no earlier Full layer" in state.log[0]
    assert fresh.log == []  # the same reason is said once per strategy object
    assert len(strategy.notes) == 1


def test_no_state_computes():
    strategy = IndexCache()
    layers = dsa_stack(strategy, n=2)
    x, qr = inputs()
    strategy.select(layers[0], x, qr, state_for(x))
    indices, scores = strategy.select(layers[1], x, qr, None)
    assert torch.equal(indices, own_topk(layers[1], x, qr)) and scores is not None
    assert len(strategy.notes) == 1 and "no ForwardState" in strategy.notes[0]


def test_mtp_layers_always_compute():
    strategy = IndexCache()
    main, mtp = dsa_stack(strategy, n=2), dsa_stack(strategy, n=2, is_mtp=True)
    x, qr = inputs()
    state = state_for(x)
    full, _ = strategy.select(main[0], x, qr, state)
    indices, scores = strategy.select(mtp[1], x, qr, state)  # rank 1 would be Shared in the main stack
    assert indices is not full and torch.equal(indices, own_topk(mtp[1], x, qr)) and scores is not None
    assert state.log == []  # by design, not a miss


# --- activation recompute --------------------------------------------------------------------------
def test_recompute_with_the_same_state_returns_the_original_selection():
    strategy = IndexCache()
    layers = dsa_stack(strategy)
    x, qr = inputs()
    state = state_for(x)
    original = [strategy.select(layer, x, qr, state)[0] for layer in layers]
    state.recompute = True
    # Replay in backward order: rank 1 must read rank 0, not the most recent Full entry (rank 6).
    for rank in (7, 4, 1):
        indices, scores = strategy.select(layers[rank], x, qr, state)
        assert indices is original[rank] and indices is original[rank - rank % 3] and scores is None
    with torch.no_grad():  # a Full layer whose scores come out differently this time (a racy kernel)
        layers[3].indexer.wq_b.weight.mul_(-1.0)
    indices, scores = strategy.select(layers[3], x, qr, state)
    assert indices is original[3] and scores is not None  # scores for its KL, top-k as recorded
    assert not torch.equal(own_topk(layers[3], x, qr), original[3])


def tiny_batch(cfg, b=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = cfg.seq_len
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    return dict(
        tokens=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=torch.ones(b, s),
        segment_ids=(torch.arange(s) >= s // 2).long().expand(b, s).contiguous(),
        structure=torch.randint(0, cfg.structure_vocab, (b, s), generator=g),
    )


def tiny_model(indexer):
    torch.manual_seed(0)
    return build_model(CFG, dataclasses.replace(Backends.reference(), indexer=indexer))


def test_recompute_with_a_fresh_state_reproduces_the_selection():
    model = tiny_model(IndexCache())
    batch = tiny_batch(CFG)
    first, again = ForwardState(seq_layout=(2, 32)), ForwardState(seq_layout=(2, 32), recompute=True)
    with torch.no_grad():
        a, b = model(**batch, state=first), model(**batch, state=again)
    entries = first.dsa_cache[CACHE_KEY]
    assert sorted(entries) == [("main", r) for r in range(9)]
    for key, entry in entries.items():
        assert torch.equal(entry.indices, again.dsa_cache[CACHE_KEY][key].indices), key
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_only_full_layers_run_their_indexer_in_the_model():
    model = tiny_model(IndexCache())
    ran = []
    for layer in model.layers:
        if layer.spec.kind == "dsa":
            layer.mixer.indexer.register_forward_hook(lambda m, i, o, r=layer.spec.dsa_rank: ran.append(r))
    with torch.no_grad():
        out = model(**tiny_batch(CFG))
    assert ran == [0, 3, 6]  # 3 of 9 indexers: 67% of indexer work saved
    assert "indexer_kl" in out


# --- parity with `full` ----------------------------------------------------------------------------
def test_all_full_pattern_equals_the_full_strategy_bit_for_bit():
    batch = tiny_batch(CFG)
    results = []
    for indexer in (FullIndexer(), IndexCache("F" * 9)):
        model = tiny_model(indexer)
        out = model(**batch, state=ForwardState(seq_layout=(2, 32)))
        out["loss"].backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (out_a, grads_a), (out_b, grads_b) = results
    assert out_a.keys() == out_b.keys() and all(torch.equal(out_a[k], out_b[k]) for k in out_a)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        a, b = grads_a[name], grads_b[name]
        assert (a is None and b is None) or torch.equal(a, b), name


# --- the config check and activation ----------------------------------------------------------------
def spec_with(*overrides):
    return spec_for("nam56r-tiny", *overrides, plugins=PLUGINS)


@pytest.mark.parametrize("pattern, found", [
    ("SFFSFFSFF", "first letter S"),
    ("FSSFSS", "6 letters for a model of 9 DSA layers"),
    ("FSSFXSFSS", "letters ['X']"),
    ("fssfssfss", "letters ['f', 's']"),
])
def test_config_check_refuses_a_bad_pattern(pattern, found):
    checks = config_rows(plugin.NAME, plugin.PLUGIN, spec_with(f"index-cache.pattern={pattern}"))
    [bad] = [c for c in checks if c.status == FAIL]
    assert bad.name == "pattern" and found in bad.found and "index-cache.pattern=FSSFSSFSS" in bad.hint
    with pytest.raises(PluginActivationError, match="index-cache: pattern"):
        s = spec_with(f"index-cache.pattern={pattern}")
        PluginHost().activate(s.plugins, CPU, s)


def context(strategy, notes, *, uses=True):
    """A StepContext as either engine builds it: the run's spec, its backends, a note sink."""
    s = spec_for("nam56r", "indexer_backend=index-cache" if uses else "indexer_backend=full")
    backends = dataclasses.replace(Backends.reference(), indexer=strategy).as_mapping()
    return StepContext(step=0, spec=s, backends=backends, parameters=lambda: iter(()), note=notes.append)


def test_step_hooks_ask_the_context_and_fail_closed():
    """The hooks read the run (DSA layers from its config) and the strategy from the context, through wrappers;
    the pattern is announced once the strategy has selected, not before; a run that selected index-cache but
    whose indexer is something else is an error, not a silent skip."""
    notes, strategy = [], IndexCache()
    plugin.nam_after_step(step=0, run=context(strategy, notes), metrics={})
    assert notes == []  # it has not run yet (a warm-up may hold the DSA layers dense): no claim
    strategy.reused, strategy.computed = 6, 3
    plugin.nam_after_step(step=1, run=context(strategy, notes), metrics={})
    plugin.nam_after_step(step=2, run=context(strategy, notes), metrics={})
    assert notes == ["index-cache: FSSFSSFSS: 6 of 9 DSA layers reuse a Full layer's top-k; indexer work saved 67%"]
    wrapped = IndexCache()
    wrapped.computed = 1
    wrapper = types.SimpleNamespace(wrapped=wrapped)  # e.g. lemyx, which runs it after its warm-up
    plugin.nam_after_step(step=0, run=context(wrapper, notes), metrics={})
    assert len(notes) == 2
    plugin.nam_after_step(step=0, run=context(FullIndexer(), notes, uses=False), metrics={})  # not used: nothing
    assert plugin.nam_run_report(run=context(FullIndexer(), notes, uses=False)) is None
    with pytest.raises(NamError, match="index-cache is selected but the run's indexer backends are"):
        plugin.nam_after_step(step=0, run=context(FullIndexer(), notes), metrics={})


def test_the_report_counts_what_ran_and_a_strategy_that_never_ran_claims_nothing():
    strategy = IndexCache()
    strategy.reused, strategy.computed, strategy.first_step = 12, 6, 1
    ctx = dataclasses.replace(context(strategy, []), step=3)
    assert plugin.nam_run_report(run=ctx) == ("index-cache: selected from step 2 to 3: 12 of 18 top-k selections "
                                              "reused a Full layer's (67% of indexer work saved)")
    warm = types.SimpleNamespace(wrapped=IndexCache(), warming_up=lambda: True, name="lemyx")
    line = plugin.nam_run_report(run=dataclasses.replace(context(warm, []), step=10))
    assert line == ("index-cache: did nothing in this run: 'lemyx' warmed up (dense attention) to the last step, 10, "
                    "so no DSA layer asked it for a top-k; no indexer work saved")
    assert "saved 67%" not in line
    idle = plugin.nam_run_report(run=dataclasses.replace(context(IndexCache(), []), step=10))
    assert idle == "index-cache: did nothing in this run: no DSA layer asked it for a top-k; no indexer work saved"


def test_the_strategy_counts_reused_and_computed_selections():
    """What the report is made of: every Shared layer that took its Full layer's top-k, every layer that ran its
    own indexer (Full layers, MTP layers, misses); a recompute replay counts nothing again."""
    strategy = IndexCache()  # FSSFSSFSS
    x, qr = inputs()
    state = state_for(x)
    for layer in dsa_stack(strategy) + dsa_stack(strategy, n=1, is_mtp=True):
        strategy.select(layer, x, qr, state)
    assert (strategy.reused, strategy.computed) == (6, 3 + 1)
    state.micro_batch = 1  # a stale cache: Shared layers miss and compute
    for layer in dsa_stack(strategy, n=3)[1:]:
        strategy.select(layer, x, qr, state)
    assert (strategy.reused, strategy.computed) == (6, 4 + 2)
    assert IndexCache().selections == 0


def test_config_check_passes_the_default_and_the_host_refuses_an_unknown_option():
    [check] = config_rows(plugin.NAME, plugin.PLUGIN, spec_with())
    assert check.status == PASS and check.found.startswith("FSSFSSFSS") and "saved 67%" in check.found
    with pytest.raises(ConfigError, match="did you mean index-cache.pattern") as e:
        spec_with("index-cache.patern=FFFFFFFFF")
    assert e.value.exit_code == 2 and "F (computes its top-k)" in e.value.message


def test_activates_with_reference_and_the_configured_pattern_reaches_the_strategy():
    host = PluginHost()
    host.activate(PLUGINS, CPU)
    assert host.registry("indexer").plugin_of("index-cache") == "index-cache"
    strategy = Backends.from_registries(host.registries, TINY.replace(indexer_backend="index-cache")).indexer
    assert isinstance(strategy, IndexCache) and strategy.pattern_for(9) == "FSSFSSFSS"

    s = spec_with("index-cache.pattern=FSFSFSFSF")
    host = PluginHost()
    host.activate(s.plugins, CPU, s)
    strategy = Backends.from_registries(host.registries, s.model, options=s.options).indexer
    assert isinstance(strategy, IndexCache) and strategy.pattern == "FSFSFSFSF"
    assert IndexCache().pattern is None


def test_requesting_the_plugin_selects_its_strategy_unless_set():
    s = spec_with()
    assert s.model.indexer_backend == "index-cache"
    assert s.notes == ("indexer_backend=index-cache (selected by plugin index-cache)",)
    s = spec_with("indexer=full")  # the field's old name still works on the command line
    assert s.model.indexer_backend == "full" and "would have selected index-cache" in s.notes[0]
    ev = PluginHost().evaluate(s.plugins, CPU, s)
    assert [c.name for c in ev.checks if c.plugin == "index-cache" and c.status == SKIP] == ["selected"]


# --- the CLI ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import json as json_mod
    import textwrap

    return prepare_corpus(tmp_path_factory, (json_mod, textwrap), chars=8000)


FAST = ["--plugins", "index-cache", "--set", "seq_len=32",
        "--set", "train.micro_batch_size=2"]


@pytest.mark.slow
def test_nam_train_runs_with_index_cache_and_a_configured_pattern(tmp_path, corpus, capsys):
    code = run(["train", *FAST, "--set", "index-cache.pattern=FSFSFSFSF", "--max-steps", "3",
                "--data", str(corpus), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 0, err
    plugins_json = json.loads((tmp_path / "run" / "plugins.json").read_text())
    assert "index-cache" in plugins_json["active"] and plugins_json["backends"]["indexer"] == "IndexCache"
    assert err.count("index-cache: FSFSFSFSF: 4 of 9 DSA layers reuse a Full layer's top-k; "
                     "indexer work saved 44%") == 1
    assert len(read_metrics(tmp_path / "run")) == 3


def test_nam_train_refuses_a_bad_pattern_with_exit_3(tmp_path, corpus, capsys):
    code = run(["train", *FAST, "--set", "index-cache.pattern=SSS", "--max-steps", "1",
                "--data", str(corpus), "--run-dir", str(tmp_path / "run")])
    assert code == 3
    err = capsys.readouterr().err
    assert "index-cache.pattern='SSS'" in err and "FSSFSSFSS" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_loss_falls_over_20_steps_with_index_cache(tmp_path, corpus, capsys):
    assert run(["train", *FAST, "--max-steps", "20", "--data", str(corpus),
                "--run-dir", str(tmp_path / "run")]) == 0
    assert "indexer work saved 67%" in capsys.readouterr().err
    losses = [m["loss"] for m in read_metrics(tmp_path / "run")]
    first, last = statistics.mean(losses[:3]), statistics.mean(losses[-3:])
    assert last < 0.8 * first, losses
