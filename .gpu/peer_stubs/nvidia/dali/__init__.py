"""A stand-in for NVIDIA DALI, imported by DeepLearningExamples' ConvNets trainer (image_classification/
dataloaders.py defines its DALI pipelines at module level, so the trainer does not import without DALI, even with
its synthetic data backend, which never calls them). The lease's machine has no network and DALI's wheel is far
over what a run carries, so .gpu/peer.sh puts this folder on PYTHONPATH; the trainer's own code runs unchanged.
`nvidia` has no __init__.py here: it stays a namespace package, and torch still finds its nvidia.* CUDA wheels."""
