"""A run: its folder, lock, signals, worker processes, and the pipeline over its stages.

`pipeline` runs the stages in order and resumes them; `rundir` checks the run folder and the
config before any work (and decides what `--resume` reuses); `lock` keeps a second run out;
`interrupt` turns signals into a clean stop; `launch` starts the workers under torchrun;
`status` is each worker's heartbeat. Nothing is imported here: the CLI reads a config and checks
the run folder without loading torch.
"""
