"""Who runs the model: in-process (one rank) or torch.distributed worker processes, and the
tensor-parallel process state the sharded layers read."""
