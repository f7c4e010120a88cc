"""Pipeline parallelism on torch.distributed.pipelining: the split into stages (proven before the first step), the
stage program, and the runner that steps the schedule inside Lightning's loop."""
