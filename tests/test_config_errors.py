"""Bad options, environment variables and autotune cache files: each error names the
option (or variable), the value given and what is accepted; an unusable cache entry
is recomputed with a warning."""

from __future__ import annotations

import json
import math
import os
import re

import jax.numpy as jnp
import pytest

import adv_jax_math as ajm
from adv_jax_math.core import config as _config
from adv_jax_math.plan import autotune as _autotune

MIB = 2**20
N = 1024
BUDGET = 1 * MIB

W = jnp.cos(jnp.arange(8 * 512.0).reshape(8, 512))


def fun(x):
    return jnp.sum(jnp.tanh(x @ W) ** 2, axis=1)


def xs(n=N):
    return jnp.linspace(-1.0, 1.0, n * 8, dtype=jnp.float32).reshape(n, 8)


def plan_auto():
    return ajm.explain(fun, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for var in [v for v in os.environ if v.startswith("ADV_JAX_MATH_")]:
        if var != "ADV_JAX_MATH_NATIVE":  # the test run may set it on purpose
            monkeypatch.delenv(var)
    _autotune.clear_cache()
    yield
    _autotune.clear_cache()


# -- config(...) -----------------------------------------------------------------------

MODES = "\\('auto', "

OPTION_ERRORS = [
    ({"memory_budget": math.nan}, ValueError, r"memory_budget=nan must be a finite number"),
    ({"memory_budget": math.inf}, ValueError, r"memory_budget=inf must be a finite number"),
    ({"memory_budget": "1e400"}, ValueError, r"memory_budget='1e400' must be a finite"),
    ({"memory_budget": 0.5}, ValueError, r"memory_budget=0\.5 must be at least 1 byte"),
    ({"memory_budget": 0}, ValueError, r"memory_budget=0 must be at least 1 byte"),
    ({"memory_budget": "-3MiB"}, ValueError, r"memory_budget='-3MiB' is not a size; use"),
    ({"memory_budget": "lots"}, ValueError, r"memory_budget='lots' is not a size; use"),
    ({"memory_budget": True}, TypeError, r"memory_budget=True must be a number of bytes"),
    ({"memory_budget": [1]}, TypeError, r"memory_budget=\[1\] must be an int or a str"),
    ({"backend": "gpu"}, ValueError, r"backend='gpu' is not one of " + MODES),
    ({"native": "maybe"}, ValueError, r"native='maybe' is not one of " + MODES),
    ({"remainder": "sideways"}, ValueError, r"remainder='sideways' is not one of " + MODES),
    ({"autotune_grad": "often"}, ValueError, r"autotune_grad='often' is not one of " + MODES),
    ({"remat": 1}, TypeError, r"remat=1 must be a bool"),
    ({"progress": "yes"}, TypeError, r"progress='yes' must be a bool"),
    ({"roofline": 1}, TypeError, r"roofline=1 must be a bool"),
    ({"autotune_cache": 3}, TypeError, r"autotune_cache=3 must be a path or None"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), OPTION_ERRORS)
def test_config_rejects(kwargs, error, match):
    with pytest.raises(error, match=match), ajm.config(**kwargs):
        pass


def test_options_rejects_like_config():
    with pytest.raises(ValueError, match=r"memory_budget=nan must be a finite"):
        _config.Options(memory_budget=math.nan)


def test_config_cache_in_missing_directory(tmp_path):
    path = str(tmp_path / "nowhere" / "cache.json")
    folder = re.escape(repr(str(tmp_path / "nowhere")))
    with (
        pytest.raises(FileNotFoundError, match=rf"autotune_cache=.*the directory {folder}"),
        ajm.config(autotune_cache=path),
    ):
        pass


def test_config_cache_below_a_file(tmp_path):
    (tmp_path / "file").write_text("")
    path = str(tmp_path / "file" / "cache.json")
    with (
        pytest.raises(FileNotFoundError, match=r"autotune_cache=.* is not a directory; create"),
        ajm.config(autotune_cache=path),
    ):
        pass


def test_config_cache_is_a_directory(tmp_path):
    with (
        pytest.raises(IsADirectoryError, match=r"autotune_cache=.* is a directory; name a JSON"),
        ajm.config(autotune_cache=tmp_path),
    ):
        pass


# -- environment variables ------------------------------------------------------------

BOOLS = re.escape(str(_config._TRUE + _config._FALSE))

ENV_ERRORS = [
    ("ADV_JAX_MATH_BACKEND", "bogus", ValueError, "backend='bogus' is not one of " + MODES),
    ("ADV_JAX_MATH_REMAT", "maybe", ValueError, "is not a boolean; set it to one of " + BOOLS),
    ("ADV_JAX_MATH_NATIVE", "Never", ValueError, "native='never' is not one of " + MODES),
    ("ADV_JAX_MATH_REMAINDER", "x", ValueError, "remainder='x' is not one of " + MODES),
    ("ADV_JAX_MATH_MEMORY_BUDGET", "nan", ValueError, "is not a size; use bytes"),
    ("ADV_JAX_MATH_MEMORY_BUDGET", "1e999", ValueError, "must be a finite number of bytes"),
    ("ADV_JAX_MATH_MEMORY_BUDGET", "0.1", ValueError, "must be at least 1 byte"),
    ("ADV_JAX_MATH_MEMORY_BUDGET", "lots", ValueError, "is not a size; use bytes"),
    ("ADV_JAX_MATH_AUTOTUNE_GRAD", "often", ValueError, "autotune_grad='often' is not one of "),
    ("ADV_JAX_MATH_PROGRESS", "loud", ValueError, "is not a boolean; set it to one of " + BOOLS),
    ("ADV_JAX_MATH_ROOFLINE", "maybe", ValueError, "is not a boolean; set it to one of " + BOOLS),
    ("ADV_JAX_MATH_AUTOTUNE_CACHE", "/no/such/dir/c.json", FileNotFoundError, "'/no/such/dir'"),
]


@pytest.mark.parametrize(("var", "value", "error", "match"), ENV_ERRORS)
def test_environment_variable_rejected(monkeypatch, var, value, error, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(error, match=re.escape(f"{var}={value!r}") + ".*" + match):
        _config.current()
    with pytest.raises(error, match=re.escape(f"{var}={value!r}")):  # and from a call
        ajm.batch_map(fun, xs(), "auto", reduction=jnp.add, chunk_reduction=jnp.sum)
    assert not _autotune._MEMORY  # before any planning


@pytest.mark.parametrize(
    ("var", "value", "field", "expected"),
    [
        ("ADV_JAX_MATH_BACKEND", " Scan ", "backend", "scan"),
        ("ADV_JAX_MATH_REMAT", "off", "remat", False),
        ("ADV_JAX_MATH_NATIVE", "", "native", "auto"),
        ("ADV_JAX_MATH_REMAINDER", "SEPARATE", "remainder", "separate"),
        ("ADV_JAX_MATH_MEMORY_BUDGET", "2MiB", "memory_budget", 2 * MIB),
        ("ADV_JAX_MATH_AUTOTUNE_GRAD", "never", "autotune_grad", "never"),
        ("ADV_JAX_MATH_PROGRESS", "yes", "progress", True),
        ("ADV_JAX_MATH_ROOFLINE", "off", "roofline", False),
    ],
)
def test_environment_variable_accepted(monkeypatch, var, value, field, expected):
    monkeypatch.setenv(var, value)
    assert getattr(_config.current(), field) == expected


# -- the disk cache -------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """(key, entry) of a valid decision for ``plan_auto()`` under ``BUDGET``."""
    path = tmp_path_factory.mktemp("cache") / "autotune.json"
    _autotune.clear_cache()
    with ajm.config(memory_budget=BUDGET, autotune_cache=str(path)):
        assert plan_auto().autotune.cache == "computed"
    _autotune.clear_cache()
    ((key, entry),) = json.loads(path.read_text()).items()
    return key, entry


OTHER = {"someone else's": "entry, left alone"}


def edited(entry, **changes):
    return {**entry, **changes}


def without(entry, name):
    return {k: v for k, v in entry.items() if k != name}


def candidate(entry, **changes):
    return edited(entry, candidates=[{**entry["candidates"][0], **changes}])


ENTRY_ERRORS = [
    (lambda e: edited(e, batch_size=0), r"batch_size=0 is not an int >= 1"),
    (lambda e: edited(e, batch_size=-5), r"batch_size=-5 is not an int >= 1"),
    (lambda e: edited(e, batch_size="64"), r"batch_size='64' is not an int >= 1"),
    (lambda e: edited(e, batch_size=True), r"batch_size=True is not an int >= 1"),
    (lambda e: edited(e, batch_size=64.0), r"batch_size=64\.0 is not an int >= 1"),
    (lambda e: edited(e, batch_size=N + 1), rf"batch_size={N + 1} is not in \[1, n={N}\]"),
    (lambda e: edited(e, n=N // 2), rf"n={N // 2} is not the call's n={N}"),
    (lambda e: edited(e, budget=BUDGET * 2), rf"budget={BUDGET * 2} is not the call's budget"),
    (lambda e: edited(e, fixed_bytes=-1), r"fixed_bytes=-1 is not an int >= 0"),
    (lambda e: edited(e, row_bytes=math.nan), r"row_bytes=nan is not a finite number"),
    (lambda e: edited(e, reason=None), r"reason=None is not a string"),
    (lambda e: without(e, "reason"), r"the entry has no reason"),
    (lambda e: edited(e, colour="blue"), r"the entry has unknown fields colour"),
    (lambda e: 7, r"the entry is 7, not an object"),
    (lambda e: edited(e, candidates={"rows": 16}), r"candidates=\{'rows': 16\} is not a list"),
    (lambda e: edited(e, candidates=[16]), r"candidates\[0\] is 16, not an object"),
    (lambda e: candidate(e, rows=0), r"candidates\[0\]: rows=0 is not an int >= 1"),
    (lambda e: candidate(e, rows=N * 2), rf"candidates\[0\]: rows={N * 2} is not in \[1, n="),
    (lambda e: candidate(e, measured="yes"), r"candidates\[0\]: measured='yes' is not a boolean"),
    (lambda e: candidate(e, seconds="fast"), r"candidates\[0\]: seconds='fast' is not a finite"),
    (lambda e: candidate(e, bytes=None), r"candidates\[0\]: bytes=None is not an int >= 0"),
]


@pytest.mark.parametrize(("edit", "match"), ENTRY_ERRORS)
def test_unusable_entry_is_recomputed_with_a_warning(tmp_path, stored, edit, match):
    key, entry = stored
    path = tmp_path / "autotune.json"
    path.write_text(json.dumps({key: edit(json.loads(json.dumps(entry))), **OTHER}))
    where = re.escape(f"autotune cache {str(path)!r}: entry {key!r} is unusable (")
    with ajm.config(memory_budget=BUDGET, autotune_cache=str(path)):
        with pytest.warns(UserWarning, match=where + match + r".*recomputed and replaces it"):
            plan = plan_auto()
        assert plan.autotune.cache == "computed" and 1 <= plan.batch_size <= N
        saved = json.loads(path.read_text())
        assert saved.keys() == {key, *OTHER} and saved["someone else's"] == OTHER["someone else's"]
        assert _autotune.Decision.from_json(saved[key], N, BUDGET).batch_size == plan.batch_size
        _autotune.clear_cache()
        assert plan_auto().autotune.cache == "disk cache hit"  # no warning now


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", r"it is not JSON: "),
        ("", r"it is not JSON: "),
        ("[1, 2]", r"it holds a JSON list, not an object of entries"),
        ('"text"', r"it holds a JSON str, not an object of entries"),
    ],
)
def test_unusable_file_is_left_alone_with_a_warning(tmp_path, text, match):
    path = tmp_path / "autotune.json"
    path.write_text(text)
    where = re.escape(f"autotune cache {str(path)!r} is unusable (")
    with (
        ajm.config(memory_budget=BUDGET, autotune_cache=str(path)),
        pytest.warns(UserWarning, match=where + match + r".*memory only: fix or delete"),
    ):
        plan = plan_auto()
    assert plan.autotune.cache == "computed" and 1 <= plan.batch_size <= N
    assert path.read_text() == text
    assert sorted(os.listdir(tmp_path)) == ["autotune.json"]


def test_cache_that_cannot_be_written_warns(tmp_path):
    path = tmp_path / "autotune.json"
    (tmp_path / f"autotune.json.{os.getpid()}.tmp").mkdir()  # where the write would go
    with (
        ajm.config(memory_budget=BUDGET, autotune_cache=str(path)),
        pytest.warns(UserWarning, match=r"autotune cache .* the decision cannot be saved"),
    ):
        plan = plan_auto()
    assert plan.autotune.cache == "computed" and not path.exists()


def test_cache_in_a_new_file_is_created(tmp_path):
    path = tmp_path / "autotune.json"
    with ajm.config(memory_budget=BUDGET, autotune_cache=str(path)):
        plan = plan_auto()
    (entry,) = json.loads(path.read_text()).values()
    assert _autotune.Decision.from_json(entry, N, BUDGET).batch_size == plan.batch_size
