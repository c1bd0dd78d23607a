"""A process's exit without the last garbage-collector walk.

Python's exit runs the cyclic garbage collector over every object still alive, and torch, torchvision and
DeepSpeed leave about a million from their imports: 0.7-0.8 s of every process's exit on a 2-core machine
(`python -c "import torch, torchvision"` 3.2 s, with this 2.5 s; a 2-rank DDP launch 0.9 s less). Frozen
objects are skipped by that walk. Imported first by common/, this handler runs after the atexit handlers
registered later (logging, profilers, DeepSpeed); objects freed by reference counting are still freed, and
the OS takes back the rest.
"""
import atexit
import gc

atexit.register(gc.freeze)
