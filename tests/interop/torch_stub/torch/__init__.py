"""A stand-in for torch: onnxruntime.training's __init__ imports torch (PyPI's build is 5 GB)
though its training API never calls it. Any attribute is a placeholder; using one for real fails."""

__version__ = "0.0.0+stub"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, name: str) -> "_Placeholder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: torch is a stub in this environment")

    def __getitem__(self, key) -> "_Placeholder":
        return self

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name: str) -> _Placeholder:
    if name.startswith("__"):
        raise AttributeError(name)
    return _Placeholder(f"torch.{name}")
