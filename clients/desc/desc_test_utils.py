"""Our own small stand-in for DESC's ``tests/utils.py`` (absent from the sdist).

``run.sh`` copies it to ``<sdist>/tests/utils.py`` at run time. Only what the
selected DESC tests import is provided: ``FiniteDiffDerivative``, a
central-difference derivative with the interface of ``desc.derivatives``'
``AutoDiffDerivative`` (``__call__``/``compute`` for ``mode`` "fwd" | "grad" |
"hess", classmethods ``compute_vjp``, ``compute_jvp``/``compute_jvp2``/``compute_jvp3``).
Written for this harness; no DESC code.
"""

from __future__ import annotations

import numpy as np


def _tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


class FiniteDiffDerivative:
    """Finite-difference Jacobian / gradient / Hessian of ``fun`` w.r.t. ``argnum``."""

    def __init__(self, fun, argnum=0, mode="fwd", rel_step=1e-3, **kwargs):
        if mode not in ("fwd", "rev", "grad", "hess", "jvp"):
            raise ValueError(f"invalid mode {mode!r}")
        self._fun, self._argnum, self._mode, self._rel_step = fun, argnum, mode, rel_step

    @property
    def fun(self):
        return self._fun

    @property
    def argnum(self):
        return self._argnum

    @property
    def mode(self):
        return self._mode

    def _jac(self, fun, args, kwargs):
        args = list(args)
        x = np.asarray(args[self._argnum], dtype=float)
        f0 = np.asarray(fun(*args, **kwargs))
        out = np.zeros(f0.shape + x.shape)
        for idx in np.ndindex(*x.shape):
            h = self._rel_step * max(1.0, abs(x[idx]))
            xp, xm = x.copy(), x.copy()
            xp[idx] += h
            xm[idx] -= h
            args[self._argnum] = xp
            fp = np.asarray(fun(*args, **kwargs))
            args[self._argnum] = xm
            fm = np.asarray(fun(*args, **kwargs))
            out[(Ellipsis, *idx)] = (fp - fm) / (2 * h)
        return out

    def compute(self, *args, **kwargs):
        if self._mode in ("fwd", "rev", "grad"):
            return self._jac(self._fun, args, kwargs)
        if self._mode == "hess":
            grad = FiniteDiffDerivative(self._fun, self._argnum, "grad", self._rel_step)
            return self._jac(grad.compute, args, kwargs)
        return self.compute_jvp(self._fun, self._argnum, *args, **kwargs)

    __call__ = compute

    @classmethod
    def compute_vjp(cls, fun, argnum, v, *args, rel_step=1e-3, **kwargs):
        jac = cls(fun, argnum, "fwd", rel_step)._jac(fun, args, kwargs)
        v = np.asarray(v)
        return np.tensordot(v, jac, axes=v.ndim)

    @classmethod
    def compute_jvp(cls, fun, argnum, v, *args, rel_step=1e-3, **kwargs):
        argnum, v = _tuple(argnum), _tuple(v)
        norm = np.sqrt(sum(float(np.sum(np.asarray(vi) ** 2)) for vi in v)) or 1.0
        h = rel_step / norm

        def shifted(s):
            a = list(args)
            for i, vi in zip(argnum, v, strict=True):
                a[i] = np.asarray(a[i]) + s * h * np.asarray(vi)
            return np.asarray(fun(*a, **kwargs))

        return (shifted(1) - shifted(-1)) / (2 * h)

    @classmethod
    def compute_jvp2(cls, fun, argnum1, argnum2, v1, v2, *args, **kwargs):
        inner = lambda *a: cls.compute_jvp(fun, argnum1, v1, *a, **kwargs)
        return cls.compute_jvp(inner, argnum2, v2, *args)

    @classmethod
    def compute_jvp3(cls, fun, argnum1, argnum2, argnum3, v1, v2, v3, *args, **kwargs):
        inner = lambda *a: cls.compute_jvp2(fun, argnum1, argnum2, v1, v2, *a, **kwargs)
        return cls.compute_jvp(inner, argnum3, v3, *args)
