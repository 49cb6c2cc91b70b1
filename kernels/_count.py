"""The last program of a launch to finish, found with a count in global memory: it sees every other program's
stores, so it can reduce what they wrote, in the same launch (kernels/argmax.py's merge, kernels/route.py's
selection). The count is int32 [1], zero before the launch, put back to zero by that last program (``reset``), so a
captured graph replays it.

Every thread's stores come before the count's release (the barrier, then one acq_rel add), and the last program's
loads after its acquire: CUDA's threadfence-reduction pattern. The last program reads the others' stores past the L1
cache (``cache_modifier=".cg"``). Under the interpreter the programs run one by one, and the last is the last.
"""
import triton
import triton.language as tl


@triton.jit
def last_to_arrive(count, programs):
    """True in the program that finishes last of ``programs``, after every program's stores so far."""
    tl.debug_barrier()
    return tl.atomic_add(count, 1, sem="acq_rel") == programs - 1


@triton.jit
def reset(count):
    """The count back at zero, for the next launch (the last program's last act)."""
    tl.atomic_xchg(count, 0)
