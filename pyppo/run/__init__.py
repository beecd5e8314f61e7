"""The run around the PPO steps, above :mod:`pyppo.trainer`, which it drives: the trainer with its
run methods (:mod:`.trainer`, ``pyppo.PPOTrainer``), the loop and its cadences (:mod:`.loop`), the
run directory and its file names (:mod:`.rundir`), held-out evaluation (:mod:`.evaluate`),
checkpoints (:mod:`.checkpoint`), the exported policy (:mod:`.export`), signals (:mod:`.stopping`),
the weights' last non-finite check (:mod:`.nonfinite`), the curves (:mod:`.plotting`),
``config.toml`` (:mod:`.config_file`), the memory allocator (:mod:`.allocator`), the checks
after each step of what it could not teach (:mod:`.doctor`) and the other libraries' output held
back, their telemetry off (:mod:`.quiet`).

The trainer imports nothing of this package."""
