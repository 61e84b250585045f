"""A user's program with type mistakes, which ``mypy --strict`` must find through our
annotations (tests/python/test_typing.py). Never run."""
from __future__ import annotations

import torch

from tensordict_cpp import Publisher, TensorDict

td = TensorDict(w=torch.zeros(4), batch_size=[4])
batch: str = td.batch_size  # a torch.Size
version: str = Publisher(max_slots=2).publish(td)  # an int
td.send(1, timeout="soon")  # a number of seconds, a timedelta or None
