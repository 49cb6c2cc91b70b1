"""Without a GPU the Triton kernels run through Triton's interpreter; the switch must be set before any
test module imports Triton (it is read when the kernels' decorators run)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
