"""The one generic registry: lookups, the "unknown X" error, ``name:options`` spelling, and one
registry per kind, used by compressors, consistency policies, pipeline schedules and modes."""
from __future__ import annotations

import pytest

import parlay.compress.base as compress_base
import parlay.pipeline.schedule as schedule
import parlay.ps.consistency as consistency
import parlay.strategies as strategies
from parlay.errors import ConfigError
from parlay.registry import Registry, registries, split_spec

# kind -> (module that owns its registry, its public getter, a misspelling of a valid name,
# the name that misspelling should suggest)
KINDS = {
    "compression": (compress_base, compress_base.get_compressor, "topkk", "topk"),
    "consistency": (consistency, consistency.get_consistency, "sycn", "sync"),
    "pipeline schedule": (schedule, schedule.get_schedule, "gpip", "gpipe"),
    "mode": (strategies, strategies.get_strategy, "allreduc", "allreduce"),
}


def test_one_registry_per_kind_and_each_module_uses_it():
    found = registries()
    assert set(KINDS) <= set(found)
    for kind, (module, _, _, _) in KINDS.items():
        assert module._REGISTRY is found[kind], kind   # the module's table is the shared one
        assert isinstance(found[kind], Registry)
    with pytest.raises(ConfigError, match="a registry of 'compression' exists already"):
        Registry("compression")


def test_every_registry_kind_is_enumerated_here():
    # A new kind gets its row in KINDS, and with it every generic test below.
    assert set(registries()) - {"test widget"} == set(KINDS)


def test_public_listings_come_from_the_registries():
    assert compress_base.available() == registries()["compression"].available()
    assert consistency.available_consistency() == ["async", "stale", "sync"]
    assert schedule.available_schedules() == registries()["pipeline schedule"].available()
    assert {"allreduce", "ps", "hybrid"} <= set(strategies.available_strategies())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_unknown_name_error_names_kind_name_valid_names_and_closest(kind):
    _, getter, typo, close = KINDS[kind]
    reg = registries()[kind]
    with pytest.raises(ConfigError) as info:
        getter(typo)
    msg = str(info.value)
    assert msg.startswith(f"unknown {kind} {typo!r}; ")
    assert ", ".join(reg.available()) in msg         # every valid name, sorted
    assert f"did you mean {close!r}?" in msg
    with pytest.raises(ConfigError) as far:             # nothing close: no suggestion
        getter("zzzzzzzz")
    assert "did you mean" not in str(far.value)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_every_registry_is_sorted_and_non_empty(kind):
    names = registries()[kind].available()
    assert names and names == sorted(names) and len(set(names)) == len(names)


def test_existing_error_texts_are_kept():
    with pytest.raises(ConfigError, match=r"^unknown compression 'gzip'; valid names: .*"
                       r"\(options after a colon, e\.g\. 'topk:0\.01'\)\.$"):
        compress_base.get_compressor("gzip")
    with pytest.raises(ConfigError, match=r"unknown pipeline schedule 'zb'; valid schedules: "):
        schedule.get_schedule("zb")
    with pytest.raises(ConfigError, match=r"unknown mode 'nope'; valid modes: "):
        strategies.get_strategy("nope")
    with pytest.raises(ConfigError, match=r"unknown consistency 'bsp'; valid: async, stale, sync"):
        consistency.get_consistency("bsp")


@pytest.mark.parametrize("spec, want", [
    ("sync", ("sync", [])),
    ("stale:2", ("stale", ["2"])),
    ("  TopK:0.01, momentum=0.9 ,", ("topk", ["0.01", "momentum=0.9"])),
    ("stale:", ("stale", [])),
    ("powersgd:2,warmup=10", ("powersgd", ["2", "warmup=10"])),
])
def test_split_spec(spec, want):
    assert split_spec(spec) == want


def test_split_spec_rejects_non_strings():
    with pytest.raises(ConfigError, match="'name:options' string, got int"):
        split_spec(3)  # type: ignore[arg-type]


def test_options_reach_the_factories():
    assert compress_base.get_compressor("TOPK:0.001,warmup=7").warmup_steps == 7
    assert consistency.get_consistency("Stale:3").bound == 3
    with pytest.raises(ConfigError, match="'async' takes no option"):
        consistency.get_consistency("async:2")
    assert schedule.get_schedule("Looped-BFS").name == "loopedbfs"


def test_a_private_registry_registers_normalizes_and_loads_lazily():
    loaded: list[str | None] = []

    def load(key):
        loaded.append(key)
        if key == "late":
            reg.register("late", "entry")

    reg: Registry[str] = Registry("test widget", valid="valid widgets",
                                  normalize=lambda n: n.lower().replace("_", ""), load=load)
    try:
        reg.register("Big_One", "big")
        assert reg.get("BIGONE") == "big" and "big_one" in reg and 3 not in reg
        assert reg.get("late") == "entry" and loaded == ["late"]
        entry, opts = reg.lookup("big_one:1,b=2")
        assert entry == "big" and opts == ["1", "b=2"]
        reg.register("big_one", "big")                    # the same entry again: fine
        with pytest.raises(ConfigError, match=r"^test widget 'bigone' is registered already "
                           r"\('big'\)\. Hint: .*replace=True"):
            reg.register("bigone", "other")                # another entry: refused
        reg.register("bigone", "replaced", replace=True)
        assert reg.get("bigone") == "replaced"
        with pytest.raises(ConfigError, match=r"get\(\) takes a bare test widget name, got "
                           r"'bigone:1'\. Hint: lookup\('bigone:1'\)"):
            reg.get("bigone:1")
        with pytest.raises(ConfigError, match=r"^unknown test widget 'bigon:1'; valid widgets: "
                           r"bigone, late\. Hint: did you mean 'bigone'\?$"):
            reg.lookup("bigon:1")
        assert loaded[-1] is None                          # listing asks for every entry
    finally:
        import parlay.registry as registry

        registry._ALL.pop("test widget", None)
