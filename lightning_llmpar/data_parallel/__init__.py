"""The data-parallel dimension: ZeRO 0-3 and hybrid sharding on FSDP2 (pure data parallelism on DDP), or on a
DeepSpeed engine, and gradient compression on the data-parallel axis."""
