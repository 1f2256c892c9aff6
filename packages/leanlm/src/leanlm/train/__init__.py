"""Training: the loop every training stage runs and what it is made of.

`trainer` is the loop (resume, step, log/evaluate, checkpoint, finish); `engines` spreads the
model and optimizer over processes (DDP, ZeRO, FSDP2); `optim` builds the optimizer;
`checkpoint` writes and reads training checkpoints atomically; `model` builds and loads the
models; `evaluate` scores them; `distill` and `teacher_cache` are the pieces of distillation.
Nothing is imported here, so importing one module loads only what it needs.
"""
