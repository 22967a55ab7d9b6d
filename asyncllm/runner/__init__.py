"""Runs the engine's steps on the device: the model runner (pack a step, forward, sample), CUDA
graphs, and tensor-parallel workers. The engine core above schedules; the model below computes."""
