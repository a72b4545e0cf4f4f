"""A pipeline seen from its head: connect, plan and load the stages, drive them (transport,
batcher), the server engine over them, speculative verify steps and recovery."""
