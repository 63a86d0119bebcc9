"""TE functions that fp8vit replaces for the whole process, and gives back.

TE's modules look some of their helpers up in a module at each call (the extension's
``bgrad_quantize`` and ``layernorm_bwd``, ``general_gemm`` in ``module/linear.py`` and its
siblings), so setting that module attribute reroutes every call site at once, and setting TE's
function back undoes it. A :class:`Route` holds one such replacement: which attributes, how
fp8vit's function wraps TE's, whether it can run here, and TE's functions while it is installed.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

from .loader import te_module

__all__ = ["Route", "switched"]


@contextlib.contextmanager
def switched(current: Callable[[], bool], setter: Callable[[bool], Any], enabled: bool) -> Iterator[Any]:
    """``setter(enabled)`` for the duration of the block (yields what it returned), then the
    setting ``current()`` read before it, also when the block raises (where ``setter`` itself
    raises, nothing changed and nothing is restored)."""
    old = current()
    now = setter(enabled)
    try:
        yield now
    finally:
        setter(old)


class Route:
    """fp8vit's replacement for TE functions found as module attributes.

    Args:
        targets: ``(module name, attribute)`` of each TE function to replace.
        wrap: TE's function -> fp8vit's (which calls TE's where it does not apply).
        supported: whether fp8vit's function can run here (checked when installing; where it
            cannot, TE keeps its functions and :meth:`set` returns False).
        on_remove: called after TE's functions are back (to drop state the replacement kept).
    """

    def __init__(self, targets: Sequence[Tuple[str, str]], wrap: Callable[[Any], Any],
                 supported: Callable[[], bool], on_remove: Optional[Callable[[], None]] = None):
        self._targets = tuple(targets)
        self._wrap, self._supported, self._on_remove = wrap, supported, on_remove
        self._te: Dict[Tuple[str, str], Any] = {}  # TE's own functions while fp8vit's are installed

    def enabled(self) -> bool:
        """Whether fp8vit's functions are installed."""
        return bool(self._te)

    def te_function(self, module: str, attribute: str) -> Any:
        """TE's own function at ``module.attribute``, installed or not."""
        return self._te.get((module, attribute)) or getattr(te_module(module), attribute)

    def set(self, enable: bool) -> bool:
        """Install fp8vit's functions (True) or give TE its own back (False); returns whether
        fp8vit's are installed after the call. Importing TE's modules raises
        :class:`~fp8vit.errors.TEUnavailableError` where TE does not import."""
        if enable == self.enabled():  # nothing to do (nor TE to import)
            return enable
        if not enable:
            for (module, attribute), te_fn in self._te.items():
                setattr(te_module(module), attribute, te_fn)
            self._te.clear()
            if self._on_remove is not None:
                self._on_remove()
        elif self._supported():
            for module, attribute in self._targets:
                mod = te_module(module)
                self._te[(module, attribute)] = getattr(mod, attribute)
                setattr(mod, attribute, self._wrap(self._te[(module, attribute)]))
        return self.enabled()

    def scope(self, enabled: bool) -> contextlib.AbstractContextManager:
        """:meth:`set` for the duration of a ``with`` block (it yields whether fp8vit's functions
        are installed), then the previous setting again."""
        return switched(self.enabled, self.set, enabled)
