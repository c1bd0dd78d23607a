"""The stand-in's ops (see __init__.py): any name, failing when used."""


def __getattr__(name):
    if name.startswith("__"):  # hasattr() and import machinery probes
        raise AttributeError(name)
    raise RuntimeError(f"DALI is not installed: nvidia.dali.ops.{name} is a stand-in")
