"""How a run uses its devices: the strategies that place and wrap the model (`strategy`: single, DP, DDP, FSDP),
mixed precision (`precision`), building on the meta device (`meta_init`), activation checkpointing, the host
allocator's tuning (`allocator`) and peak memory (`memory`). Strategies wrap; they do not own the loop."""
