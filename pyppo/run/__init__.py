"""A run around the PPO steps: the loop and its cadences (:mod:`.loop`), the run directory and its
file names (:mod:`.rundir`), held-out evaluation (:mod:`.evaluate`), checkpoints
(:mod:`.checkpoint`), the exported policy (:mod:`.export`), signals (:mod:`.stopping`), the
non-finite guard (:mod:`.nonfinite`) and the curves (:mod:`.plotting`).

Nothing here imports the trainer: the loop drives any object with its interface."""
