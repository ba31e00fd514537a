"""Which callables on a model are this pack's: every callable it installs carries the ``sage_strided_nhd``
attribute. Also how another node's forward patch is recognised and named in a message."""


def is_own(obj) -> bool:
    return bool(getattr(obj, "sage_strided_nhd", False))


def is_foreign(obj) -> bool:
    """Another node's callable (None: nothing installed)."""
    return obj is not None and not is_own(obj)


def plain_function(obj):
    """The plain function behind a bound method (object patches are often ``types.MethodType``)."""
    return getattr(obj, "__func__", obj)


def replaced_forward(module, name: str = "forward") -> bool:
    """Another node's ``name`` method is on ``module`` (ComfyUI restores an object patch by setting the
    original bound method back, so the attribute alone proves nothing)."""
    fwd = vars(module).get(name)
    return fwd is not None and plain_function(fwd) is not getattr(type(module), name, None)


def describe(obj) -> str:
    fn = plain_function(obj)
    module = getattr(fn, "__module__", None) or type(obj).__module__
    return f"{module}.{getattr(fn, '__qualname__', None) or type(obj).__qualname__}"
