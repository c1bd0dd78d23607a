"""Names other modules check against, at the bottom of the import graph (torchvision only, imported when
the models are listed): the classes of the data set and the torchvision classifiers a run may name.
config.py checks --model while parsing, models.py builds the models, data.py labels with the classes."""
from __future__ import annotations

NUM_CLASSES = 10  # CIFAR10, and the synthetic stand-in


def classification_models() -> list[str]:
    import torchvision  # here, not above: a process that only names classes or parses flags skips its import

    return sorted(torchvision.models.list_models(module=torchvision.models))


def unknown_model(name: str) -> str | None:
    """The one-line refusal of a model name torchvision does not have, else None."""
    if name in classification_models():
        return None
    return (f"unknown model '{name}'; any torchvision classification model works, "
            f"e.g. resnet18, resnet50, mobilenet_v3_small, vit_b_16")
