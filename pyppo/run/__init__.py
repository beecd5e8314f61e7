"""A run around the PPO steps: the loop and its cadences (:mod:`.loop`), the run directory and its
file names (:mod:`.rundir`), held-out evaluation (:mod:`.evaluate`), checkpoints
(:mod:`.checkpoint`), the exported policy (:mod:`.export`), signals (:mod:`.stopping`), the
non-finite guard (:mod:`.nonfinite`), the curves (:mod:`.plotting`), ``config.toml``
(:mod:`.config_file`) and the other libraries' output held back while the progress bar is drawn
(:mod:`.quiet`).

Nothing here imports the trainer: the loop drives any object with its interface."""
