"""Smallest parlay program: every rank says hello and the ranks complete an allreduce.

    parlay run -n 2 examples/hello.py
"""
import torch

import parlay

parlay.init()
t = torch.tensor([float(parlay.rank() + 1)])
parlay.comm.allreduce(t, "sum")
expected = parlay.size() * (parlay.size() + 1) / 2
print(f"hello from rank {parlay.rank()} of {parlay.size()} (role {parlay.role()}): "
      f"allreduce sum = {t.item():g} (expected {expected:g})", flush=True)
assert t.item() == expected
parlay.shutdown()
