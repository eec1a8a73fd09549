"""Beyond one process: pipeline stages over torch.distributed (`pipeline_parallel_size`),
each rank holding a contiguous run of the decoder layers with its own offloading."""
