"""The run: the loop, the governor and its state, checkpoints, the run dir and its log, faults."""
