"""The stand-in's Pipeline (see __init__.py): a base class to define subclasses of, never to run."""


class Pipeline:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("DALI is not installed: .gpu/peer.sh runs the trainer with --data-backend synthetic only")
