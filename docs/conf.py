"""Sphinx configuration: guides and examples are MyST notebooks executed at build time
(myst-nb, cached with jupyter-cache), the API reference comes from the docstrings.

Build with ``make docs`` (warnings are errors; a cell that raises fails the build).
"""

from __future__ import annotations

import os

# Pages execute in Jupyter kernels started from this process, which inherit these:
# CPU only (no probing for accelerators), and none of the user's ADV_JAX_MATH_*
# options, so that every page shows the defaults it describes.
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")
for _name in [k for k in os.environ if k.startswith("ADV_JAX_MATH_")]:
    del os.environ[_name]
# The kernel spec in _kernels/ is the venv's own Python ("python" is the interpreter
# running Sphinx) without the kernel's startup log lines.
_here = os.path.dirname(os.path.abspath(__file__))
os.environ["JUPYTER_PATH"] = os.pathsep.join(
    [os.path.join(_here, "_kernels"), *filter(None, [os.environ.get("JUPYTER_PATH")])]
)

import adv_jax_math  # noqa: E402

project = "adv_jax_math"
author = "adv_jax_math developers"
copyright = "the adv_jax_math developers"
release = version = adv_jax_math.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx_copybutton",
]

exclude_patterns = ["_build", "_kernels", "**.ipynb_checkpoints"]
templates_path = ["_templates"]
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# -- API reference from the docstrings (NumPy style) ------------------------------------
autosummary_generate = True
autosummary_imported_members = True
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
add_module_names = False

# -- MyST and notebook execution ------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("DOCS_EXECUTE", "cache")  # "off" for a quick look
nb_execution_cache_path = os.path.join(_here, "_build", ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a cell that raises fails the build
nb_execution_show_tb = True
nb_merge_streams = True
nb_output_stderr = "remove-warn"  # unexpected stderr (a JAX warning) fails the build
nb_execution_excludepatterns: list[str] = []

# -- HTML ---------------------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = "adv_jax_math"
html_theme_options = {
    "show_toc_level": 2,
    "navigation_with_keys": False,
    "home_page_in_toc": True,
    "use_download_button": False,
    "show_navbar_depth": 1,
}
html_last_updated_fmt = None
pygments_style = "default"


# -- docstring adjustments (no change to what the docstrings say) -----------------------
# Dataclasses the library returns (users read them, never build them): no constructor
# signature listing internal fields.
_NO_SIGNATURE = {"Plan", "LeafReduction", "MonoidReduction", "Kind", "Policy"}


def _signature(app, what, name, obj, options, signature, return_annotation):
    if what == "class" and name.rsplit(".", 1)[-1] in _NO_SIGNATURE:
        return "", None
    return None


# What each monoid constant equals in plain JAX: the first line of its page (and its
# summary in the API index). The rest is its class's docstring, which opens with the
# same expression ("``jnp.sum(y, 0)``: ..."); napoleon would read that opening line of
# a data docstring as "type: description", so this line goes first.
_MONOID_EQUALS = {
    "ADD": "``jnp.sum(y, 0)``",
    "MAX": "``jnp.max(y, 0)``",
    "MIN": "``jnp.min(y, 0)``",
    "LOGSUMEXP": "``jax.nn.logsumexp(y, 0)``",
    "ARGMIN": "``jnp.argmin(y, 0)``",
    "ARGMAX": "``jnp.argmax(y, 0)``",
    "MIN_ARGMIN": "``(jnp.min(y, 0), jnp.argmin(y, 0))``",
    "MAX_ARGMAX": "``(jnp.max(y, 0), jnp.argmax(y, 0))``",
    "SOFTMAX_WEIGHTED": "``jnp.tensordot(jax.nn.softmax(s, 0), v, ([0], [0]))`` of "
    "``fun``'s ``(s, v)``",
    "MEAN": "``jnp.mean(y, 0)``",
    "VAR": "``jnp.var(y, 0)``",
    "MEAN_VAR": "``(jnp.mean(y, 0), jnp.var(y, 0))``",
}


def _monoid_data(app, what, name, obj, options, lines):
    short = name.rsplit(".", 1)[-1]
    if what == "data" and isinstance(obj, adv_jax_math.Monoid):
        equals = _MONOID_EQUALS.get(short, f"``{obj!r}``")
        lines[:0] = [
            f"Reduces the rows as {equals}. A :class:`Monoid` (``{type(obj).__name__}``); "
            "pass it as ``reduction=``.",
            "",
        ]


# Their methods serve the engines; the reference shows their fields.
_FIELDS_ONLY = ("Plan", "LeafReduction", "MonoidReduction")


def _skip(app, what, name, obj, skip, options):
    owner = getattr(obj, "__qualname__", "").split(".")[0]
    if what == "class" and owner in _FIELDS_ONLY and callable(obj):
        return True
    return None


def setup(app):
    app.connect("autodoc-process-signature", _signature)
    app.connect("autodoc-skip-member", _skip)
    app.connect("autodoc-process-docstring", _monoid_data, priority=400)
